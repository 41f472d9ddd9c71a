"""Replicas and the restore's choice of source, in one process: placement, the verified copy of a
file (``peers.fetching``), a one-process load that takes a lost file from a replica on this node
and then from the mirror, real checkpoint files. The many-node behaviour (replication and
restores over gloo) is tests/peers/test_node_loss.py."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.errors import ChecksumMismatchError, InvalidInputError
from dcp_nvme.format.container import REPLICA_MARKER, REPLICAS_DIR, is_served_name
from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.peers.fetching import LocalSource, fetch_file, replica_files
from dcp_nvme.peers.replicate import placement
from dcp_nvme.storage.local_dir import LocalStore


def _state(n: int = 300_000) -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(n), "b": torch.arange(1000, dtype=torch.int64)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint (block_size 64 KiB: many checksum blocks), its state and its rank file."""
    path = str(tmp_path_factory.mktemp("peer") / "step_1")
    state = _state()
    dcp.save(state, storage_writer=NVMeWriter(path, block_size="64KiB"), no_dist=True)
    manifest = read_manifest(LocalStore(path), path)
    return path, state, manifest.file_names[0], manifest.save_key


def _pristine(path, tmp_path):
    """A private copy of the checkpoint to damage."""
    copy = tmp_path / "own"
    shutil.copytree(path, copy)
    return str(copy)


def test_placement_is_the_next_nodes_never_itself():
    nodes = ["0", "1", "2", "3"]
    assert placement(nodes, "0", 1) == (["1"], ["3"], None)
    assert placement(nodes, "3", 2) == (["0", "1"], ["1", "2"], None)
    assert placement(nodes, "0", 1, stride=2) == (["2"], ["2"], None)  # racks of 2: the other rack
    targets, sources_, warning = placement(["0", "1"], "0", 3)
    assert targets == ["1"] and sources_ == ["1"] and "only 1 other node(s)" in warning
    assert placement(["0"], "0", 1)[0] == []
    with pytest.raises(InvalidInputError, match="not one of the save's nodes"):
        placement(nodes, "9", 1)


def _damage(path):
    with open(path, "r+b") as f:  # the last checksum block goes bad
        f.seek(-10, 2)
        f.write(b"\x00\x01\x02\x03")


def test_a_verified_copy_is_byte_equal_and_a_damaged_piece_is_never_written(saved, tmp_path):
    path, _, rank_file, _ = saved
    source_dir = _pristine(path, tmp_path)
    record = read_files(LocalStore(source_dir), read_manifest(LocalStore(source_dir), source_dir), source_dir)[rank_file]
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    copied = fetch_file(LocalSource(source_dir), record, str(good), queue_depth=4, block_size=64 << 10)
    assert copied == os.path.getsize(os.path.join(source_dir, rank_file))
    assert (good / rank_file).read_bytes() == open(os.path.join(source_dir, rank_file), "rb").read()

    _damage(os.path.join(source_dir, rank_file))
    with pytest.raises(ChecksumMismatchError, match=rank_file):
        fetch_file(LocalSource(source_dir), record, str(bad), queue_depth=4, block_size=64 << 10)
    assert os.listdir(bad) == []  # nothing under the name, no temp left


def _hold_replica(path, here, node):
    """``here``/.replicas/<node>/: a complete replica of the checkpoint at ``path`` (marker last)."""
    replica = os.path.join(here, REPLICAS_DIR, node)
    os.makedirs(replica)
    listed = {}
    for name in os.listdir(path):
        if is_served_name(name):
            shutil.copyfile(os.path.join(path, name), os.path.join(replica, name))
            listed[name] = os.path.getsize(os.path.join(path, name))
    with open(os.path.join(replica, REPLICA_MARKER), "w") as f:
        json.dump({"node": node, "files": listed}, f)
    assert replica_files(here, node) == listed
    return replica


def test_a_lost_file_comes_from_a_replica_here_then_from_the_mirror(saved, tmp_path, caplog):
    path, state, rank_file, _ = saved
    mirror_root = tmp_path / "mirror"
    shutil.copytree(path, mirror_root / "step_1")  # the run's mirror root
    here = str(tmp_path / "node" / "step_1")
    shutil.copytree(path, here)
    writer_node = read_manifest(LocalStore(path), path).node_of(0)  # the node that wrote the file
    replica = _hold_replica(path, here, writer_node)
    os.unlink(os.path.join(here, rank_file))  # this node lost the file; it holds a replica of it
    out = {"w": torch.empty(300_000), "b": torch.empty(1000, dtype=torch.int64)}
    reader = NVMeReader(here, peers=True)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    taken = reader.last_stats["sources"]
    assert set(taken) == {"local", "read"} and "mirror" not in taken, taken
    assert taken["local"]["bytes"] >= os.path.getsize(os.path.join(path, rank_file)), taken
    assert os.path.exists(os.path.join(here, rank_file))  # the node kept what it fetched

    # this node's copy is damaged and the replica's too: the mirror's is used, both are named
    _damage(os.path.join(here, rank_file))
    _damage(os.path.join(replica, rank_file))
    out = {"w": torch.empty(300_000), "b": torch.empty(1000, dtype=torch.int64)}
    reader = NVMeReader(here, mirror=str(mirror_root))
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.peers.sources"):
        dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], state["w"])
    taken = reader.last_stats["sources"]
    assert taken["mirror"]["files"] == 1 and taken["damaged"] == [
        os.path.join(here, rank_file), os.path.join(replica, rank_file)], taken
    assert "damaged copy" in caplog.text and rank_file in caplog.text

    # nothing anywhere that verifies: the error names the file
    os.unlink(os.path.join(here, rank_file))
    shutil.rmtree(mirror_root / "step_1")
    with pytest.raises(BaseException, match=f"{rank_file}.*no replica or mirror holds a copy"):
        dcp.load(out, storage_reader=NVMeReader(here, mirror=str(mirror_root)), no_dist=True)


