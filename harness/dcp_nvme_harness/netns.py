"""A private network of simulated nodes: one network namespace per node, veth links to a bridge.

    net = Network(rate="1gbit", delay_ms=0.2)     # a switch: its own namespace, holding bridge br0
    a, b = net.add_node("node0"), net.add_node("node1")
    net.run(a, ["ping", "-c1", b.addr])            # a plain command on node a's network
    argv = [*net.enter(b), "python", "server.py"]  # the prefix that puts any command on node b
    net.close()

Layout: the switch namespace holds ``br0``; each node's namespace holds ``lo`` and ``eth0`` (an
address in 10.41.0.0/16), the other end of whose veth pair is a port of ``br0`` in the switch.
No namespace of it has a link to the host's interfaces or a default route, so nothing sent in
it can leave the machine, and the host (whose default route does lead out) must never send to
these addresses: a host-side client reaches a node through ``Forwarder`` instead.

Each link is shaped in both directions (the node's ``eth0`` egress and the switch port's egress)
with tc: ``tbf`` at ``rate``, and ``netem`` for half of ``delay_ms`` at each end (so one way
between two nodes takes ``delay_ms``) where the kernel has netem; where it has not,
``delay_shaped`` is False and ``shaping`` says why (the rate still holds). ``set_downlink``
changes one node's downlink rate afterwards (a fat or thin port of the switch).

A namespace lives as long as a process in it: each is held by an ``unshare --net sleep`` child
that dies with the thread that started it (PR_SET_PDEATHSIG), and no named namespace
(``ip netns add``) is made, so a crashed test run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Network", "NetNode", "Forwarder", "network_unavailable", "parse_rate"]

SUBNET = "10.41.0.0/16"
CLONE_NEWNET = 0x40000000


def _pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _netns_ino(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def parse_rate(rate: str) -> int:
    """tc's rate spelling (``1gbit``, ``100mbit``, ``500kbit``, ``10mbps``) in bytes per second."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(bit|bps)\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. '1gbit', '100mbit' or '10mbps'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    value = float(m.group(1)) * scale
    return int(value / 8 if m.group(3) == "bit" else value)


class _Holder:
    """A child process alone in a new network namespace (``unshare --net sleep infinity``)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=_pdeathsig)
        host = _netns_ino("self")
        deadline = time.monotonic() + 10
        # until unshare has run, /proc/<pid>/ns/net is still the host's: never configure that one
        while True:
            if self.proc.poll() is not None:
                raise OSError(f"unshare --net failed: {self.proc.stderr.read().decode(errors='replace').strip()}")
            with contextlib.suppress(FileNotFoundError):
                if _netns_ino(self.proc.pid) != host:
                    break
            if time.monotonic() > deadline:
                self.close()
                raise OSError("unshare --net: no new network namespace after 10 s")
            time.sleep(0.001)
        self.ino = _netns_ino(self.proc.pid)
        self.path = f"/proc/{self.proc.pid}/ns/net"

    def check(self) -> None:
        """Refuse to act on a namespace that is not this one (holder gone, pid reused)."""
        if self.proc.poll() is not None or _netns_ino(self.proc.pid) != self.ino:
            raise RuntimeError(f"network namespace holder {self.proc.pid} is gone")

    def enter(self) -> list[str]:
        self.check()
        return ["nsenter", f"--net={self.path}"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _sh(holder: _Holder, script: str, what: str) -> None:
    proc = subprocess.run([*holder.enter(), "sh", "-ec", script], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=30)
    if proc.returncode != 0:
        raise OSError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")


@dataclass
class NetNode:
    """One node's network namespace: ``addr`` on its ``eth0``, reachable from the other nodes."""

    name: str
    addr: str
    port: str
    """The switch-side end of its link (a port of br0)."""
    _holder: _Holder = field(repr=False)

    @property
    def netns(self) -> str:
        """A path to its network namespace (``nsenter --net=PATH``, ``setns``)."""
        self._holder.check()
        return self._holder.path

    @property
    def pid(self) -> int:
        return self._holder.proc.pid


