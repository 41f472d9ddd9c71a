"""Trainers' state dicts on node-local disks (issue 39): every item that several ranks hold.

DCP's planner (``dedup_save_plans``) writes an item held by several ranks once per job, by one
of them. With one disk per node that copy lands on a single node, and a restart on the same
nodes needs it on every node whose ranks hold the item: DDP's parameters, AdamW's per-parameter
``step`` tensors, plain values and a BytesIO, HSDP's [Replicate(), Shard(0)] DTensors, the
optimizer state of FSDP x TP. Each layout (tests/multinode_scripts/train_states.py) is saved
with a plain NVMeWriter on 2 simulated nodes x 2 ranks (tests/multinode.py), then restarted on
the same nodes with a plain NVMeReader (no peers, no mirror): every rank must get back bitwise
what it saved, and each node's disk must hold a copy of every item. ``sharded`` is the control:
fsdp2's model alone, nothing that two ranks hold.
"""

from __future__ import annotations

import json
import os

import pytest
from multinode import SCRIPTS, all_records, describe

from dcp_nvme import NVMeReader

pytestmark = pytest.mark.slow
SCRIPT = SCRIPTS / "train_states.py"
LAYOUTS = ("ddp", "fsdp2", "hsdp", "tpdp", "sharded")
STEP = "step_1"


def _run(cluster, action, layout, timeout=150):
    results = cluster.run(SCRIPT, action, layout, f"{cluster.mount}/run", timeout=timeout, check=False)
    return results, all_records(results)


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


def _disk(cluster, node):
    """What node ``node``'s own disk holds of the checkpoint: its rank files, the files the
    manifest says this node's ranks wrote, and the items with no chunk in any file here."""
    step = cluster.node_disk(node) / "run" / STEP
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
    metadata = NVMeReader(step).read_metadata()  # the manifest alone: reads no data file
    here = set(names)
    held = {index.fqn for index, chunk in metadata.storage_data.items() if chunk.file in here}
    report["items"] = len(metadata.state_dict_metadata)
    report["items_not_here"] = sorted(set(metadata.state_dict_metadata) - held)
    return report


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_state_restarts_on_the_same_nodes_from_their_own_disks(cluster, layout):
    world = cluster.nodes * cluster.ranks_per_node
    results, records = _run(cluster, "save", layout)
    failures = _failures(results, records, world)
    assert not failures, f"{layout}: save failed:\n" + "\n".join(failures)
    if layout == "hsdp":
        assert all(r["placements"].get("(Replicate(), Shard(dim=0))") == 12 for r in records), records
    disks = {node: _disk(cluster, node) for node in range(cluster.nodes)}
    for node, disk in disks.items():
        print(f"{layout}: node{node} holds {disk['rank_files']}; items not on its disk: "
              f"{disk.get('items_not_here')}")

    # the restart: the same 2 nodes x 2 ranks, each rank reading its own node's disk
    results, records = _run(cluster, "load", layout)
    for rec in records:
        print(f"{layout}: rank {rec['rank']} read {rec.get('read')}")
    failures = _failures(results, records, world)
    assert not failures, f"{layout}: restart on the same nodes failed:\n" + "\n".join(failures) + \
        f"\nnode disks: {json.dumps(disks, indent=1)}"
    for rec in records:
        assert rec["host"] == cluster.hostname(rec["rank"] // cluster.ranks_per_node), rec
        assert rec["bitwise"] is True and rec["changed_by_load"] > 0, rec

    # each node's disk: the manifest, exactly its own ranks' files, and a copy of every item
    for node, disk in disks.items():
        assert disk["manifest"], (node, disk)
        assert disk["topology"].get("mode") == "node-local", (node, disk)
        assert disk["rank_files"] and disk["rank_files"] == disk["expected_files"], (node, disk)
        assert not disk["items_not_here"], f"node{node}'s disk lacks {disk['items_not_here']}"
