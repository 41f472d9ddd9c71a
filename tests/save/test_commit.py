"""The commit protocol: a checkpoint exists only once its manifest is committed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import (
    CheckpointExistsError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    NVMeReader,
    NVMeWriter,
)
from dcp_nvme.format.container import MANIFEST


def _save(path, value, **kw):
    dcp.save({"w": torch.full((1000,), float(value))}, storage_writer=NVMeWriter(path, **kw), no_dist=True)


def _load(path):
    dest = {"w": torch.zeros(1000)}
    dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True)
    return dest["w"][0].item()


def _causes(exc):
    """DCP wraps rank failures in CheckpointException; its failures map holds the originals."""
    if not isinstance(exc, CheckpointException):
        return [exc]
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def test_save_into_committed_checkpoint_needs_overwrite(tmp_path):
    _save(tmp_path / "c", 1)
    with pytest.raises(CheckpointException) as info:
        _save(tmp_path / "c", 2)
    assert any(isinstance(c, CheckpointExistsError) for c in _causes(info.value))
    assert "overwrite=True" in str(info.value)
    assert _load(tmp_path / "c") == 1
    _save(tmp_path / "c", 2, overwrite=True)
    assert _load(tmp_path / "c") == 2
    names = os.listdir(tmp_path / "c")
    assert len([n for n in names if n.endswith(".safetensors")]) == 1  # the old data is gone


def _stock_load(path):
    dest = {"w": torch.zeros(1000)}
    dcp.load(dest, storage_reader=FileSystemReader(path), no_dist=True)
    return dest["w"][0].item()


@pytest.mark.parametrize("refused_by", ["the process saving alone", "the coordinator while planning"])
def test_a_stock_dcp_checkpoint_is_refused_like_ours(tmp_path, monkeypatch, refused_by):
    """Saving over FileSystemWriter's checkpoint would leave its .metadata beside our manifest:
    dcp.load and NVMeReader would load two different states from one directory."""
    from dcp_nvme.save import dropin

    path = tmp_path / "c"
    dcp.save({"w": torch.full((1000,), 1.0)}, storage_writer=FileSystemWriter(path), no_dist=True)
    stock = sorted(os.listdir(path))
    if refused_by == "the coordinator while planning":  # as with several ranks: nothing refused early
        monkeypatch.setattr(dropin, "alone", lambda: False)
    with pytest.raises(CheckpointException) as info:
        _save(path, 2)
    assert any(isinstance(c, CheckpointExistsError) for c in _causes(info.value))
    assert "Checkpoint already exists at" in str(info.value) and "stock DCP checkpoint" in str(info.value)
    assert sorted(os.listdir(path)) == stock and _stock_load(path) == 1.0
    monkeypatch.undo()
    _save(path, 2, overwrite=True)  # replaces it: the stock files go once ours is committed
    assert _load(path) == 2.0
    assert not [n for n in os.listdir(path) if n.endswith(".distcp") or n.endswith(".metadata")]
    with pytest.raises(CheckpointException):
        _stock_load(path)  # nothing of the old state is left for dcp.load to find


def test_missing_directory_and_plain_directory_are_refused(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        NVMeReader(tmp_path / "nope").read_metadata()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="not a dcp_nvme checkpoint"):
        NVMeReader(tmp_path / "empty").read_metadata()


def test_directory_written_by_dcp_filesystemwriter_is_named(tmp_path):
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(tmp_path / "fs"), no_dist=True)
    with pytest.raises(CheckpointNotFoundError, match="FileSystemReader"):
        NVMeReader(tmp_path / "fs").read_metadata()


def test_uncommitted_data_is_refused(tmp_path):
    _save(tmp_path / "c", 1)
    os.unlink(tmp_path / "c" / MANIFEST)
    with pytest.raises(CheckpointNotCommittedError, match="did not finish"):
        NVMeReader(tmp_path / "c").read_metadata()
    with pytest.raises(CheckpointException, match="did not finish"):  # what dcp.load reports
        _load(tmp_path / "c")


CRASHING_SAVE = textwrap.dedent("""
    import sys, time, torch, torch.distributed.checkpoint as dcp
    from dcp_nvme import NVMeWriter
    from dcp_nvme.engines import host_io as files
    real = files.pwrite_all
    def slow(fd, buffer, offset):  # a slow drive: the parent kills us mid-write
        real(fd, buffer, offset)
        time.sleep(0.05)
    files.pwrite_all = slow
    state = {"w": torch.full((1000,), 2.0), "big": torch.randn(16 << 20 >> 2)}
    dcp.save(state, storage_writer=NVMeWriter(sys.argv[1], overwrite=True, block_size=65536), no_dist=True)
    print("finished", flush=True)
