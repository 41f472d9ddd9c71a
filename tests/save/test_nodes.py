"""The pure and single-process parts of many-node checkpoints: how the coordinator decides
which nodes share its directory, the node-commit payload and topology record as hostile input,
the mirror of each step, and what tools and the reader say about a node-local copy.
(tests/cross/test_node_local.py runs the real thing on simulated nodes.)"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

import dcp_nvme
from dcp_nvme import InvalidInputError, NVMeReader, NVMeWriter
from dcp_nvme.errors import ManifestError
from dcp_nvme.format.manifest import describe_topology, read_manifest, seal
from dcp_nvme.format.validation import check_topology
from dcp_nvme.host.job import NODE_LOCAL, SHARED, NodeTag, decide
from dcp_nvme.save.node_commit import decode_payload, encode_payload
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.tiers import DrainError, drain
from dcp_nvme.tools.status import checkpoint_state


def _tags(nodes: list[str], leaders: set[int]) -> list[NodeTag]:
    return [NodeTag(f"h{n}", n, f"p{r}" if r in leaders else None) for r, n in enumerate(nodes)]


def test_nodes_whose_probe_the_coordinator_cannot_see_get_a_writer_each():
    tags = _tags(["0", "0", "1", "1", "2", "2"], {0, 2, 4})
    local = decide(0, tags, visible=lambda name: name == "p0")
    assert (local.mode, local.node_writers) == (NODE_LOCAL, (2, 4))
    assert local.to_doc() == {"mode": "node-local", "nodes": ["0", "1", "2"], "rank_nodes": [0, 0, 1, 1, 2, 2]}
    shared = decide(0, tags, visible=lambda name: True)
    assert (shared.mode, shared.node_writers) == (SHARED, ())
    mixed = decide(0, tags, visible=lambda name: name in ("p0", "p2"))  # node 1 shares, node 2 does not
    assert (mixed.mode, mixed.node_writers) == (NODE_LOCAL, (4,))
    # a node whose every rank probed (no LOCAL_RANK): its lowest rank writes
    assert decide(0, _tags(["a", "b", "b"], {0, 1, 2}), visible=lambda n: n == "p0").node_writers == (1,)
    assert decide(0, [NodeTag("h", "0")], visible=lambda n: False).mode == SHARED  # one process


def test_a_node_without_a_probe_is_refused_with_what_to_set():
    with pytest.raises(InvalidInputError, match="LOCAL_RANK"):
        decide(0, _tags(["0", "1"], {0}), visible=lambda name: True)


def test_the_node_commit_payload_round_trips_and_refuses_what_another_process_could_send():
    key = "ab12"
    tables = [(f"index.{key}.parquet", b"\x01" * 10), (f"blocks.{key}.parquet", b"\x02" * 3)]
    data = encode_payload(b'{"m": 1}', tables)
    assert decode_payload(data, key) == (b'{"m": 1}', tables)
    for broken in (data[:-1], data + b"x", b"\x00\x00", data[:4] + b"[" + data[5:]):
        with pytest.raises(ManifestError, match="malformed"):
            decode_payload(broken, key)
    evil = encode_payload(b"{}", [("../../etc/passwd", b"x")])
    with pytest.raises(ManifestError):
        decode_payload(evil, key)
    with pytest.raises(ManifestError):  # a table of another save
        decode_payload(encode_payload(b"{}", [("index.ffff.parquet", b"x")]), key)


@pytest.mark.parametrize("topology", [
    "node-local", {"mode": "elsewhere", "nodes": ["0"], "rank_nodes": [0, 0]},
    {"mode": "node-local", "nodes": ["0", "0"], "rank_nodes": [0, 1]},
    {"mode": "node-local", "nodes": ["0", "1"], "rank_nodes": [0]},
    {"mode": "node-local", "nodes": ["0", "1"], "rank_nodes": [0, 2]},
    {"mode": "node-local", "nodes": ["0", "x" * 300], "rank_nodes": [0, 1]},
    {"mode": "node-local", "nodes": ["0", 1], "rank_nodes": [0, 1]},
    {"mode": "node-local", "nodes": ["0"], "rank_nodes": [0, True]},
])
def test_a_forged_topology_record_is_refused(topology):
    with pytest.raises(ManifestError, match="topology"):
        check_topology(topology, 2, "manifest.json")
    check_topology({"mode": "node-local", "nodes": ["0", "1"], "rank_nodes": [0, 1]}, 2, "manifest.json")


def _save_two_ranks(rank, world, path):
    dcp.save({f"r{rank}": torch.full((4,), float(rank))}, storage_writer=NVMeWriter(path))


def _node_local_copy(path):
    """A real 2-rank save (one directory), rewritten as node 1's node-local copy: rank 0 on node
    0's disk, so not here."""
    run_ranks(2, _save_two_ranks, str(path))
    doc = json.loads((path / "manifest.json").read_bytes())
    doc["topology"] = {"mode": "node-local", "nodes": ["0", "1"], "rank_nodes": [0, 1]}
    doc.pop("manifest_crc32c")
    (path / "manifest.json").write_bytes(seal(doc))
    os.remove(path / doc["files"][0]["name"])
    return doc


