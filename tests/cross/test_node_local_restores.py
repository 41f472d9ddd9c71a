"""Restores of trainers' node-local states from the other nodes, over the ranks' own
gloo group (``peers=True``): a wiped node, a range that arrives damaged, a new empty node, and
replicas of a data-parallel state that move nothing. Split from test_node_local_states.py, whose
helpers it uses, so that the two files run on different workers; a wiped node's restore is part
of that file's layout test (it reuses the layout's save)."""

from __future__ import annotations

import shutil

import pytest
from dcp_nvme_harness.multinode import all_records
from test_node_local_states import SCRIPT, STEP, _failures, _records, _wipe

pytestmark = pytest.mark.slow


def test_a_range_that_arrives_damaged_comes_from_the_next_holder(cluster3):
    """HSDP on 3 nodes; node 2 wiped; node 0 flips a byte of everything it sends: node 2's ranks
    find it on arrival, say which node sent it, and take those ranges from node 1: bitwise."""
    run = dict(ranks_per_node=2, timeout=180, check=False)
    results = cluster3.run(SCRIPT, "save", "hsdp", f"{cluster3.mount}/run", **run)
    assert not _failures(results, all_records(results), 6)
    _wipe(cluster3, 2)
    results = cluster3.run(SCRIPT, "load", "hsdp", f"{cluster3.mount}/run",
                           env={"READER_PEERS": "1", "CORRUPT_SENDS_ON_NODE": "0"}, **run)
    records = all_records(results)
    assert not _failures(results, records, 6), "\n".join(_failures(results, records, 6))
    assert all(rec["bitwise"] is True for rec in records), records
    on_node2 = [rec for rec in records if rec["rank"] >= 4]
    assert sum(rec["read"]["remote_bytes"] for rec in on_node2) > 0, on_node2
    named = [w for rec in on_node2 for w in rec["warnings"] if "node 0 could not send" in w]
    assert named, [rec["warnings"] for rec in on_node2]


JOINED = ("hsdp", "ddp")


@pytest.fixture(scope="module")
def joined(tmp_path_factory, lan):
    """Both layouts saved on 2 nodes x 2 ranks, then restarted on 3 (``peers=True``), each in the
    same two launches (every process imports torch: a launch costs more than a layout)."""
    from dcp_nvme_harness.multinode import Cluster, unshare_unavailable

    reason = unshare_unavailable()
    if reason:
        pytest.skip(reason)
    with Cluster(tmp_path_factory.mktemp("joined") / "cluster", nodes=3, ranks_per_node=2, network=lan) as cluster:
        runs, run = f"{cluster.mount}/runs/{{layout}}", dict(timeout=300, check=False)
        saved = cluster.run(SCRIPT, "save", ",".join(JOINED), runs, nodes=[0, 1], **run)
        for layout in JOINED:
            for local in (0, 1):  # what rank 4 + local of the new node must hold: what rank `local` saved
                kept = cluster._tmp(0) / f"train_states-{layout}-rank{local:05d}.pt"
                if kept.exists():
                    shutil.copy(kept, cluster._tmp(2) / f"train_states-{layout}-rank{4 + local:05d}.pt")
        loaded = cluster.run(SCRIPT, "load", ",".join(JOINED), runs, env={"READER_PEERS": "1"}, **run)
        yield cluster, saved, loaded


@pytest.mark.parametrize("layout", JOINED)
def test_a_new_empty_node_joins_the_restart(joined, layout):
    """Saved on 2 nodes x 2 ranks, restarted on 3 (world 4 -> 6): the new node's disk is empty,
    so its ranks get the manifest and every chunk they need from the others (``peers=True``);
    a data-parallel state is the same on every node, so each rank compares bitwise with what
    the rank of its local index saved."""
    cluster3, saved, loaded = joined
    assert not _failures(saved, _records(saved, layout), 4)
    records = _records(loaded, layout)
    assert not _failures(loaded, records, 6), "\n".join(_failures(loaded, records, 6))
    assert all(rec["bitwise"] is True for rec in records), records
    remote = {rec["rank"]: rec["read"]["remote_bytes"] for rec in records}
    assert not any(remote[rank] for rank in range(4)) and remote[4] + remote[5] > 0, remote
    if layout == "ddp":  # the new node's two ranks need the same items: they came to it once
        assert min(remote[4], remote[5]) == 0, remote
    assert (cluster3.node_disk(2) / "runs" / layout / STEP / "manifest.json").exists()


def test_replicas_of_a_data_parallel_state_need_no_transfer(cluster):
    """HSDP with ``replicas=1``: every item is on both nodes already (each keeps what its ranks
    hold), so no node sends or receives anything: no bytes. (That no module of ours listens on a
    socket is checked statically: tests/cross/test_package_layout.py.)"""
    results = cluster.run(SCRIPT, "save", "hsdp", f"{cluster.mount}/run", env={"WRITER_REPLICAS": "1"},
                          timeout=150, check=False)
    records = all_records(results)
    assert not _failures(results, records, 4), "\n".join(_failures(results, records, 4))
    writers = [rec for rec in records if "replication" in rec]
    assert len(writers) == 2, records  # one node writer per node
    for rec in writers:
        assert rec["replication"]["already_held"] is True and rec["replication"]["bytes"] == 0, rec
