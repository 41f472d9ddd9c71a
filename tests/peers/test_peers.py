"""The peer byte server, replicas and the restore's choice of source, in one process: real
sockets on loopback, real checkpoint files. The many-node behaviour is tests/peers/test_node_loss.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.errors import ChecksumMismatchError, InvalidInputError, ManifestError, PeerError
from dcp_nvme.format.container import MANIFEST, REPLICA_MARKER, REPLICAS_DIR
from dcp_nvme.format.manifest import read_manifest
from dcp_nvme.peers import sources
from dcp_nvme.peers.client import PeerSource
from dcp_nvme.peers.replicate import placement, pull_replica
from dcp_nvme.peers.server import PeerServer
from dcp_nvme.storage.local_dir import LocalStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    import shutil

    copy = tmp_path / "own"
    shutil.copytree(path, copy)
    return str(copy)


def test_server_serves_only_registered_checked_names_with_the_token(saved, tmp_path):
    path, _, rank_file, _ = saved
    server = PeerServer()
    server.register(path)
    os.symlink("/etc/hostname", os.path.join(tmp_path, "link"))
    try:
        good = PeerSource(server.info(), path, "", "0")
        assert good.read_range(rank_file, 0, 8) == open(os.path.join(path, rank_file), "rb").read(8)
        assert good.size(MANIFEST) == os.path.getsize(os.path.join(path, MANIFEST))
        for name in ("../step_1/manifest.json", "/etc/passwd", ".save.lock", "rank_1.safetensors"):
            with pytest.raises(PeerError, match="not a checkpoint file name"):
                good.size(name)
        with pytest.raises(PeerError, match="past its end"):
            good.read_range(rank_file, os.path.getsize(os.path.join(path, rank_file)) - 4, 8)
        with pytest.raises(PeerError, match="not one this node serves"):
            good._ask({"op": "read", "name": rank_file, "offset": 0, "length": 1 << 30})
        with pytest.raises(PeerError, match="not a checkpoint directory this node serves"):
            PeerSource(server.info(), str(tmp_path), "", "0").size(MANIFEST)
        with pytest.raises(FileNotFoundError, match="no complete replica of node 7"):  # no marker: not served
            PeerSource(server.info(), path, "7", "0").size(MANIFEST)
        with pytest.raises(PeerError, match="node name '../x' is not"):
            PeerSource(server.info(), path, "../x", "0").size(MANIFEST)
        forged = PeerSource({**server.info(), "token": "0" * 32}, path, "", "0")
        with pytest.raises(PeerError, match="went away"):  # no answer at all without the token
            forged.size(MANIFEST)
    finally:
        server.close()


def test_a_pull_of_a_node_with_no_files_in_the_save_is_refused_and_leaves_nothing(saved, tmp_path):
    path, _, _, key = saved
    holder = str(tmp_path / "holder")
    os.makedirs(holder)
    server = PeerServer()
    server.register(path, served_as=holder)  # the same path on "another node"
    try:
        with pytest.raises(ManifestError, match="names no files of node 5"):
            pull_replica(PeerSource(server.info(), holder, "", "0"), holder, "5", key)
        with pytest.raises(ManifestError, match="holds save"):
            pull_replica(PeerSource(server.info(), holder, "", "0"), holder, "5", "feed")
        assert os.listdir(os.path.join(holder, REPLICAS_DIR, "5")) == []  # nothing that looks like a replica
    finally:
        server.close()


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


def _node_local_copy(path, tmp_path, nodes=("1",)):
    """The checkpoint at ``path`` rewritten as if rank 0 ran on node 1 of a 2-node save (the
    manifest's topology), so that a pull of node 1's files has something to copy."""
    import shutil

    from dcp_nvme.format.manifest import seal

    own = tmp_path / "owner"
    shutil.copytree(path, own)
    doc = json.loads((own / MANIFEST).read_text())
    doc.pop("manifest_crc32c", None)
    doc["topology"] = {"mode": "node-local", "nodes": list(nodes), "rank_nodes": [0]}
    (own / MANIFEST).write_bytes(seal(doc))
    read_manifest(LocalStore(str(own)), str(own))  # still valid
    return str(own)


def test_pull_of_a_node_local_save_is_byte_equal_and_a_damaged_piece_is_never_written(saved, tmp_path):
    path, _, rank_file, key = saved
    owner = _node_local_copy(path, tmp_path)
    holder = str(tmp_path / "holder")
    os.makedirs(holder)
    server = PeerServer()
    server.register(owner, served_as=holder)
    try:
        copied = pull_replica(PeerSource(server.info(), holder, "", "1"), holder, "1", key, queue_depth=4,
                              block_size=64 << 10)
        replica = os.path.join(holder, REPLICAS_DIR, "1")
        assert copied == os.path.getsize(os.path.join(owner, rank_file))
        assert open(os.path.join(replica, rank_file), "rb").read() == open(os.path.join(owner, rank_file), "rb").read()
        marker = json.loads(open(os.path.join(replica, REPLICA_MARKER)).read())
        assert marker["save_key"] == key and rank_file in marker["files"]
        second = PeerServer()  # the holder's own server serves the replica, once complete
        second.register(holder)
        assert PeerSource(second.info(), holder, "1", "0").size(rank_file) == copied
        second.close()

        with open(os.path.join(owner, rank_file), "r+b") as f:  # the owner's copy goes bad
            f.seek(-10, 2)
            f.write(b"\xff" * 4)
        with pytest.raises(ChecksumMismatchError, match=rank_file):
            pull_replica(PeerSource(server.info(), holder, "", "1"), holder, "1", key, block_size=64 << 10)
        assert os.listdir(replica) == []  # the old replica uncommitted, the partial one gone
    finally:
        server.close()


_SERVE = textwrap.dedent("""
    import sys, json, time
    from dcp_nvme.peers.server import PeerServer
    server = PeerServer()
    server.register(sys.argv[1], served_as=sys.argv[2])
    print(json.dumps(server.info()), flush=True)
    time.sleep(600)
""")


def test_a_peer_killed_mid_pull_leaves_no_complete_looking_replica(saved, tmp_path):
    path, _, rank_file, key = saved
    owner = _node_local_copy(path, tmp_path)
    holder = str(tmp_path / "holder")
    os.makedirs(holder)
    env = {**os.environ, "PYTHONPATH": REPO}
    peer = subprocess.Popen([sys.executable, "-c", _SERVE, owner, holder], stdout=subprocess.PIPE, env=env, text=True)
    try:
        info = json.loads(peer.stdout.readline())
        replica = os.path.join(holder, REPLICAS_DIR, "1")

        def kill_when_started():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if os.path.isdir(replica) and any(".fetch-" in n for n in os.listdir(replica)):
                    os.kill(peer.pid, signal.SIGKILL)  # the peer node loses power mid-transfer
                    return
                time.sleep(0.01)

        import threading

        killer = threading.Thread(target=kill_when_started)
        killer.start()
        with pytest.raises(PeerError, match="node 1"):  # 1.2 MB at 1 MB/s: well over a second
            pull_replica(PeerSource(info, holder, "", "1"), holder, "1", key, queue_depth=2,
                         block_size=64 << 10, bandwidth=1 << 20)
        killer.join()
        assert peer.wait(10) == -signal.SIGKILL
        assert os.listdir(replica) == []  # no marker, no partial file
    finally:
        peer.kill()
        peer.wait()


def test_a_replacement_node_restores_bitwise_from_a_peer_then_from_the_mirror(saved, tmp_path, monkeypatch, caplog):
    path, state, rank_file, key = saved
    mirror_root = tmp_path / "mirror"
    import shutil

    shutil.copytree(path, mirror_root / "step_1")  # the run's mirror root
    empty = str(tmp_path / "replacement" / "step_1")
    server = PeerServer()
    server.register(path, served_as=empty)
    monkeypatch.setattr(sources, "join_peers", lambda p, node: [{**server.info(), "node": "0"}])
    try:
        out = {"w": torch.empty(300_000), "b": torch.empty(1000, dtype=torch.int64)}
        reader = NVMeReader(empty, peers=True)
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
        taken = reader.last_stats["sources"]
        assert set(taken) == {"peer", "read"} and taken["read"]["bytes"] >= os.path.getsize(os.path.join(path, rank_file)) - 4096, taken
        assert os.path.exists(os.path.join(empty, rank_file))  # the node kept what it fetched

        # this node's copy is damaged and the peer's too: the mirror's is used, both are named
        with open(os.path.join(empty, rank_file), "r+b") as f:
            f.seek(-10, 2)
            f.write(b"\x00\x01\x02\x03")
        damaged_peer = _pristine(path, tmp_path)
        with open(os.path.join(damaged_peer, rank_file), "r+b") as f:
            f.seek(-10, 2)
            f.write(b"\x00\x01\x02\x03")
        server.register(damaged_peer, served_as=empty)
        out = {"w": torch.empty(300_000), "b": torch.empty(1000, dtype=torch.int64)}
        reader = NVMeReader(empty, mirror=str(mirror_root))
        with caplog.at_level(logging.WARNING, logger="dcp_nvme.peers.sources"):
            dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(out["w"], state["w"])
        taken = reader.last_stats["sources"]
        assert taken["mirror"]["files"] == 1 and len(taken["damaged"]) == 2, taken
        assert taken["damaged"][0] == os.path.join(empty, rank_file)
        assert "node 0" in taken["damaged"][1] and rank_file in taken["damaged"][1]
        assert "damaged copy" in caplog.text and rank_file in caplog.text

        # nothing anywhere: the error names the file, and no source that verifies
        os.unlink(os.path.join(empty, rank_file))
        shutil.rmtree(mirror_root / "step_1")
        with pytest.raises(BaseException, match=f"{rank_file}.*no replica or mirror holds a copy"):
            dcp.load(out, storage_reader=NVMeReader(empty, mirror=str(mirror_root)), no_dist=True)
    finally:
        server.close()


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