def test_tools_and_reader_tell_a_node_local_copy_from_a_damaged_one(tmp_path):
    path = tmp_path / "ck"
    _node_local_copy(path)
    found = checkpoint_state(LocalStore(path))
    assert (found.state, found.elsewhere) == ("committed", ["0"]), found.reason
    text = describe_topology(found.manifest.doc["topology"], found.elsewhere)
    assert text == ("node-local on 2 node(s) (node 0: ranks 0; node 1: ranks 1); the files of node(s) 0 "
                    "are on their own disks, not here")
    mine = {"r1": torch.empty(4)}  # rank 1's item: in the file this node holds
    dcp.load(mine, storage_reader=NVMeReader(path), no_dist=True)
    assert mine["r1"].tolist() == [1.0] * 4
    # r0 is in rank 0's file, which this node does not hold: named, with where it is
    with pytest.raises(CheckpointException, match=r"rank_00000\.\w+\.safetensors \(rank 0's data\), which node 0 wrote"):
        dcp.load({"r0": torch.empty(4)}, storage_reader=NVMeReader(path), no_dist=True)
    assert dcp_nvme.latest(tmp_path) == path  # the other node's files are on its disk: not a damage
    os.remove(path / found.manifest.doc["files"][1]["name"])  # now no node's files are here: damaged
    assert checkpoint_state(LocalStore(path)).state == "damaged"
    with pytest.warns(UserWarning, match="is missing; this is this node's copy of a node-local checkpoint"):
        assert dcp_nvme.latest(tmp_path) is None  # passed over here, and said the nodes may disagree


def test_mirror_root_gives_each_step_its_own_mirror_and_a_reused_mirror_is_refused(tmp_path):
    run, mirror = tmp_path / "run", tmp_path / "pfs"
    writer = NVMeWriter(run / "step_0", mirror_root=mirror)
    for step in (1, 2):
        dcp.save({"w": torch.full((4,), float(step))}, storage_writer=writer,
                 checkpoint_id=run / f"step_{step}", no_dist=True)
        writer.drain_future.result(timeout=60)
        assert writer.drain_future.result().target == str(mirror / f"step_{step}")
    for step in (1, 2):
        assert read_manifest(LocalStore(mirror / f"step_{step}"), "m").doc["storage_meta"]["checkpoint_id"] \
            == str(run / f"step_{step}")
    reused = NVMeWriter(run / "step_0", mirror=mirror / "one")
    dcp.save({"w": torch.ones(4)}, storage_writer=reused, checkpoint_id=run / "step_3", no_dist=True)
    reused.drain_future.result(timeout=60)
    with pytest.raises(CheckpointException, match="already holds the mirror of .*step_3.*mirror_root="):
        dcp.save({"w": torch.ones(4)}, storage_writer=reused, checkpoint_id=run / "step_4", no_dist=True)
    assert not (run / "step_4" / "manifest.json").exists()  # refused before anything was written
    with pytest.raises(InvalidInputError, match="both given"):
        NVMeWriter(run / "x", mirror=mirror, mirror_root=mirror)