def test_options_are_checked_where_read(monkeypatch, tmp_path):
    with pytest.raises(InvalidInputError, match="replicas='two' from the argument"):
        NVMeWriter(tmp_path / "x", replicas="two")
    assert NVMeWriter(tmp_path / "x", replicas="1").replicas == 1
    assert NVMeWriter(tmp_path / "x").replicas == 0
    with pytest.raises(InvalidInputError, match="replicas=99"):
        NVMeWriter(tmp_path / "x", replicas=99)
    assert NVMeWriter(tmp_path / "x", replica_bandwidth="100MB").replica_bandwidth == 100_000_000
    with pytest.raises(InvalidInputError, match="replica_bandwidth='fast' from the argument"):
        NVMeWriter(tmp_path / "x", replica_bandwidth="fast")
    assert NVMeReader(tmp_path / "x", mirror=str(tmp_path)).peers is True
    assert NVMeReader(tmp_path / "x").peers is False
    assert NVMeReader(tmp_path / "x", peers="on").peers is True
    with pytest.raises(InvalidInputError, match="peers='maybe' from the argument"):
        NVMeReader(tmp_path / "x", peers="maybe")
    monkeypatch.setenv("DCP_NVME_REPLICA_STRIDE", "0")  # env only: refused at construction, never after a commit
    with pytest.raises(InvalidInputError, match="environment variable DCP_NVME_REPLICA_STRIDE"):
        NVMeWriter(tmp_path / "x")
    monkeypatch.setenv("DCP_NVME_REPLICA_STRIDE", "4")
    assert NVMeWriter(tmp_path / "x").replica_stride == 4


def test_replicas_of_a_one_process_save_are_skipped_with_a_reason(tmp_path):
    writer = NVMeWriter(tmp_path / "one", replicas=1)
    dcp.save(_state(1000), storage_writer=writer, no_dist=True)
    result = writer.replication_future.result(timeout=60)  # the save itself never waited for it
    assert result.replicated_on == [] and "one shared directory" in result.warning


