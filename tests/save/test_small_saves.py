"""A save of one request (``engines.small``) keeps every guarantee of a large one: its bytes are
checksummed and verified on load, and everything the commit needs is fsynced before the
manifest's rename, the directory after it."""

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import ChecksumMismatchError, NVMeReader, NVMeWriter
from dcp_nvme.format.container import MANIFEST, temp_of
from dcp_nvme.format.manifest import read_manifest
from dcp_nvme.save.writer import NVMeWriter as Writer
from dcp_nvme.storage.local_dir import LocalStore


def _state():
    return {"model": {f"layer{i}.weight": torch.randn(32768) for i in range(8)}, "step": 7}


def _blank():
    return {"model": {f"layer{i}.weight": torch.zeros(32768) for i in range(8)}, "step": 0}


def _name(fd: int) -> str:
    return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))


def test_a_small_container_is_one_write_and_verifies_on_load(tmp_path, monkeypatch):
    writes: list[str] = []
    for call in ("pwrite", "pwritev"):
        real = getattr(os, call)
        monkeypatch.setattr(os, call, lambda fd, data, offset, real=real: writes.append(_name(fd)) or
                            real(fd, data, offset))
    state = _state()
    dcp.save(state, storage_writer=NVMeWriter(tmp_path / "c"), no_dist=True)
    monkeypatch.undo()
    (data_file,) = [n for n in os.listdir(tmp_path / "c") if n.endswith(".safetensors")]
    assert writes.count(data_file) == 1  # header and data in one call
    dest = _blank()
    dcp.load(dest, storage_reader=NVMeReader(tmp_path / "c"), no_dist=True)
    assert all(torch.equal(dest["model"][k], v) for k, v in state["model"].items()) and dest["step"] == 7

    chunk = next(c for c in read_manifest(LocalStore(tmp_path / "c"), str(tmp_path / "c")).chunks
                 if c.fqn == "model.layer3.weight")
    with open(tmp_path / "c" / data_file, "r+b") as handle:
        handle.seek(chunk.byte_offset + 999)
        byte = handle.read(1)
        handle.seek(chunk.byte_offset + 999)
        handle.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointException) as info:
        dcp.load(_blank(), storage_reader=NVMeReader(tmp_path / "c"), no_dist=True)
    error = next(f[0] if isinstance(f, tuple) else f for f in info.value.failures.values())
    assert isinstance(error, ChecksumMismatchError) and "model.layer3.weight" in str(info.value)


def test_a_small_save_fsyncs_every_file_before_the_commit_in_one_round(tmp_path, monkeypatch):
    """The data file's fsync is deferred to the commit and joins the tables' and the
    manifest's (one round, one journal commit); the directory is fsynced after the rename."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def note(kind: str, name: str) -> None:
        with lock:
            events.append((kind, name))

    real_fsync, real_replace, real_finish = os.fsync, os.replace, Writer.finish
    monkeypatch.setattr(os, "fsync", lambda fd: note("fsync", _name(fd)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b, **kw: note("rename", os.path.basename(b)) or
                        real_replace(a, b, **kw))
    monkeypatch.setattr(Writer, "finish", lambda self, **kw: note("finish", "") or real_finish(self, **kw))
    path = tmp_path / "c"
    dcp.save(_state(), storage_writer=NVMeWriter(path), no_dist=True)
    monkeypatch.undo()

    names = os.listdir(path)
    data = [n for n in names if n.endswith(".safetensors")]
    tables = [n for n in names if n.endswith(".parquet")]
    synced = [name for kind, name in events if kind == "fsync"]
    assert len(data) == 1 and len(tables) == 2
    temps = {name for name in synced if temp_of(name)}
    assert {temp_of(t)[0] for t in temps} == {*tables, MANIFEST}  # each table and the manifest
    assert data[0] in synced and os.path.basename(path) in synced  # the data file and the directory
    assert len(synced) == 5  # nothing fsynced twice, nothing else
    commit = events.index(("rename", MANIFEST))
    finish = events.index(("finish", ""))
    first_round = {name for kind, name in events[finish:commit] if kind == "fsync"}
    assert first_round == {data[0], *temps}  # the data file's fsync joined the commit's round
    assert [name for kind, name in events[commit:] if kind == "fsync"] == [os.path.basename(path)]


def test_a_full_disk_in_a_small_write_commits_nothing_and_removes_its_data(tmp_path, monkeypatch):
    def full(fd, views, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(), storage_writer=NVMeWriter(tmp_path / "c"), no_dist=True)
    assert "No space left on device" in str(info.value) and ".safetensors" in str(info.value)
    assert not os.path.exists(tmp_path / "c" / MANIFEST)
    assert not [n for n in os.listdir(tmp_path / "c") if n.endswith(".safetensors")]


def test_a_failed_fsync_at_the_commit_commits_nothing(tmp_path, monkeypatch):
    """The deferred fsync of the data file fails at the commit: no manifest, no files left."""
    real = os.fsync

    def failing(fd):
        if _name(fd).endswith(".safetensors"):
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(), storage_writer=NVMeWriter(tmp_path / "c"), no_dist=True)
    assert "Input/output error" in str(info.value) and ".safetensors" in str(info.value)
    assert not os.path.exists(tmp_path / "c" / MANIFEST)
    assert not [n for n in os.listdir(tmp_path / "c") if n.endswith((".safetensors", ".parquet")) or temp_of(n)]
