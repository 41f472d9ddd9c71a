"""Trainers' state dicts on node-local disks: every item that several ranks hold.

DCP's planner (``dedup_save_plans``) writes an item held by several ranks once per job, by one
of them. With one disk per node that copy lands on a single node, and a restart on the same
nodes needs it on every node whose ranks hold the item: DDP's parameters, AdamW's per-parameter
``step`` tensors, plain values and a BytesIO, HSDP's [Replicate(), Shard(0)] DTensors, the
optimizer state of FSDP x TP. Each layout (harness/dcp_nvme_harness/multinode_scripts/train_states.py) is saved
with a plain NVMeWriter on 2 simulated nodes x 2 ranks (harness/dcp_nvme_harness/multinode.py), then restarted on
the same nodes with a plain NVMeReader (no peers, no mirror): every rank must get back bitwise
what it saved, and each node's disk must hold a copy of every item. ``sharded`` is the control:
fsdp2's model alone, nothing that two ranks hold.

Every layout runs in the same torchrun launches, one after another (``states``: each launch
costs more than the layouts in it, every process imports torch), each in its own directory; a
test per layout checks what its layout got.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from dcp_nvme_harness.multinode import SCRIPTS, all_records, describe

from dcp_nvme import NVMeReader

pytestmark = pytest.mark.slow
SCRIPT = SCRIPTS / "train_states.py"
LAYOUTS = ("ddp", "fsdp2", "hsdp", "tpdp", "sharded")
RUNS = "runs/{layout}"
"""Each layout's run directory on a node's disk (the script puts ``step_1`` in it)."""
STEP = "step_1"
ONE_NODE_FEWER = ("ddp", "hsdp", "fsdp2")  # fsdp2 last: its load fails
WIPED = ("ddp", "hsdp")


def _records(results, layout):
    return [r for r in all_records(results) if r.get("layout") == layout]


def _failures(results, records, world):
    """The errors the ranks reported (each once, with the ranks that reported it), and the ranks
    that reported nothing."""
    by_error: dict[str, list[int]] = {}
    for rec in records:
        if rec.get("error"):
            by_error.setdefault(rec["error"], []).append(rec["rank"])
    out = [f"ranks {ranks} reported: {error}" for error, ranks in by_error.items()]
    missing = sorted(set(range(world)) - {r["rank"] for r in records})
    if missing:
        out.append(f"ranks {missing} reported nothing:\n{describe(results)}")
    return out


def _disk(cluster, node, run="run"):
    """What node ``node``'s own disk holds of the checkpoint: its rank files, the files the
    manifest says this node's ranks wrote, and the items with no chunk in any file here."""
    step = cluster.node_disk(node) / run / STEP
    names = sorted(os.listdir(step)) if step.is_dir() else []
    report = {"rank_files": [n for n in names if n.startswith("rank_")], "manifest": "manifest.json" in names}
    if not report["manifest"]:
        return report
    doc = json.loads((step / "manifest.json").read_text())
    topology = doc.get("topology") or {}
    report["topology"] = topology
    rank_nodes = topology.get("rank_nodes", [])
    report["expected_files"] = sorted(f["name"] for f in doc["files"]
                                      if f["rank"] < len(rank_nodes) and rank_nodes[f["rank"]] == node)
    reader = NVMeReader(step)
    metadata = reader.read_metadata()  # the manifest and its tables: reads no data file
    here = set(names)
    held = {index.fqn for index, chunk in metadata.storage_data.items() if chunk.file in here}
    held |= {copy.fqn for copy in reader.manifest().copies if copy.file in here}  # save.copies
    report["items"] = len(metadata.state_dict_metadata)
    report["items_not_here"] = sorted(set(metadata.state_dict_metadata) - held)
    return report


def _wipe(cluster, node, run="run"):
    shutil.rmtree(cluster.node_disk(node) / run)
    (cluster.node_disk(node) / run).mkdir()