@functools.lru_cache(maxsize=1)
def network_unavailable() -> str | None:
    """Why a private network cannot be built here (a skip reason), or None when it can.

    Really builds one of two nodes with a shaped link and checks that they reach each other.
    """
    if not sys.platform.startswith("linux"):
        return f"private node networks need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "private node networks need root (unshare --net, veth, tc)"
    for tool in ("unshare", "nsenter", "ip", "tc", "sh"):
        if shutil.which(tool) is None:
            return f"private node networks need `{tool}` on PATH"
    try:
        with Network(rate="100mbit", delay_ms=0) as net:
            a, b = net.add_node("probe-a"), net.add_node("probe-b")
            code = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); s.listen(); "
                    "p=s.getsockname()[1]; print(p, flush=True); c,_=s.accept(); c.sendall(b'ok')")
            server = subprocess.Popen([*net.enter(b), sys.executable, "-c", code, b.addr], stdout=subprocess.PIPE,
                                      text=True, stdin=subprocess.DEVNULL)
            try:
                port = int(server.stdout.readline())
                got = net.run(a, [sys.executable, "-c", "import socket,sys; s=socket.create_connection("
                                  "(sys.argv[1], int(sys.argv[2])), timeout=5); print(s.recv(2).decode())",
                                  b.addr, str(port)], timeout=20)
            finally:
                server.kill()
                server.wait()
                server.stdout.close()
            if got.stdout.strip() != "ok":
                return f"nodes of a private network could not talk: {got.stderr.strip()[-300:]}"
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:
        return f"private node networks refused here: {exc}"
    return None


