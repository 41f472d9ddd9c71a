"""The index decoded once per node: the node's other ranks map the first one's checked columns
(``load.node_index``), get the same metadata and load the same bytes; a damaged shared file
or a forged index is never trusted."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.hostile_kit import chunks_of, write_index

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.errors import ManifestError
from dcp_nvme.format import manifest as manifest_module
from dcp_nvme.load import node_index


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"layer{i}.w": torch.randn(8, 4, generator=gen) for i in range(6)} | {"step": torch.tensor(7)}


@pytest.fixture
def shared(monkeypatch, tmp_path):
    """Two ranks on this node, any index size shared, the shared files under tmp_path."""
    directory = tmp_path / "shm"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(node_index, "MIN_ROWS", 0)
    monkeypatch.setattr(node_index, "cache_directory", lambda: str(directory))
    builds = []
    real = manifest_module._read_index
    monkeypatch.setattr(manifest_module, "_read_index", lambda *a: builds.append(1) or real(*a))
    return directory, builds


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path, state = tmp_path / "ckpt", _state()
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    return path, state


def _load(path: Path) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(target, storage_reader=NVMeReader(path), no_dist=True)
    return target


def test_the_second_rank_maps_what_the_first_decoded(shared, tmp_path):
    directory, builds = shared
    path, state = _saved(tmp_path)
    first = NVMeReader(path).read_metadata()
    assert builds == [1] and len(list(directory.glob("*.cols"))) == 1
    reader = NVMeReader(path)
    second = reader.read_metadata()
    assert builds == [1]  # mapped, not decoded
    columns = reader.manifest().columns
    assert not columns.grid[0].flags.writeable  # a view of the shared file
    assert list(first.state_dict_metadata) == list(second.state_dict_metadata)
    for fqn, entry in first.state_dict_metadata.items():
        assert second.state_dict_metadata[fqn].chunks == entry.chunks
    assert not list(directory.glob("*.cols"))  # the node's last rank removed it
    loaded = _load(path)  # a third reader: decodes again (the file is gone), loads bit for bit
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_load_through_the_mapped_columns_is_bit_exact(shared, tmp_path):
    directory, builds = shared
    path, state = _saved(tmp_path)
    NVMeReader(path).read_metadata()
    loaded = _load(path)
    assert builds == [1] and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_damaged_shared_file_is_not_used(shared, tmp_path, caplog):
    directory, builds = shared
    path, state = _saved(tmp_path)
    NVMeReader(path).read_metadata()
    (cols,) = directory.glob("*.cols")
    data = bytearray(cols.read_bytes())
    data[100] ^= 0xFF  # inside the arrays: their crc32c no longer matches
    cols.write_bytes(bytes(data))
    loaded = _load(path)
    assert builds == [1, 1] and "fail their checksum" in caplog.text
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_forged_index_is_refused_by_every_rank_and_nothing_is_shared(shared, tmp_path):
    directory, builds = shared
    path, _ = _saved(tmp_path)
    rows = chunks_of(path)
    rows[1] = rows[0].__class__(**{**vars(rows[1]), "offsets": (4, 0)})  # outside its 8 x 4 tensor
    write_index(path, rows)
    builds.clear()
    for _ in range(2):
        with pytest.raises(ManifestError):
            NVMeReader(path).read_metadata()
    assert builds == [1, 1] and not list(directory.glob("*.cols"))


def _rank(path: str, directory: str, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    from dcp_nvme.format import manifest as m
    from dcp_nvme.load import node_index as ni

    ni.MIN_ROWS, ni.cache_directory = 0, lambda: directory
    built = []
    real = m._read_index
    m._read_index = lambda *a: built.append(1) or real(*a)
    md = NVMeReader(path).read_metadata()
    chunks = {fqn: [(tuple(c.offsets), tuple(c.sizes)) for c in e.chunks]
              for fqn, e in md.state_dict_metadata.items() if hasattr(e, "chunks")}
    Path(out).write_text(json.dumps({"built": len(built), "chunks": chunks}))


def test_three_processes_of_a_node_decode_the_index_once(tmp_path):
    path, _ = _saved(tmp_path)
    directory = tmp_path / "shm"
    directory.mkdir(mode=0o700)
    ctx = multiprocessing.get_context("fork")  # the children start with torch imported
    outs = [tmp_path / f"rank{i}.json" for i in range(3)]
    procs = [ctx.Process(target=_rank, args=(str(path), str(directory), str(o))) for o in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [json.loads(o.read_text()) for o in outs]
    assert sorted(g["built"] for g in got) == [0, 0, 1]
    assert got[0]["chunks"] == got[1]["chunks"] == got[2]["chunks"] and got[0]["chunks"]
    assert not list(directory.glob("*.cols")) and not list(directory.glob("*.count"))


def test_the_column_file_refuses_what_it_did_not_write(tmp_path):
    from dcp_nvme.format import column_store

    path, _ = _saved(tmp_path)
    columns = NVMeReader(path).manifest().columns
    source = {"index": "x", "size": 1, "crc32c": 2, "save_key": "ab"}
    data = b"".join(bytes(p) for p in column_store.encode(columns, source))
    back = column_store.decode(memoryview(data), source, "f")
    assert np.array_equal(back.grid[1], columns.grid[1]) and back.fqns == columns.fqns
    with pytest.raises(ManifestError, match="another index"):
        column_store.decode(memoryview(data), {**source, "crc32c": 3}, "f")
    with pytest.raises(ManifestError, match="not a column file"):
        column_store.decode(memoryview(data[:-1]), source, "f")


def test_no_lock_file_means_each_rank_decodes_for_itself(shared, tmp_path, monkeypatch, caplog):
    directory, builds = shared
    path, state = _saved(tmp_path)

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(node_index, "create_no_follow", refuse)  # e.g. a full /dev/shm
    loaded = _load(path)
    assert builds == [1] and "cannot open the node's index lock" in caplog.text
    assert all(torch.equal(loaded[k], v) for k, v in state.items()) and not list(directory.iterdir())


def test_the_switch_turns_sharing_off_and_the_old_variable_is_only_warned_about(shared, tmp_path, monkeypatch,
                                                                                caplog):
    from dcp_nvme import config

    directory, builds = shared
    path, _ = _saved(tmp_path)
    monkeypatch.setattr(node_index, "ENABLED", False)
    NVMeReader(path).read_metadata()
    assert builds == [1] and not list(directory.iterdir())  # decoded here, nothing shared
    monkeypatch.setattr(node_index, "ENABLED", True)
    monkeypatch.setattr(config, "_WARNED_ENV", set())
    monkeypatch.setenv("DCP_NVME_NODE_INDEX", "off")  # not read: warned about, sharing stays on
    NVMeReader(path).read_metadata()
    assert builds == [1, 1] and len(list(directory.glob("*.cols"))) == 1
    assert "DCP_NVME_NODE_INDEX is not a dcp_nvme setting" in caplog.text


def _planted_load(path: str, out: str) -> None:
    """A rank of the node, forked (the ``shared`` set-up inherited), with its memory capped so
    that reading a device without end fails at once instead of taking gigabytes."""
    import resource

    status = Path("/proc/self/status").read_text().splitlines()
    size = next(int(line.split()[1]) for line in status if line.startswith("VmSize")) * 1024
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = size + (1 << 30) if hard == resource.RLIM_INFINITY else min(size + (1 << 30), hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        loaded = _load(Path(path))
        same = all(torch.equal(loaded[k], v) for k, v in _state().items())
        Path(out).write_text(json.dumps({"same": same}))
    except BaseException as exc:  # noqa: BLE001  (reported to the test)
        Path(out).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))


@pytest.mark.parametrize("planted", ["fifo at the columns", "fifo at the counter", "link to /dev/zero at the counter"])
def test_a_fifo_or_device_in_the_shared_directory_never_stalls_a_rank(shared, tmp_path, planted):
    """Whatever sits under the shared names is opened non-blocking, never through a link, and
    read bounded: the rank decodes or maps as usual and loads, within seconds."""
    directory, _ = shared
    path, _ = _saved(tmp_path)
    doc = json.loads((path / "manifest.json").read_text())
    stem = directory / f"index-{doc['save_key']}-{doc['index']['crc32c']:08x}-{doc['index']['size']}"
    if planted == "fifo at the columns":
        os.mkfifo(stem.with_name(stem.name + ".cols"))  # before the node's first rank opens it
    else:
        NVMeReader(path).read_metadata()  # the first rank: shares the columns, counts itself
        counter = stem.with_name(stem.name + ".count")
        counter.unlink()
        if planted == "fifo at the counter":
            os.mkfifo(counter)
        else:
            counter.symlink_to("/dev/zero")
    out = tmp_path / "out.json"
    child = multiprocessing.get_context("fork").Process(target=_planted_load, args=(str(path), str(out)))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"a rank with a {planted} still had not loaded after 30 s: it hangs")
    assert json.loads(out.read_text()) == {"same": True}