""")


def test_killed_save_leaves_earlier_checkpoint_loadable(tmp_path):
    path = tmp_path / "c"
    _save(path, 1)
    before = set(os.listdir(path))
    process = subprocess.Popen([sys.executable, "-c", CRASHING_SAVE, str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not (set(os.listdir(path)) - before):
        time.sleep(0.02)
    time.sleep(0.2)  # well inside the 256 writes x 50 ms of the new data file
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert b"finished" not in process.stdout.read()
    new_files = set(os.listdir(path)) - before
    assert any(n.endswith(".safetensors") for n in new_files)  # the crash left partial data
    assert _load(path) == 1  # ... which is not the committed checkpoint
    _save(path, 3, overwrite=True)  # the next committed save cleans the debris
    assert _load(path) == 3
    assert not (set(os.listdir(path)) & new_files)


def test_failed_write_commits_nothing_and_removes_its_data(tmp_path, monkeypatch):
    from dcp_nvme.engines import host_io as files

    def full_disk(fd, buffer, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "pwrite_all", full_disk)
    with pytest.raises(CheckpointException) as info:  # 9 MiB: more than a request, the engine writes it
        dcp.save({"w": torch.ones(9 << 18)}, storage_writer=NVMeWriter(tmp_path / "c"), no_dist=True)
    assert "No space left on device" in str(info.value)
    assert not os.path.exists(tmp_path / "c" / MANIFEST)
    assert not [n for n in os.listdir(tmp_path / "c") if n.endswith(".safetensors")]


def test_unwritable_directory_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = blocker / "ckpt"  # a path under a regular file cannot be created, even by root
    else:
        target = "/proc/ckpt"
    with pytest.raises(CheckpointException, match="cannot create checkpoint directory"):
        _save(target, 1)


def _fail_on(monkeypatch, call: str, name_part: str, errno_: int = 28) -> list[str]:
    """Make ``os.<call>`` fail with ``errno_`` for files whose name contains ``name_part``."""
    real = getattr(os, call)
    hits: list[str] = []

    def path_of(args):
        if call == "replace":
            return os.fspath(args[1])
        return os.readlink(f"/proc/self/fd/{args[0]}")

    def faulty(*args, **kwargs):
        path = path_of(args)
        if name_part in os.path.basename(path):
            hits.append(path)
            raise OSError(errno_, os.strerror(errno_))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, faulty)
    return hits


@pytest.mark.parametrize("call,name_part,says", [
    ("write", ".index.", "cannot write"),
    ("fsync", ".blocks.", "cannot fsync"),
    ("write", ".manifest.json.tmp-", "cannot write"),
    ("replace", "manifest.json", "cannot rename into place"),
])
@pytest.mark.parametrize("earlier", [True, False], ids=["over-earlier", "fresh-dir"])
def test_enospc_in_tables_or_manifest_names_the_file_and_leaves_nothing(
        tmp_path, monkeypatch, call, name_part, says, earlier):
    path = tmp_path / "c"
    if earlier:
        _save(path, 1)
    before = set(os.listdir(path)) if earlier else set()
    hits = _fail_on(monkeypatch, call, name_part)
    with pytest.raises(CheckpointException) as info:
        _save(path, 2, overwrite=True)
    monkeypatch.undo()
    assert hits, "the fault was never reached"
    message = str(info.value)
    assert "No space left on device" in message and says in message
    assert os.path.basename(hits[0]) in message  # the file it was writing
    assert set(os.listdir(path)) == before  # no .tmp, no rank file or table of the failed save
    if earlier:
        assert _load(path) == 1  # the earlier checkpoint is untouched and loadable
    else:
        with pytest.raises(CheckpointNotFoundError):  # nothing looks committed
            NVMeReader(path).read_metadata()
    _save(path, 3, overwrite=True)  # and the lock was released
    assert _load(path) == 3


def test_o_direct_containers_are_preallocated_then_cut_to_size(tmp_path, monkeypatch):
    """The O_DIRECT container is reserved at its page-rounded size before the data is written
    (extending O_DIRECT writes serialise on the inode lock), then cut back to its real size."""
    from dcp_nvme.engines import posix

    calls = []
    real = posix.preallocate
    monkeypatch.setattr(posix, "preallocate", lambda fd, size: calls.append(size) or real(fd, size))
    path = tmp_path / "c"
    state = {"w": torch.arange(2_400_003, dtype=torch.float32)}  # an odd size, more than a request
    writer = NVMeWriter(path, direct_io=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    if not writer.last_stats["io"]["direct_io"]:
        pytest.skip("no O_DIRECT on this filesystem")
    (container,) = [p for p in path.iterdir() if p.suffix == ".safetensors"]
    assert calls == [-(-container.stat().st_size // 4096) * 4096]  # reserved page-rounded
    assert container.stat().st_size % 4096  # ... and cut back to the real, unaligned size
    dest = {"w": torch.zeros(2_400_003)}
    dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True)
    assert torch.equal(dest["w"], state["w"])


@pytest.mark.parametrize("code", [95, 38])  # EOPNOTSUPP, ENOSYS: a filesystem that cannot reserve
def test_a_filesystem_without_fallocate_still_saves(tmp_path, monkeypatch, code):
    import ctypes

    from dcp_nvme.engines import host_io as files

    def refuse(fd, mode, offset, length):
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(files, "_fallocate", refuse)
    big = 9 << 18  # 9 MiB: more than a request, so the engine preallocates (engines.small does not)
    dcp.save({"w": torch.full((big,), 5.0)}, storage_writer=NVMeWriter(tmp_path / "c", direct_io=True), no_dist=True)
    dest = {"w": torch.zeros(big)}
    dcp.load(dest, storage_reader=NVMeReader(tmp_path / "c"), no_dist=True)
    assert dest["w"][0].item() == 5


def test_a_full_disk_at_preallocation_names_the_file_and_commits_nothing(tmp_path, monkeypatch):
    import ctypes

    from dcp_nvme.engines import host_io as files

    def full(fd, mode, offset, length):
        ctypes.set_errno(28)
        return -1

    monkeypatch.setattr(files, "_fallocate", full)
    writer = NVMeWriter(tmp_path / "c", direct_io=True)
    if not writer.config.direct_io:
        pytest.skip("O_DIRECT off")
    with pytest.raises(CheckpointException) as info:
        # 9 MiB: more than a request, so the engine preallocates (engines.small writes less at once)
        dcp.save({"w": torch.ones(9 << 18)}, storage_writer=writer, no_dist=True)
    monkeypatch.undo()
    message = str(info.value)
    if "No space left on device" not in message:
        pytest.skip("the filesystem refused O_DIRECT, so nothing was preallocated")
    assert ".safetensors" in message  # the rank file it was reserving
    assert not os.path.exists(tmp_path / "c" / MANIFEST)
    assert not [n for n in os.listdir(tmp_path / "c") if n.endswith(".safetensors")]


def test_the_stock_dcp_pointer_never_fails_a_save(tmp_path, monkeypatch):
    """`.metadata.HOW_TO_LOAD.txt` is not a part of the checkpoint: a full disk while writing it,
    or a link planted under its name, costs the pointer only; the link's target is untouched."""
    full = tmp_path / "full"
    hits = _fail_on(monkeypatch, "write", ".metadata.HOW_TO_LOAD")
    _save(full, 1)
    monkeypatch.undo()
    assert hits and _load(full) == 1
    assert not (full / ".metadata.HOW_TO_LOAD.txt").exists()  # no half-written pointer left
    planted, victim = tmp_path / "planted", tmp_path / "victim.txt"
    planted.mkdir()
    victim.write_text("mine")
    (planted / ".metadata.HOW_TO_LOAD.txt").symlink_to(victim)
    _save(planted, 2)
    assert _load(planted) == 2 and victim.read_text() == "mine"


def test_a_save_fsyncs_what_durability_needs_and_nothing_more(tmp_path, monkeypatch):
    """The data file, the tables and the manifest's temp file each fsynced once before the
    manifest's rename, the directory once after it; not the save lock, no directory in between."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("rename", os.path.basename(os.fspath(dst))))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _save(tmp_path / "c", 1)
    monkeypatch.undo()
    assert _load(tmp_path / "c") == 1
    synced = [name for what, name in events if what == "fsync"]
    commit = events.index(("rename", MANIFEST))
    before = sorted(name.lstrip(".").split(".")[0] for what, name in events[:commit] if what == "fsync")
    assert before == ["blocks", "index", "manifest", "rank_00000"], events
    assert events[commit + 1:] == [("fsync", "c")], events  # the directory, once, after the commit
    assert synced.count("c") == 1 and not any(name.startswith(".save.lock") for name in synced), events