def test_a_drain_never_replaces_the_mirror_of_another_checkpoint(tmp_path):
    run, target = tmp_path / "run", tmp_path / "pfs" / "shared_url"
    for step in (1, 2):
        dcp.save({"w": torch.full((4,), float(step))}, storage_writer=NVMeWriter(run / f"step_{step}"), no_dist=True)
    drain(run / "step_1", str(target))
    with pytest.raises(DrainError, match=r"holds the mirror of .*step_1, not of .*step_2"):
        drain(run / "step_2", str(target))
    got = {"w": torch.empty(4)}
    dcp.load(got, storage_reader=NVMeReader(target), no_dist=True)
    assert got["w"].tolist() == [1.0] * 4  # step 1's mirror is intact
    drain(run / "step_1", str(target))  # the same checkpoint drains there again (a resume) fine


def test_the_coordinator_waits_as_long_as_the_process_group_not_longer(tmp_path):
    """A node writer that never votes (killed): the coordinator's round ends when the process
    group's timeout (its store's) runs out, not after a fixed half hour, and nothing commits."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from dcp_nvme.errors import SaveError
    from dcp_nvme.save.node_commit import commit_on_every_node, store_timeout

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1.5))
    assert store_timeout(store) == 1.5
    began = time.monotonic()
    with pytest.raises(SaveError, match=r"node 1 \(rank 2\): no answer within 1 s"):
        commit_on_every_node(store, str(tmp_path), "abcd1234", b"{}", [], {2: "1"})
    assert time.monotonic() - began < 30
    assert os.listdir(tmp_path) == []  # its prepared manifest is gone too


def _value(path, step: float) -> float:
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=NVMeReader(path), no_dist=True)
    assert torch.equal(out["w"], torch.full((1000,), out["w"][0].item()))
    return out["w"][0].item()


@pytest.mark.parametrize("damage", ["a data file cut short", "a table byte changed"])
def test_a_step_latest_passes_over_is_saved_again_without_overwrite(tmp_path, damage):
    """A resumed job reaches the step latest() passed over and saves it again: no overwrite
    needed (the README's loop passes none). A whole checkpoint is still refused."""
    step = tmp_path / "run" / "step_2"
    for value in (1.0, 2.0):
        dcp.save({"w": torch.full((1000,), value)}, storage_writer=NVMeWriter(tmp_path / "run" / f"step_{value:.0f}"),
                 no_dist=True)
    doc = json.loads((step / "manifest.json").read_text())
    if damage == "a data file cut short":
        os.truncate(step / doc["files"][0]["name"], doc["files"][0]["size"] - 1)
    else:
        with open(step / doc["index"]["name"], "r+b") as handle:
            handle.seek(60)
            byte = handle.read(1)
            handle.seek(60)
            handle.write(bytes([byte[0] ^ 0x40]))
    with pytest.warns(UserWarning, match="step_2 .* cannot load"):
        assert dcp_nvme.latest(tmp_path / "run") == tmp_path / "run" / "step_1"
    dcp.save({"w": torch.full((1000,), 3.0)}, storage_writer=NVMeWriter(step), no_dist=True)
    assert dcp_nvme.latest(tmp_path / "run") == step and _value(step, 3.0) == 3.0
    assert len({n.split(".")[1] for n in os.listdir(step) if n.startswith("rank_")}) == 1  # the old files went
    with pytest.raises(dcp_nvme.CheckpointExistsError, match="already exists at .*step_2 and overwrite=False"):
        dcp.save({"w": torch.full((1000,), 4.0)}, storage_writer=NVMeWriter(step), no_dist=True)
    assert _value(step, 3.0) == 3.0


def _resave_on_two_nodes(rank, world, runs):
    """Rank r is node r with its own disk (runs[r]). Step 2 is committed on node 0 only (node 1
    was killed before its vote): every rank agrees on step 1, then saves step 2 again without
    overwrite, on both nodes; a second save of the now whole step 2 is refused on every rank."""
    import torch.distributed as dist

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # one rank per node
    run = runs[rank]

    def save(step, value):
        dcp.save({"w": torch.full((1000,), value)}, storage_writer=NVMeWriter(f"{run}/step_{step}"))

    save(1, 1.0)
    save(2, 2.0)
    if rank == 1:
        os.remove(f"{run}/step_2/manifest.json")
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # node 0 says that step_2 is not loadable on node 1
        assert dcp_nvme.latest(run, agree=True).name == "step_1"
    save(2, 3.0)
    found = dcp_nvme.latest(run, agree=True)
    assert found.name == "step_2" and _value(found, 3.0) == 3.0, found
    with pytest.raises(CheckpointException, match="already exists at .*step_2 and overwrite=False"):
        save(2, 4.0)
    assert _value(found, 3.0) == 3.0


@pytest.mark.slow
def test_a_step_committed_on_one_node_only_is_saved_again_on_every_node(tmp_path):
    runs = [str(tmp_path / f"node{n}" / "run") for n in range(2)]
    run_ranks(2, _resave_on_two_nodes, runs)


def _node_writer_commits_after_it_moved_on(tmp_path, monkeypatch):
    """A node writer's copy of save ``key`` in ``a``, committed once the writer has been reset to
    its next checkpoint ``b`` (a coordinator's rounds played over a store here); returns the
    writer, its committer, the drains asked for and the two directories."""
    from dcp_nvme import seams
    from dcp_nvme.save import writer as writer_module

    store = torch.distributed.HashStore()
    monkeypatch.setattr(writer_module, "job_store", lambda: store)
    a, b, mirror = tmp_path / "run" / "a", tmp_path / "run" / "b", tmp_path / "pfs"
    a.mkdir(parents=True)
    writer = NVMeWriter(a, mirror_root=mirror)
    drains = []
    monkeypatch.setattr(seams, "drain", lambda directory, url, *args, **kwargs: drains.append((directory, url)))
    key = "abcd1234"
    writer._start_node_copy(writer_module.RankPlan(rank=1, save_key=key, node_writer=True))
    committer = writer._committer
    writer.reset(b)  # the writer's next checkpoint, before this node's round came
    store.set(f"{key}/meta", encode_payload(b'{"files": []}', []))
    store.wait([f"{key}/vote/1"])
    store.set(f"{key}/decision", b"commit")
    committer.join(30)
    assert committer.outcome == "committed" and (a / "manifest.json").exists()
    return writer, committer, drains, a, b, mirror


def test_a_node_writer_drains_the_directory_it_committed_not_the_one_it_moved_on_to(tmp_path, monkeypatch):
    """A node writer's drain (and its clean-up of other saves) is of the save's directory: once
    ran on whatever directory the writer was on by then."""
    _, _, drains, a, b, mirror = _node_writer_commits_after_it_moved_on(tmp_path, monkeypatch)
    assert drains == [(str(a), str(mirror / "a"))]


def test_the_node_commit_holds_the_after_commit_work_and_nothing_of_the_writer(tmp_path, monkeypatch):
    from dcp_nvme.save.after_commit import AfterCommit
    from dcp_nvme.storage.save_lock import read_holder

    writer, committer, drains, a, _, _ = _node_writer_commits_after_it_moved_on(tmp_path, monkeypatch)
    assert isinstance(committer.after_commit, AfterCommit)
    for value in [*vars(committer).values(), *vars(committer.after_commit).values()]:
        assert value is not writer and getattr(value, "__self__", None) is not writer
    assert read_holder(a) is None  # the committer released this node's lock when it ended
    assert len(drains) == 1