@pytest.fixture(scope="module")
def states(tmp_path_factory, lan):
    """Every launch of this file, once: save all layouts; each layout's node disks and status;
    the restart on the same nodes; the restart on node 0 alone; node 1 wiped and restored from
    node 0 (peers); that node's next restart. Each step's results, or the error that stopped it."""
    from dcp_nvme_harness.multinode import Cluster, unshare_unavailable

    reason = unshare_unavailable()
    if reason:
        pytest.skip(reason)
    out: dict = {}
    root = tmp_path_factory.mktemp("states")
    with Cluster(root / "cluster", nodes=2, ranks_per_node=2, network=lan) as cluster:
        out["cluster"] = cluster
        runs = f"{cluster.mount}/{RUNS}"

        def launch(name, layouts, **kw):
            out[name] = cluster.run(SCRIPT, kw.pop("action", "load"), ",".join(layouts), runs, timeout=400,
                                    check=False, **kw)

        launch("save", LAYOUTS, action="save")
        for layout in LAYOUTS:
            run = RUNS.format(layout=layout)
            out[("disks", layout)] = {node: _disk(cluster, node, run) for node in range(cluster.nodes)}
            out[("status", layout)] = cluster.on_node(
                0, [sys.executable, "-m", "dcp_nvme", "status", f"{cluster.mount}/{run}/{STEP}"]).stdout
        launch("load", LAYOUTS)
        launch("one_node_fewer", ONE_NODE_FEWER, nodes=[0])
        for layout in WIPED:
            _wipe(cluster, 1, RUNS.format(layout=layout))
        launch("restore", WIPED, env={"READER_PEERS": "1"})
        out["kept"] = {layout: sorted(os.listdir(cluster.node_disk(1) / RUNS.format(layout=layout) / STEP))
                       for layout in WIPED}
        out["spans"] = {layout: list((cluster.node_disk(1) / RUNS.format(layout=layout) / STEP / ".ranges")
                                     .glob("*.spans")) for layout in WIPED}
        launch("next_restart", WIPED, env={"READER_PEERS": "1"})
        yield out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_state_restarts_on_the_same_nodes_from_their_own_disks(states, layout):
    cluster = states["cluster"]
    world = cluster.nodes * cluster.ranks_per_node
    results = states["save"]
    records = _records(results, layout)
    failures = _failures(results, records, world)
    assert not failures, f"{layout}: save failed:\n" + "\n".join(failures)
    if layout == "hsdp":
        assert all(r["placements"].get("(Replicate(), Shard(dim=0))") == 12 for r in records), records
    disks = states[("disks", layout)]
    for node, disk in disks.items():
        print(f"{layout}: node{node} holds {disk['rank_files']}; items not on its disk: "
              f"{disk.get('items_not_here')}")

    # how many nodes hold each item: all of them on both for data-parallel replicas
    status = states[("status", layout)]
    if layout in ("ddp", "hsdp"):
        assert "every item on 2 nodes; protected" in status, status
    else:
        assert "items on one node only; unprotected" in status, status  # never replicated

    # the restart: the same 2 nodes x 2 ranks, each rank reading its own node's disk
    results = states["load"]
    records = _records(results, layout)
    for rec in records:
        print(f"{layout}: rank {rec['rank']} read {rec.get('read')}")
    failures = _failures(results, records, world)
    assert not failures, f"{layout}: restart on the same nodes failed:\n" + "\n".join(failures) + \
        f"\nnode disks: {json.dumps(disks, indent=1)}"
    for rec in records:
        assert rec["host"] == cluster.hostname(rec["rank"] // cluster.ranks_per_node), rec
        assert rec["bitwise"] is True and rec["changed_by_load"] > 0, rec
        assert rec["read"]["remote_bytes"] == 0 and rec["read"]["bytes"] > 0, rec  # its own disk only

    # each node's disk: the manifest, exactly its own ranks' files, and a copy of every item
    for node, disk in disks.items():
        assert disk["manifest"], (node, disk)
        assert disk["topology"].get("mode") == "node-local", (node, disk)
        assert disk["rank_files"] and disk["rank_files"] == disk["expected_files"], (node, disk)
        assert not disk["items_not_here"], f"node{node}'s disk lacks {disk['items_not_here']}"


@pytest.mark.parametrize("layout", ONE_NODE_FEWER)
def test_a_restart_on_one_node_fewer_reads_what_its_disk_holds(states, layout):
    """World 4 -> 2 on node 0 alone: a DDP or HSDP state is all on node 0's disk (its copies), so
    it loads bitwise with nothing from elsewhere; an FSDP2 state's other half is on node 1 only,
    and the load fails naming the file and the node that holds it."""
    results = states["one_node_fewer"]
    records = _records(results, layout)
    assert sorted(r["rank"] for r in records) == [0, 1], describe(results)
    for rec in records:
        if layout == "fsdp2":
            assert "rank_00002." in rec["error"] or "rank_00003." in rec["error"], rec
            assert "node 1" in rec["error"], rec
        else:
            assert rec.get("error") is None and rec["bitwise"] is True, rec
            assert rec["read"]["remote_bytes"] == 0, rec


@pytest.mark.parametrize("layout", WIPED)
def test_a_wiped_node_restores_each_item_from_a_node_that_holds_it(states, layout):
    """A replacement node (empty disk), no replicas, no mirror: every item its ranks need is on
    the other node (data-parallel replicas, and its copies), so ``peers=True`` restores it there
    over the ranks' own gloo group, bitwise, and the node keeps the manifest for its next start."""
    results = states["restore"]
    records = _records(results, layout)
    assert not _failures(results, records, 4), "\n".join(_failures(results, records, 4))
    remote = {rec["rank"]: rec["read"]["remote_bytes"] for rec in records}
    assert all(rec["bitwise"] is True for rec in records), records
    assert remote[0] == remote[1] == 0 and remote[2] + remote[3] > 0, remote
    if layout == "ddp":  # both ranks of node 1 need every parameter: it came to the node once
        assert min(remote[2], remote[3]) == 0, remote
    assert "manifest.json" in states["kept"][layout], states["kept"][layout]
    assert states["spans"][layout], states["kept"][layout]  # what came is kept
    results = states["next_restart"]  # the healed node's next restart: its own disk
    records = _records(results, layout)
    assert not _failures(results, records, 4), "\n".join(_failures(results, records, 4))
    assert all(rec["bitwise"] is True and rec["read"]["remote_bytes"] == 0 for rec in records), records
