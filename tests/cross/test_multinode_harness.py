"""Simulated nodes (tests/multinode.py): separate disks at one path, separate host names, a lost
node. The checkpoints themselves are tested on such nodes in tests/cross/test_node_local.py."""

import pytest
from multinode import SCRIPTS, NodeFailure, all_records, describe

pytestmark = pytest.mark.slow


def _mounts_under(path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if str(path) in line]


def test_nodes_have_their_own_disk_and_host_name(cluster):
    results = cluster.run(SCRIPTS / "hello.py", cluster.mount, timeout=60)
    records = all_records(results)
    assert [r["rank"] for r in records] == [0, 1, 2, 3], describe(results)
    for rec in records:
        node = rec["rank"] // 2
        assert (rec["host"], rec["group_rank"], rec["world"]) == (f"node{node}", node, 4), rec
        assert rec["sum"] == 0 + 1 + 2 + 3, rec  # the gloo group spans both nodes
        assert rec["seen"] == [f"hello.{2 * node}", f"hello.{2 * node + 1}"], rec  # only its node's files
    for node in (0, 1):
        disk = cluster.node_disk(node)
        assert sorted(p.name for p in disk.iterdir()) == [f"hello.{2 * node}", f"hello.{2 * node + 1}"]
        assert {p.read_text() for p in disk.iterdir()} == {f"node{node} {node}\n"}
    # a plain command on a node sees the same; the host sees an empty mount point and no mounts
    probe = cluster.on_node(1, ["sh", "-c", f"hostname; ls {cluster.mount}"], check=True)
    assert probe.stdout.split() == ["node1", "hello.2", "hello.3"]
    assert list(cluster.mount.iterdir()) == []
    assert _mounts_under(cluster.root) == []


def test_a_lost_node_is_killed_and_reported(cluster):
    run = cluster.start(SCRIPTS / "hello.py", cluster.mount, env_per_node={1: {"HELLO_STALL": "1"}})
    run.wait_until(lambda: all((cluster.node_disk(1) / f"hello.{r}").exists() for r in (2, 3)), timeout=60)
    run.kill_node(1)  # node 1's ranks hang before the all_reduce: pull its plug
    with pytest.raises(NodeFailure) as failure:
        run.wait(timeout=60, grace=30)
    node0, node1 = failure.value.results
    assert (node1.returncode, node1.killed) == (-9, "kill_node"), describe(failure.value.results)
    assert node0.returncode not in (0, None) and node0.killed is None, describe(failure.value.results)
    message = str(failure.value)
    assert "node1 (node rank 1): exit -9, killed: kill_node" in message
    assert node0.stderr.strip()[-200:] in message  # the survivor's error output is in the report
    assert _mounts_under(cluster.root) == []