class Network:
    """A switch and the nodes linked to it; see the module's docstring."""

    def __init__(self, rate: str | None = "1gbit", delay_ms: float = 0.2, mtu: int = 1500):
        self.rate = rate
        self.delay_ms = float(delay_ms)
        self.mtu = mtu
        self.nodes: dict[str, NetNode] = {}
        self._next = 0  # addresses are never reused: a peer's ARP cache may still hold an old one
        self._lock = threading.Lock()
        self.delay_shaped = self.delay_ms == 0
        self.shaping = "no delay asked" if self.delay_ms == 0 else "netem not probed yet"
        self._netem: bool | None = None
        self._switch = _Holder()
        try:
            _sh(self._switch, "ip link set lo up; ip link add br0 type bridge; ip link set br0 up", "switch set-up")
        except BaseException:
            self._switch.close()
            raise

    # -- shaping ------------------------------------------------------------
    def _qdisc(self, dev: str) -> str:
        """The tc commands that shape egress of ``dev`` (half the delay: one end of a link)."""
        cmds = []
        delay = f"{self.delay_ms / 2:.4f}ms"
        tbf = self._tbf(self.rate) if self.rate is not None else ""
        if self.delay_ms > 0 and self._netem:
            cmds.append(f"tc qdisc add dev {dev} root handle 1: netem delay {delay} limit 100000")
            if tbf:
                cmds.append(f"tc qdisc add dev {dev} parent 1:1 handle 10: {tbf}")
        elif tbf:
            cmds.append(f"tc qdisc add dev {dev} root handle 1: {tbf}")
        return "\n".join(cmds)

    def _tbf(self, rate: str) -> str:
        # the bucket holds at least 2 ms of the rate, and two 64 KiB GSO packets of a veth, so a
        # bulk TCP stream is not cut into a burst per timer tick; the queue, 20 ms
        burst = max(parse_rate(rate) // 500, 2 * 65536 + 2 * self.mtu)
        return f"tbf rate {rate} burst {burst} latency 20ms"

    def set_downlink(self, node: NetNode, rate: str) -> None:
        """The switch port's egress towards ``node`` (its downlink) at ``rate`` from now on; every
        other link, and ``node``'s uplink, as they are. Needs a network made with a rate."""
        if self.rate is None:
            raise ValueError("this network shapes no rate: make it with one to change a link's")
        where = "parent 1:1 handle 10:" if self.delay_shaped and self.delay_ms > 0 else "root handle 1:"
        _sh(self._switch, f"tc qdisc change dev {node.port} {where} {self._tbf(rate)}", f"downlink of {node.name}")

    def _probe_netem(self, holder: _Holder, dev: str) -> None:
        if self._netem is not None or self.delay_ms == 0:
            return
        proc = subprocess.run([*holder.enter(), "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"],
                              capture_output=True, text=True, timeout=30)
        self._netem = proc.returncode == 0
        if self._netem:
            subprocess.run([*holder.enter(), "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
            self.delay_shaped, self.shaping = True, f"tbf rate {self.rate}, netem delay {self.delay_ms / 2} ms per end"
        else:
            why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
            self.delay_shaped = False
            self.shaping = (f"rate only (tbf {self.rate}); no delay: this kernel refuses netem ({why})")

    # -- nodes ----------------------------------------------------------------
    def add_node(self, name: str) -> NetNode:
        """A new namespace linked to the switch, with the next free address."""
        with self._lock:
            k, self._next = self._next, self._next + 1
        if k >= 250 * 250:
            raise RuntimeError("this network ran out of addresses")
        addr, port = f"10.41.{k // 250}.{k % 250 + 1}", f"p{k}"
        holder = _Holder()
        try:
            self._switch.check()
            _sh(self._switch, f"ip link add {port} mtu {self.mtu} type veth peer name eth0 netns {holder.proc.pid}\n"
                              f"ip link set {port} master br0\nip link set {port} up", f"link of {name}")
            self._probe_netem(holder, "lo")
            _sh(holder, f"ip link set lo up\nip addr add {addr}/16 dev eth0\nip link set eth0 up\n"
                        f"{self._qdisc('eth0')}", f"network of {name}")
            shape = self._qdisc(port)
            if shape:
                _sh(self._switch, shape, f"switch port of {name}")
        except BaseException:
            holder.close()
            with contextlib.suppress(Exception):
                subprocess.run([*self._switch.enter(), "ip", "link", "del", port], capture_output=True, timeout=10)
            raise
        node = NetNode(name, addr, port, holder)
        self.nodes[name] = node
        return node

    def remove_node(self, node: NetNode) -> None:
        """End the node's namespace (once its last process is gone the kernel drops its link)."""
        if self.nodes.get(node.name) is node:
            del self.nodes[node.name]
        node._holder.close()
        with contextlib.suppress(Exception):  # at once rather than when the namespace's last process ends
            subprocess.run([*self._switch.enter(), "ip", "link", "del", node.port], capture_output=True, timeout=10)

    def enter(self, node: NetNode) -> list[str]:
        """The argv prefix that runs a command on ``node``'s network (``nsenter --net=...``)."""
        return node._holder.enter()

    def run(self, node: NetNode, argv: Sequence[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``node``'s network, output captured as text."""
        return subprocess.run([*self.enter(node), *map(str, argv)], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout, **kwargs)

    def hosts(self, extra: dict[str, str] | None = None) -> str:
        """An /etc/hosts for the nodes: localhost, and every node's name at its address."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{n.addr} {n.name}" for n in self.nodes.values()]
        lines += [f"{addr} {name}" for name, addr in (extra or {}).items()]
        return "\n".join(lines) + "\n"

    def forward(self, node: NetNode, port: int) -> Forwarder:
        """A host loopback port relayed to ``node.addr:port`` (see ``Forwarder``)."""
        return Forwarder(node, port)

    def close(self) -> None:
        for node in list(self.nodes.values()):
            node._holder.close()
        self.nodes.clear()
        self._switch.close()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a host-side door into a node --------------------------------------------------------------

_RELAY = r"""
import ctypes, os, socket, sys, threading
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", 0))
listener.listen(256)
# the listening socket stays in the host's namespace; what we connect from now on is the node's
fd = os.open(sys.argv[1], os.O_RDONLY)
if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, 0x40000000) != 0:
    sys.exit(f"setns: {os.strerror(ctypes.get_errno())}")
os.close(fd)
target = (sys.argv[2], int(sys.argv[3]))
print(listener.getsockname()[1], flush=True)

def pump(src, dst):
    try:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
        try:
            s.shutdown(how)
        except OSError:
            pass

def serve(client):
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    t.start()
    pump(client, upstream)
    t.join()
    client.close()
    upstream.close()

while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


class Forwarder:
    """127.0.0.1:``port`` on the host, relayed to ``node.addr:target_port`` inside the network.

    A child process binds its listening socket in the host's namespace, then joins the node's
    (setns) for its outgoing connections: the test process, which lives on the host and must not
    route to the private addresses, reaches a node's server at ``url``. Bytes relayed this way do
    not cross a shaped link.
    """

    def __init__(self, node: NetNode, target_port: int):
        self.target = (node.addr, target_port)
        self.proc = subprocess.Popen([sys.executable, "-c", _RELAY, node.netns, node.addr, str(target_port)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, preexec_fn=_pdeathsig)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            self.close()
            raise OSError(f"forwarder to {node.name} did not start: {line!r} {err.strip()[-500:]}")
        self.port = int(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
