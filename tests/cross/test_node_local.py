"""Many nodes, each with its own NVMe at one path (harness/dcp_nvme_harness/multinode.py: a mount and UTS namespace
per node, torchrun per node over gloo): a save commits on every node's disk, each node drains
its own files, a restart loads from each node's own disk, and a reshard that needs another
node's bytes fails naming them and works from the mirror. Shared-directory mode stays as it was."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.multinode import SCRIPTS, all_records, describe

from dcp_nvme import NVMeReader
from dcp_nvme.tiers import drain_state

pytestmark = pytest.mark.slow
SCRIPT = SCRIPTS / "node_local.py"
SHARD = 4


def _records(cluster, action, env, timeout=150, **kwargs):
    results = cluster.run(SCRIPT, action, f"{cluster.mount}/run1", env=env, timeout=timeout, check=False, **kwargs)
    records = sorted(all_records(results), key=lambda r: r["rank"])
    return results, records


def _ok(results, records, count):
    errors = [r for r in records if r.get("error")]
    assert len(records) == count and not errors, describe(results)


def _step_dir(cluster, node, step):
    return cluster.node_disk(node) / "run1" / f"step_{step}"


def _save_keys(directory):
    return {name.split(".")[1] for name in os.listdir(directory) if name.startswith("rank_")}


def test_save_drain_restart_and_reshard_on_node_local_disks(cluster, tmp_path):
    mirror = tmp_path / "pfs"  # the second tier: one directory every node reaches
    env = {"MIRROR_ROOT": str(mirror), "STEPS": "1,2,2", "OVERWRITE": "2", "KEEP": "1"}
    results, records = _records(cluster, "save", env)
    _ok(results, records, 4)

    # every node's disk holds its own ranks' files and the whole metadata of the newest step;
    # the overwrite of step 2 left one save there; retention removed step 1, which is mirrored
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        step2 = _step_dir(cluster, node, 2)
        names = os.listdir(step2)
        assert "manifest.json" in names, describe(results)
        assert sorted(n.split(".")[0] for n in names if n.startswith("rank_")) == [f"rank_{r:05d}" for r in ranks]
        assert len(_save_keys(step2)) == 1, names
        assert not _step_dir(cluster, node, 1).exists(), f"node {node} kept step_1 though it is mirrored"
        doc = json.loads((step2 / "manifest.json").read_text())
        assert doc["topology"] == {"mode": "node-local", "nodes": ["0", "1"], "rank_nodes": [0, 0, 1, 1]}
        state = drain_state(step2)
        assert state.state == "mirrored", state
    # the mirror: one checkpoint per step, each with every node's files, loadable as a whole
    for step in (1, 2):
        got = {"w": torch.empty(4 * SHARD)}
        dcp.load(got, storage_reader=NVMeReader(mirror / f"step_{step}"), no_dist=True)
        assert got["w"].tolist() == [float(10 * step + r) for r in range(4) for _ in range(SHARD)]
    status = cluster.on_node(1, [sys.executable, "-m", "dcp_nvme", "status", f"{cluster.mount}/run1"], check=True)
    assert "step_2: mirrored" in status.stdout and "node-local on 2 node(s) (node 0: ranks 0-1; node 1: ranks 2-3)" \
        in status.stdout, status.stdout
    inspect = cluster.on_node(1, [sys.executable, "-m", "dcp_nvme", "inspect", f"{cluster.mount}/run1/step_2"], check=True)
    assert "committed" in inspect.stdout and "files of node(s) 0 are on their own disks" in inspect.stdout, inspect.stdout
    drains = {rec["rank"]: rec["saves"][-1]["drain"] for rec in records}
    assert drains[1] is None and drains[3] is None  # one rank per node drains: ranks 0 and 2
    assert (drains[0]["nodes"], drains[2]["nodes"]) == (["0"], ["1"])  # each its own node's files
    print("save/drain seconds:", [(r["rank"], r["saves"]) for r in records])

    # restart on the same nodes: latest agrees everywhere, every rank loads from its own disk
    results, records = _records(cluster, "load", {})
    _ok(results, records, 4)
    for rec in records:
        assert rec["latest"] == "step_2", rec
        assert rec["loaded"] == [float(20 + rec["rank"])] * SHARD, rec
    print("restart load seconds:", [(r["rank"], r["load_seconds"]) for r in records])

    # a world of 2 on node 0: its disk lacks ranks 2-3's bytes (named in the error); the mirror has them
    env = {"MIRROR_ROOT": str(mirror), "STEP": "2", "SAVED_WORLD": "4"}
    results, records = _records(cluster, "reshard", env, nodes=[0])
    _ok(results, records, 2)
    for rec in records:
        assert "rank_00002" in rec["local_error"] and "node 1" in rec["local_error"], rec["local_error"]
        assert rec["loaded"] == rec["expected"], rec


def test_a_node_dying_mid_save_leaves_the_previous_step_newest_everywhere(cluster):
    results, records = _records(cluster, "save", {"STEPS": "1"}, ranks_per_node=1)
    _ok(results, records, 2)
    results, records = _records(cluster, "save", {"STEPS": "2"}, env_per_node={1: {"CRASH_AT_STEP": "2"}},
                                ranks_per_node=1)
    assert not all(r.ok for r in results), describe(results)
    # the surviving node's save raised (no hang): its rank reported the failure and exited
    assert [r["rank"] for r in records] == [0] and records[0]["error"], describe(results)
    assert results[0].killed is None, describe(results)
    print("survivor's error:", records[0]["error"])
    for node in (0, 1):
        code = f"import dcp_nvme; print(dcp_nvme.latest('{cluster.mount}/run1'))"
        found = cluster.on_node(node, [sys.executable, "-c", code], check=True)
        assert found.stdout.strip().endswith("step_1"), (node, found.stdout, found.stderr)
        assert not (_step_dir(cluster, node, 2) / "manifest.json").exists()
    # the job restarts: the dead save's lock is on every node's copy (its holder ran in another
    # pid namespace, so it is not provably dead); `dcp-nvme unlock --force` on each node frees it
    for node in (0, 1):
        unlock = cluster.on_node(node, [sys.executable, "-m", "dcp_nvme", "unlock", "--force",
                                        f"{cluster.mount}/run1/step_2"])
        assert unlock.returncode == 0, (node, unlock.stdout, unlock.stderr)
    results, records = _records(cluster, "save", {"STEPS": "2"}, ranks_per_node=1)  # its files: garbage
    _ok(results, records, 2)
    for node in (0, 1):
        assert len(_save_keys(_step_dir(cluster, node, 2))) == 1, os.listdir(_step_dir(cluster, node, 2))


def test_a_node_dying_mid_drain_is_given_up_on_by_name(cluster, tmp_path):
    """Node 1 dies once its drain sent a piece: node 0's drain, its own files sent, gives up on
    node 1 after node_silence seconds without its heartbeat (not node_wait's 120 s, retried),
    with an error naming it, and its process ends."""
    env = {"MIRROR_ROOT": str(tmp_path / "pfs"), "STEPS": "1", "NODE_SILENCE": "3"}
    began = time.monotonic()
    results, records = _records(cluster, "save", env, env_per_node={1: {"DIE_IN_DRAIN": "1"}}, ranks_per_node=1)
    took = time.monotonic() - began
    assert [r["rank"] for r in records] == [0], describe(results)
    error = records[0]["error"]
    assert error and "node(s) 1 did not drain their files" in error and "node_silence" in error, describe(results)
    assert took < 100, took
    print(f"the survivor gave up after {took:.1f} s in all")


def test_drain_of_every_node_to_s3_loads_at_another_world_size(cluster, seaweed, seaweed_bucket):
    # SeaweedFS on a node of its own: the nodes drain over their links; the test process loads
    # through the host's relay
    options = seaweed.storage_options(node=True)
    env = {"MIRROR_ROOT": f"s3://{seaweed_bucket}/run1", "MIRROR_OPTIONS": json.dumps(options), "STEPS": "1"}
    results, records = _records(cluster, "save", env, ranks_per_node=1)  # one rank per node
    _ok(results, records, 2)
    assert [r["saves"][0]["drain"]["nodes"] for r in records if r["saves"][0]["drain"]] == [["0"], ["1"]]
    whole = {"w": torch.empty(2 * SHARD)}  # world size 1, from the mirror every node drained into
    dcp.load(whole, storage_reader=NVMeReader(f"s3://{seaweed_bucket}/run1/step_1",
                                              storage_options=seaweed.storage_options()), no_dist=True)
    assert whole["w"].tolist() == [float(10 + r) for r in range(2) for _ in range(SHARD)]


def test_nodes_sharing_one_directory_keep_the_shared_mode(cluster):
    shared = cluster.node_disk(0)
    disk1 = cluster.node_disk(1)
    disk1.rmdir()
    disk1.symlink_to(shared)  # node 1's mount shows node 0's directory: one filesystem for all
    results, records = _records(cluster, "save", {"STEPS": "1"}, ranks_per_node=1)
    _ok(results, records, 2)
    step1 = shared / "run1" / "step_1"
    doc = json.loads((step1 / "manifest.json").read_text())
    assert doc["topology"]["mode"] == "shared"
    assert len([n for n in os.listdir(step1) if n.startswith("rank_")]) == 2
    assert not [n for n in os.listdir(step1) if n.startswith(".dcp_nvme-probe")]  # probes removed