def test_metadata_of_another_save_or_step_is_never_adopted(saved, tmp_path, caplog):
    """This node lost its manifest. A replica left from the save before an overwrite (another
    save key) and a mirror of another step both hold metadata that validates: neither is this
    checkpoint's, so both are refused and named, and nothing is written; the mirror of this
    step is then taken."""
    path, state, rank_file, key = saved
    old = str(tmp_path / "old" / "step_1")  # the save this directory held before an overwrite
    dcp.save({"w": torch.zeros(300_000), "b": torch.zeros(1000, dtype=torch.int64)},
             storage_writer=NVMeWriter(old, block_size="64KiB"), no_dist=True)
    here = str(tmp_path / "node" / "step_1")
    shutil.copytree(path, here)
    _hold_replica(old, here, read_manifest(LocalStore(old), old).node_of(0))
    other_step = tmp_path / "mirror_other" / "step_2"
    dcp.save({"w": torch.ones(300_000), "b": torch.ones(1000, dtype=torch.int64)},
             storage_writer=NVMeWriter(str(other_step), block_size="64KiB"), no_dist=True)
    os.unlink(os.path.join(here, "manifest.json"))
    out = {"w": torch.empty(300_000), "b": torch.empty(1000, dtype=torch.int64)}
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.peers.sources"), \
            pytest.raises(BaseException, match=f"step_2/manifest.json describes save .*holds data files of save {key}"):
        dcp.load(out, storage_reader=NVMeReader(here, mirror=str(other_step)), no_dist=True)
    assert f"{REPLICAS_DIR}/" in caplog.text and f"holds data files of save {key}" in caplog.text  # the replica
    assert not os.path.exists(os.path.join(here, "manifest.json"))  # nothing adopted
    empty = str(tmp_path / "wiped" / "step_1")  # a wiped node: no data file tells the save
    os.makedirs(empty)
    with pytest.raises(BaseException, match="saved as .*step_2, not as step_1"):
        dcp.load(out, storage_reader=NVMeReader(empty, mirror=str(other_step)), no_dist=True)
    assert os.listdir(empty) == []
    mirror = tmp_path / "mirror" / "step_1"
    shutil.copytree(path, mirror)
    dcp.load(out, storage_reader=NVMeReader(here, mirror=str(mirror)), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert read_manifest(LocalStore(here), here).save_key == key


def test_an_overwrite_removes_the_replicas_and_kept_ranges_of_the_save_it_replaces(tmp_path):
    path = str(tmp_path / "step_1")
    dcp.save(_state(1000), storage_writer=NVMeWriter(path), no_dist=True)
    old = read_manifest(LocalStore(path), path)
    replica_of = str(tmp_path / "elsewhere" / "step_1")
    shutil.copytree(path, replica_of)
    _hold_replica(replica_of, path, "7")  # a replica of the old save, held here
    os.makedirs(os.path.join(path, ".ranges"))
    for name in (old.file_names[0], old.file_names[0] + ".spans"):
        open(os.path.join(path, ".ranges", name), "wb").close()
    dcp.save(_state(1000), storage_writer=NVMeWriter(path, overwrite=True), no_dist=True)
    assert not os.path.exists(os.path.join(path, REPLICAS_DIR, "7"))
    assert os.listdir(os.path.join(path, ".ranges")) == []
    assert read_manifest(LocalStore(path), path).save_key != old.save_key


def test_a_state_dict_key_naming_compression_keeps_a_plain_mirror_usable(tmp_path):
    """Whether a mirror is compressed is what its manifest's compression section records: a
    state dict key that is the word itself leaves a plain mirror a source."""
    path = str(tmp_path / "run" / "step_1")
    state = {"compression": torch.arange(5000, dtype=torch.float32), "w": torch.ones(100)}
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    mirror = tmp_path / "mirror"
    shutil.copytree(path, mirror / "step_1")
    rank_file = read_manifest(LocalStore(path), path).file_names[0]
    os.unlink(os.path.join(path, rank_file))  # this node lost its data file
    out = {"compression": torch.empty(5000), "w": torch.empty(100)}
    reader = NVMeReader(path, mirror=str(mirror))
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["compression"], state["compression"]) and torch.equal(out["w"], state["w"])
    assert reader.last_stats["sources"]["mirror"]["files"] == 1, reader.last_stats["sources"]

    from dcp_nvme.format.manifest import seal
    from dcp_nvme.peers.sources import mirror_source

    coded = tmp_path / "coded" / "step_1"  # a manifest with the drain's section: no files from it
    shutil.copytree(mirror / "step_1", coded)
    doc = json.loads((coded / "manifest.json").read_bytes())
    doc.pop("manifest_crc32c")
    (coded / "manifest.json").write_bytes(seal({**doc, "compression": {"codec": "bytegroup"}}))
    assert mirror_source(path, str(coded), None) is None and mirror_source(path, str(mirror), None) is not None


def test_a_damaged_manifest_never_takes_an_older_save_of_the_step(tmp_path, caplog):
    """This node's manifest is damaged; a replica here holds the step's earlier save (from before
    an overwrite), the mirror the current one. The newer save by its recorded creation time is
    loaded; when the times do not tell, nothing is loaded and both copies are named."""
    from dcp_nvme.format.manifest import seal

    old, current = str(tmp_path / "old" / "step_1"), str(tmp_path / "current" / "step_1")
    dcp.save({"w": torch.zeros(1000)}, storage_writer=NVMeWriter(old), no_dist=True)
    dcp.save({"w": torch.ones(1000)}, storage_writer=NVMeWriter(current), no_dist=True)
    old_key = read_manifest(LocalStore(old), old).save_key
    current_key = read_manifest(LocalStore(current), current).save_key

    def damaged_node(name):
        here = str(tmp_path / name / "step_1")
        os.makedirs(here)
        with open(os.path.join(here, "manifest.json"), "w") as f:
            f.write('{"save_key": ')  # torn
        replica = _hold_replica(old, here, read_manifest(LocalStore(old), old).node_of(0) or "n0")
        return here, replica

    here, replica = damaged_node("node")
    out = {"w": torch.empty(1000)}
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.peers.sources"):
        dcp.load(out, storage_reader=NVMeReader(here, mirror=str(tmp_path / "current")), no_dist=True)
    assert torch.equal(out["w"], torch.ones(1000))
    assert read_manifest(LocalStore(here), here).save_key == current_key
    assert f"save {old_key}" in caplog.text and replica in caplog.text and "the newest" in caplog.text

    # the mirror's manifest records the same creation time as the replica's: no way to tell
    doc = json.loads(open(os.path.join(current, "manifest.json"), "rb").read())
    doc.pop("manifest_crc32c")
    doc["created_unix"] = read_manifest(LocalStore(old), old).doc["created_unix"]
    with open(os.path.join(current, "manifest.json"), "wb") as f:
        f.write(seal(doc))
    here, replica = damaged_node("node2")
    with pytest.raises(BaseException, match="different saves of the checkpoint") as caught:  # DCP wraps it
        dcp.load(out, storage_reader=NVMeReader(here, mirror=str(tmp_path / "current")), no_dist=True)
    assert replica in str(caught.value) and str(tmp_path / "current" / "step_1") in str(caught.value)
    assert old_key in str(caught.value) and current_key in str(caught.value)
    assert open(os.path.join(here, "manifest.json")).read() == '{"save_key": '  # nothing written
