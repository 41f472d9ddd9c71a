"""Simulated nodes (harness/dcp_nvme_harness/multinode.py): separate disks at one path, separate host names, a private
network of shaped links (harness/dcp_nvme_harness/netns.py), a lost node. The checkpoints themselves are tested on
such nodes in tests/cross/test_node_local.py."""

import socket
import subprocess
import sys
import time

import pytest
from dcp_nvme_harness.multinode import SCRIPTS, NodeFailure, all_records, describe
from dcp_nvme_harness.netns import Network, network_unavailable, parse_rate

pytestmark = pytest.mark.slow


def _mounts_under(path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if str(path) in line]


@pytest.mark.parametrize("launcher", ["fork", "torchrun"])
def test_nodes_have_their_own_disk_and_host_name(cluster, launcher):
    results = cluster.run(SCRIPTS / "hello.py", cluster.mount, timeout=60, launcher=launcher)
    records = all_records(results)
    assert [r["rank"] for r in records] == [0, 1, 2, 3], describe(results)
    for rec in records:
        node = rec["rank"] // 2
        assert (rec["host"], rec["group_rank"], rec["world"]) == (f"node{node}", node, 4), rec
        assert rec["sum"] == 0 + 1 + 2 + 3, rec  # the gloo group spans both nodes
        assert rec["seen"] == [f"hello.{2 * node}", f"hello.{2 * node + 1}"], rec  # only its node's files
        assert rec["addr"] == rec["resolves"] == cluster.addr(node), rec  # its own address, named in /etc/hosts
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


# a server on a node: prints its port, then the peer address of each connection and what it sent
_SERVER = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
           "print(s.getsockname()[1], flush=True)\n"
           "while True:\n c, peer = s.accept(); print(peer[0], c.recv(16).decode(), flush=True); c.close()")
_CONNECT = ("import socket, sys\n"
            "try:\n s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)\n"
            " s.sendall(sys.argv[3].encode()); print('connected')\n"
            "except OSError as e:\n print(type(e).__name__, e.errno)")


def test_the_nodes_network_is_private_and_has_no_way_out(cluster):
    net = cluster.net
    assert net is not None and cluster.addr(0) != cluster.addr(1)
    # a listener on the host's loopback: a node's 127.0.0.1 is its own, so it must not reach it
    with socket.socket() as host_srv:
        host_srv.bind(("127.0.0.1", 0))
        host_srv.listen()
        host_port = host_srv.getsockname()[1]
        out = cluster.on_node(0, [sys.executable, "-c", _CONNECT, "127.0.0.1", host_port, "x"], check=True)
        assert out.stdout.split() == ["ConnectionRefusedError", "111"], out
    # no default route, only the cluster's subnet; lo and eth0 and nothing else (route get sends nothing)
    routes = cluster.on_node(1, ["ip", "route", "show", "table", "all"], check=True).stdout
    assert "default" not in routes and "10.41.0.0/16 dev eth0" in routes, routes
    links = cluster.on_node(1, ["ip", "-o", "link"], check=True).stdout
    assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "eth0"], links
    assert "unreachable" in cluster.on_node(1, ["ip", "route", "get", "192.0.2.1"]).stderr
    assert "rate 1Gbit" in cluster.on_node(1, ["tc", "qdisc", "show", "dev", "eth0"], check=True).stdout
    # node 0 reaches node 1 at its address and by its name, and node 1 sees node 0's address
    server = subprocess.Popen([*net.enter(net.nodes["node1"]), sys.executable, "-c", _SERVER],
                              stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        port = int(server.stdout.readline())
        for target in (cluster.addr(1), "node1"):
            out = cluster.on_node(0, [sys.executable, "-c", _CONNECT, target, port, target], check=True)
            assert out.stdout.strip() == "connected", out
            assert server.stdout.readline().split() == [cluster.addr(0), target]
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def _send_8mb(net: Network, a, b) -> float:
    """Seconds for 8 MB from node ``a`` to node ``b`` over one TCP stream."""
    sink = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 5000)); s.listen(); print('up', flush=True); "
            "c, _ = s.accept(); n = 0\nwhile (d := c.recv(1 << 20)): n += len(d)\nprint(n, flush=True)")
    send = ("import socket, sys, time; s = socket.create_connection((sys.argv[1], 5000)); t = time.monotonic(); "
            "s.sendall(bytes(8 << 20)); s.shutdown(socket.SHUT_WR); s.recv(1); print(time.monotonic() - t)")
    server = subprocess.Popen([*net.enter(b), sys.executable, "-c", sink], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        took = float(net.run(a, [sys.executable, "-c", send, b.addr], timeout=30, check=True).stdout)
        assert int(server.stdout.readline()) == 8 << 20
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    return took


def test_a_link_carries_no_more_than_its_rate():
    """And a node's downlink set to half the rate carries half as much (the benchmarks' fat or
    thin downlink)."""
    if network_unavailable():  # not at collection: the probe builds a network (~0.3 s)
        pytest.skip(network_unavailable())
    rate = "200mbit"  # 25 MB/s: 8 MB take 0.32 s at least (less the first burst)
    with Network(rate=rate, delay_ms=0.2) as net:
        a, b = net.add_node("a"), net.add_node("b")
        took = _send_8mb(net, a, b)
        floor = ((8 << 20) - 2 * 256 * 1024) / parse_rate(rate)
        assert floor * 0.9 < took < 5, (took, net.shaping)
        assert net.delay_shaped or "netem" in net.shaping  # without netem the reason is given
        net.set_downlink(b, "100mbit")
        took = _send_8mb(net, a, b)
        assert 2 * floor * 0.9 < took < 10, (took, net.shaping)


def test_a_cluster_takes_its_nodes_off_a_shared_network_when_closed(tmp_path):
    from dcp_nvme_harness.multinode import Cluster, unshare_unavailable

    reason = unshare_unavailable() or network_unavailable()
    if reason:
        pytest.skip(reason)
    with Network() as net:
        other = net.add_node("s3")
        t = time.monotonic()
        cluster = Cluster(tmp_path / "c", nodes=3, ranks_per_node=1, network=net)
        took = time.monotonic() - t
        assert sorted(net.nodes) == ["node0", "node1", "node2", "s3"]
        hosts = cluster.on_node(2, ["cat", "/etc/hosts"], check=True).stdout
        assert f"{other.addr} s3" in hosts and f"{cluster.addr(2)} node2" in hosts, hosts
        cluster.close()
        assert sorted(net.nodes) == ["s3"]
    assert took < 5, took  # three namespaces, links and shaping (~0.1 s a node on an idle machine)
