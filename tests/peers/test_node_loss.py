"""Surviving the loss of a node (harness/dcp_nvme_harness/multinode.py, 3 simulated nodes of one rank each): every
node's files are replicated on the next node's disk; a restarted job whose node 1 is a
replacement with an empty disk loads bitwise-equal from the replica when the mirror lacks the
step, from the mirror when the replica is damaged (and names the damaged copy), from the
mirror when every node's copy left retention; a restart at another world size takes the bytes
it needs from peers; retention removes a mirrored step's copies and replicas on every node. The
mirror is SeaweedFS's S3 on a node of its own, reached over the shaped links (fixture ``seaweed``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest
from dcp_nvme_harness.multinode import SCRIPTS, all_records, describe

from dcp_nvme.format.container import REPLICA_MARKER, REPLICAS_DIR
from dcp_nvme.tiers.journal import drain_state

pytestmark = pytest.mark.slow
SCRIPT = SCRIPTS / "node_loss.py"
SHARD = 64 << 10  # float32 per rank: 256 KiB rank files, several checksum blocks each


def _run(cluster, action, env, **kwargs):
    began = time.monotonic()
    results = cluster.run(SCRIPT, action, f"{cluster.mount}/run1", env={"SHARD_ELEMS": str(SHARD), **env},
                          timeout=150, check=False, **kwargs)
    records = sorted(all_records(results), key=lambda r: r["rank"])
    print(f"{action}: {time.monotonic() - began:.1f} s")
    return results, records


def _ok(results, records, count):
    errors = [r for r in records if r.get("error")]
    assert len(records) == count and not errors, describe(results) + "\n" + json.dumps(errors)[:3000]


def _step(cluster, node, step):
    return cluster.node_disk(node) / "run1" / f"step_{step}"


def test_replicas_survive_a_lost_node(cluster3, seaweed, seaweed_bucket):
    cluster, mirror = cluster3, f"s3://{seaweed_bucket}/run1"
    # the nodes' S3 client: the store's address on the private network, also for `dcp-nvme status`
    s3 = {"MIRROR_OPTIONS": json.dumps(seaweed.storage_options(node=True)),
          "AWS_ENDPOINT_URL_S3": seaweed.node_endpoint_url}
    # what node 2 sends its replica arrives damaged (a fault of the test): node 0 finds it and
    # makes no replica, and that fails no save; node i holds node i-1's files, node i+1 confirmed
    # node i's. Node 1's disk is full when it makes its replica of step 1: both node 0's and node
    # 1's replication of step 1 end with that error, and steps 2 and 3 replicate as usual (they
    # waited forever behind it)
    results, records = _run(cluster, "save", {"STEPS": "1,2,3", "REPLICAS": "1", "KEEP": "2",
                                              "MIRROR_ROOT": mirror, **s3},
                            env_per_node={2: {"FLIP_REPLICA_SENDS": "1"}, 1: {"NO_ROOM_FOR_REPLICAS_OF": "1"}})
    _ok(results, records, 3)
    for rec in records:
        node = rec["rank"]
        for entry in rec["saves"]:
            rep = entry["replication"]
            if entry["step"] == 1 and node in (0, 1):
                full = "cannot make the replica directory of node 0 here: OSError: [Errno 28] No space left"
                if node == 1:
                    assert full in rep["pulled"]["0"], rep
                else:
                    assert rep["replicated_on"] == [] and full in rep["failed"]["1"], rep
                    assert rep["pulled"]["2"].startswith("ManifestError: ChecksumMismatchError"), rep
                continue
            if node == 0:
                assert rep["pulled"]["2"].startswith("ManifestError: ChecksumMismatchError"), rep
            else:
                assert rep["pulled"] == {str(node - 1): "ok"}, rep
            if node == 2:
                assert rep["replicated_on"] == [] and "ChecksumMismatchError" in rep["failed"]["0"], rep
            else:
                assert rep["replicated_on"] == [str(node + 1)], rep
    print("save/replication seconds:", [(r["rank"], r["saves"]) for r in records])
    for node in range(3):
        # retention: step 1 is mirrored, so its copy and the replica it held went on every node
        assert not _step(cluster, node, 1).exists(), f"node {node} kept step_1"
        for step in (2, 3):
            replica = _step(cluster, node, step) / REPLICAS_DIR / str((node - 1) % 3)
            if node == 0:  # the failed pull left nothing that looks like a replica
                assert not replica.exists() or not os.listdir(replica), os.listdir(replica)
                continue
            marker = json.loads((replica / REPLICA_MARKER).read_text())
            assert marker["node"] == str(node - 1), marker
            owner_file = f"rank_{node - 1:05d}.{marker['save_key']}.safetensors"
            theirs = _step(cluster, node - 1, step) / owner_file
            assert (replica / owner_file).read_bytes() == theirs.read_bytes()
    status = cluster.on_node(1, [sys.executable, "-m", "dcp_nvme", "status", f"{cluster.mount}/run1"], env=s3,
                            check=True)
    assert "step_3: mirrored" in status.stdout and "replicated on node(s) 2" in status.stdout, status.stdout
    assert "holds replicas of node(s) 0; protected" in status.stdout, status.stdout
    status = cluster.on_node(2, [sys.executable, "-m", "dcp_nvme", "status", f"{cluster.mount}/run1"], env=s3,
                            check=True)
    assert "replica on node 0 failed" in status.stdout, status.stdout

    # node 1 is lost: a replacement with an empty disk joins. Step 3 never reached the mirror
    # (the drain had not finished), node 2's replica of node 1's step 2 is damaged, and step 1
    # is only on the mirror (retention). The restart runs at world size 6 (a reshard).
    shutil.rmtree(cluster.node_disk(1) / "run1")
    seaweed.admin.rm(f"{seaweed_bucket}/run1/step_3", recursive=True)
    replica2 = _step(cluster, 2, 2) / REPLICAS_DIR / "1"
    damaged = next(p for p in replica2.iterdir() if p.name.startswith("rank_00001"))
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF  # one byte of the last checksum block
    damaged.write_bytes(bytes(data))
    results, records = _run(cluster, "restore", {"LOAD_STEPS": "3,2,1", "SAVED_WORLD": "3",
                                                 "MIRROR_ROOT": mirror, **s3}, ranks_per_node=2)
    _ok(results, records, 6)
    print("restore:", json.dumps([(r["rank"], r["loads"]) for r in records]))
    def sources(node, step):  # a node's two ranks share its disk: what either fetched, the other reads
        out, damaged = {}, []
        for rec in records[2 * node:2 * node + 2]:
            entry = next(e for e in rec["loads"] if e["step"] == step)
            assert entry.get("equal"), rec  # bit for bit
            for kind, taken in entry["sources"].items():
                if kind == "damaged":
                    damaged += taken
                elif kind == "read":  # the load's own read of this node's disk, or of what came to this rank
                    assert taken["bytes"] + entry["from_received"] > 0, entry
                else:
                    out[kind] = out.get(kind, 0) + taken["bytes"]
        return out, damaged

    for node in range(3):
        three, two, one = sources(node, 3), sources(node, 2), sources(node, 1)
        if node == 1:  # the replacement node: step 3 from node 2's replica, the manifest from a peer
            assert "peer" in three[0] and "mirror" not in three[0], three
            assert "mirror" in two[0], two  # node 2's replica of step 2 is damaged: the mirror's copy
            assert any("node 2" in d and ".replicas/1/rank_00001" in d for d in two[1]), two
        else:  # the other nodes read their own disks: nothing came from elsewhere
            assert three[0] == {} and two[0] == {}, (three, two)
        # no node kept step 1: the manifest and the bytes come from the mirror (no node holds them)
        assert set(one[0]) == {"mirror"}, one
    assert any("mirror" in sources(node, 1)[0] for node in range(3))
    healed = os.listdir(_step(cluster, 1, 3))  # the replacement node kept what it fetched
    assert "manifest.json" in healed and any(n.startswith("rank_00001") for n in healed), healed
    for node in range(3):  # step 1 came back from the mirror alone: journaled mirrored there
        state = drain_state(str(_step(cluster, node, 1)))
        assert (state.state, state.target, state.restored_from) == ("mirrored", f"{mirror}/step_1", f"{mirror}/step_1"), \
            (node, state)
