"""Simulated nodes for multi-node tests: each node's own disk at one common path, its own host name.

A real deployment mounts each node's NVMe at the same path (say ``/nvme``) on every node: a path
names a different disk on each node, and only the ranks of a node see what they wrote there.
Ranks spawned side by side on one machine see one shared directory, so they hide every bug of
the kind "the coordinator wrote it, so every rank can read it". Here each node is a process tree
in its own namespaces (``unshare``):

* mount: the node's directory (``Cluster.node_disk(i)``, visible from the host) is bind-mounted at
  ``Cluster.mount``, the same path string on every node; each node also gets its own ``/dev/shm``
  (node-local lock files live there) and its own ``TMPDIR``;
* UTS: its own host name ``node<i>``, which ``socket.gethostname()`` returns in its workers (the
  writer counts the ranks of a node by host name);
* PID: its own process ids, and one handle on the whole tree: when the namespace's first process
  dies the kernel kills every process in it, so a timed-out or "lost" node leaves nothing behind
  (torchrun starts its workers in sessions of their own, out of reach of a process-group kill).

* network (with ``network=``, as the ``cluster`` fixtures do): its own network namespace on a
  private network of shaped links (harness/dcp_nvme_harness/netns.py): ``eth0`` at ``Cluster.addr(i)``, no route
  out of the network, and an ``/etc/hosts`` that names every node of the network (``node<i>``,
  and e.g. the object store's node).

Every node runs ``torchrun --nnodes N --node-rank i --nproc-per-node R --master-addr A
--master-port P`` (torchrun's default, static rendezvous; by default through
``dcp_nvme_harness.launch``, torchrun's own parser and agent with workers forked from a launcher
that imported torch once, ``launcher="torchrun"`` for the stock one) and the workers join one gloo process
group: with a network, over the links (A is the first node's address, ``GLOO_SOCKET_IFNAME=eth0``);
without one, over the host's loopback (A is 127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``). A mount lives
only as long as its namespace, so nothing needs unmounting and the root directory is removable
after a run. Needs root (unshare and mount; a network also ip, tc and nsenter).

    cluster = Cluster(tmp_path / "cluster", nodes=2, ranks_per_node=2, network=True)  # 1 Gbit/s links
    results = cluster.run(SCRIPTS / "hello.py")      # raises NodeFailure (stderr tails) on failure
    records = all_records(results)                   # the workers' `RESULT {json}` lines
    cluster.on_node(1, ["ls", str(cluster.mount)])   # a plain command on node 1
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dcp_nvme_harness.launch import PRELOAD
from dcp_nvme_harness.netns import NetNode, Network
from dcp_nvme_harness.ports import reserve_port
from dcp_nvme_harness.warm import WarmProcess, WarmPython

REPO = Path(__file__).resolve().parents[2]  # the checkout (the harness is installed editable)
SCRIPTS = Path(__file__).resolve().parent / "multinode_scripts"
RECORD = "RESULT "
"""Workers report by printing ``RESULT {json}`` lines on stdout (see ``NodeResult.records``)."""

# inside the namespaces: name the host, mount the node's disk and a node-local /dev/shm, and the
# network's /etc/hosts when it has one ($4, may be empty), run argv
_NODE_SH = 'set -e; hostname "$1"; mount --bind "$2" "$3"; mount -t tmpfs -o mode=1777 tmpfs /dev/shm; ' \
           'if [ -n "$4" ]; then mount --bind "$4" /etc/hosts; fi; shift 4; exec "$@"'
_UNSHARE = ["unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc",
            "--propagation", "private"]
# launcher and rank variables that must not leak from the calling environment into the nodes
_DROP = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
         "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")
_TAIL = 4000
_EMPTY_SHM = ("import os, shutil\nfor name in os.listdir('/dev/shm'):\n    path = os.path.join('/dev/shm', name)\n"
              "    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)")


def _tail(text: str, limit: int = _TAIL) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} chars before ...]\n{text[-limit:]}"


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def free_port() -> int:
    return reserve_port()


@functools.lru_cache(maxsize=1)
def unshare_unavailable() -> str | None:
    """Why simulated nodes cannot run here (a skip reason), or None when they can.

    Checks root, the tools, and then really tries once: a namespace with its own host name,
    a bind mount and a private /dev/shm, none of which may show from the host.
    """
    if not sys.platform.startswith("linux"):
        return f"simulated nodes need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "simulated nodes need root (unshare --mount --uts --pid, mount --bind)"
    for tool in ("unshare", "mount", "hostname", "sh"):
        if shutil.which(tool) is None:
            return f"simulated nodes need `{tool}` on PATH"
    host = socket.gethostname()
    with tempfile.TemporaryDirectory(prefix="multinode-probe-") as tmp:
        disk, mount = Path(tmp, "disk"), Path(tmp, "mnt")
        disk.mkdir()
        mount.mkdir()
        (disk / "probe").write_text("x")
        check = f'{_NODE_SH.split("shift")[0]} test -f "$3/probe"; test "$(hostname)" = mn-probe; ' \
                'test "$$" = 1'
        try:
            proc = subprocess.run([*_UNSHARE, "sh", "-c", check, "probe", "mn-probe", str(disk), str(mount)],
                                  capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unshare failed: {exc}"
        if proc.returncode != 0:
            return f"unshare refused (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        if socket.gethostname() != host or (mount / "probe").exists():
            return "unshare's namespaces leaked into the host (host name or mount changed)"
    return None


@dataclass
class NodeResult:
    """How one node's launcher (torchrun, or the command of ``on_node``) ended."""

    node: int
    """The cluster node: its disk (``Cluster.node_disk``) and host name (``node<i>``)."""
    node_rank: int
    """Its ``--node-rank`` (``GROUP_RANK``) in this run."""
    returncode: int | None
    """The launcher's exit status (negative: the signal that ended it); None when it never ended."""
    stdout: str
    stderr: str
    killed: str | None = None
    """Why the harness killed the node (timeout, another node's failure, ``kill_node``), if it did."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None

    def records(self) -> list[dict]:
        """The ``RESULT {json}`` records its workers printed, in order.

        A worker should write each record with one ``os.write`` (see ``multinode_scripts``): the
        ranks of a node share its stdout, and ``print`` may write a line in pieces.
        """
        decoder, out = json.JSONDecoder(), []
        for line in self.stdout.splitlines():
            at = line.find(RECORD)
            while at >= 0:  # a record glued to another one still decodes
                record, end = decoder.raw_decode(line, at + len(RECORD))
                out.append(record)
                at = line.find(RECORD, end)
        return out

    def describe(self, tail: int = _TAIL) -> str:
        state = f"exit {self.returncode}" + (f", killed: {self.killed}" if self.killed else "")
        head = f"node{self.node} (node rank {self.node_rank}): {state}"
        if self.ok:
            return head
        return (f"{head}\n--- node{self.node} stdout (tail) ---\n{_tail(self.stdout.strip(), tail // 2)}"
                f"\n--- node{self.node} stderr (tail) ---\n{_tail(self.stderr.strip(), tail)}")


class NodeFailure(AssertionError):
    """A node failed or timed out; the message holds every node's status and failed nodes' output."""

    def __init__(self, what: str, results: Sequence[NodeResult]):
        self.results = list(results)
        super().__init__(f"{what}\n" + "\n".join(r.describe() for r in results))


def all_records(results: Sequence[NodeResult]) -> list[dict]:
    """Every worker's ``RESULT`` records, sorted by their ``rank`` key where they have one."""
    records = [rec for r in results for rec in r.records()]
    return sorted(records, key=lambda rec: rec.get("rank", -1))


def describe(results: Sequence[NodeResult]) -> str:
    """Every node's status, with the output of failed ones: for assertion messages."""
    return "\n".join(r.describe() for r in results)


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, depth below ``pid``) of the live descendants of ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [(pid, 0)]
    while todo:
        parent, depth = todo.pop()
        for child in children.get(parent, []):
            out.append((child, depth + 1))
            todo.append((child, depth + 1))
    return out


@dataclass
class _Launched:
    node: int
    node_rank: int
    proc: subprocess.Popen | WarmProcess
    out: Path
    err: Path
    killed: str | None = None
    power_off: Callable[[], None] | None = None
    """Ends every process of the node (its namespaces) when the launch is not their first process."""


@dataclass
class ClusterRun:
    """Nodes started by ``Cluster.start``: wait for them, or kill one (a lost node) first."""

    launched: list[_Launched]
    port: int
    done: bool = False

    def _find(self, node: int) -> _Launched:
        for launched in self.launched:
            if launched.node == node:
                return launched
        raise KeyError(f"node{node} is not part of this run (nodes {[x.node for x in self.launched]})")

    def kill_node(self, node: int, why: str = "kill_node") -> None:
        """SIGKILL every process of ``node`` at once, as if it lost power."""
        self._kill(self._find(node), why, dump=False)

    def wait_until(self, condition: Callable[[], bool], timeout: float = 60, poll: float = 0.05) -> None:
        """Wait for ``condition()`` (e.g. a file on a node's disk); NodeFailure if a node ends first."""
        deadline = time.monotonic() + timeout
        while not condition():
            ended = [x for x in self.launched if x.proc.poll() is not None]
            if ended or time.monotonic() > deadline:
                what = f"node{ended[0].node} ended" if ended else f"not there after {timeout:.0f}s"
                self.kill_all("wait_until failed")
                raise NodeFailure(f"wait_until: {what} before the condition held", self.wait(10, check=False))
            time.sleep(poll)

    def _kill(self, launched: _Launched, why: str, dump: bool) -> None:
        self._kill_many([launched], why, dump)

    def _kill_many(self, targets: Sequence[_Launched], why: str, dump: bool) -> None:
        live = [x for x in targets if x.proc.poll() is None]
        fresh = [x for x in live if x.killed is None]
        for launched in live:
            launched.killed = launched.killed or why
        if dump and fresh:  # the workers print their Python stacks first (PYTHONFAULTHANDLER)
            for launched in fresh:
                if isinstance(launched.proc, WarmProcess):
                    launched.proc.send_signal(signal.SIGABRT)  # its session: the launcher and workers
                    continue
                for pid, depth in _descendants(launched.proc.pid):
                    if depth >= 2:  # unshare -> the namespace's init (torchrun) -> workers
                        with _quiet():
                            os.kill(pid, signal.SIGABRT)
            time.sleep(1.0)
        for launched in live:
            if launched.power_off is not None:
                launched.power_off()
            else:  # the group holds unshare and the namespace's init, whose death ends the rest
                with _quiet():
                    os.killpg(launched.proc.pid, signal.SIGKILL)

    def kill_all(self, why: str, dump: bool = False) -> None:
        self._kill_many(self.launched, why, dump)

    def wait(self, timeout: float = 120, grace: float = 20, check: bool = True) -> list[NodeResult]:
        """Wait for every node; kill all that still run after ``timeout`` seconds (their workers
        print their stacks first), and the rest ``grace`` seconds after a node failed (with a
        static rendezvous the others may wait for it for a long time).

        Returns the nodes' results in node-rank order; with ``check``, raises NodeFailure
        unless every node exited 0.
        """
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while any(x.proc.poll() is None for x in self.launched):
            now = time.monotonic()
            bad = [x for x in self.launched if x.proc.poll() not in (None, 0) or x.killed]
            if bad and failed_at is None:
                failed_at = now
            if now > deadline:
                self.kill_all(f"timed out after {timeout:.0f}s", dump=True)
            elif failed_at is not None and now > failed_at + grace:
                self.kill_all(f"still running {grace:.0f}s after node{bad[0].node} failed", dump=True)
            time.sleep(0.05)
        self.done = True
        results = [NodeResult(x.node, x.node_rank, x.proc.wait(), x.out.read_text(errors="replace"),
                              x.err.read_text(errors="replace"), x.killed) for x in self.launched]
        if check and not all(r.ok for r in results):
            raise NodeFailure(f"multi-node run (master port {self.port}) failed:", results)
        return results


class _quiet:
    """Ignore ProcessLookupError/PermissionError: the process is already gone."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError))


NODE_PRELOAD = (*PRELOAD, "dcp_nvme_harness.launch")
_zygote: WarmPython | None = None


def _base_env() -> dict[str, str]:
    """The environment of every node's processes: this one's, without launcher variables, this
    checkout first on the path, one OpenMP thread."""
    out = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith(("PET_", "TORCHELASTIC_"))}
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    out.update(PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    return out


def node_zygote() -> WarmPython:
    """The server every node's server is forked from (``node_server``), started on first use and
    ended at exit: it imports, once per test process, what each node's server imported in turn;
    its environment is what the nodes' share at import time (``Cluster.node_env``)."""
    global _zygote
    if _zygote is None:
        _zygote = WarmPython(NODE_PRELOAD, env=_base_env())
        atexit.register(_zygote.close)
    return _zygote


@dataclass
class Cluster:
    """``nodes`` simulated nodes of ``ranks_per_node`` ranks each, under the directory ``root``."""

    root: Path
    nodes: int = 2
    ranks_per_node: int = 2
    mount: Path | None = None
    """The path at which every node sees its own disk; ``root / "nvme"`` by default (an empty
    directory from the host)."""
    network: Network | bool | None = None
    """None/False: the host's network (loopback). True: a private network of this cluster's own
    (``Network()``: 1 Gbit/s links), closed with it. A ``Network``: join that one (e.g. one that
    also holds an object store's node); the cluster adds its nodes and removes them at ``close``."""
    launcher: str = "fork"
    """How each node starts its ranks: ``"fork"`` or ``"torchrun"`` (a run's ``launcher=``
    overrides it). ``"torchrun"``: ``python -m torch.distributed.run`` as the first process of
    fresh namespaces, a fresh interpreter per worker. ``"fork"``: ``dcp_nvme_harness.launch``
    (torchrun's parser, agent and rendezvous, workers forked from the launcher), itself forked
    from the node's server (``warm.WarmPython`` in namespaces that live as long as the cluster,
    or until ``kill_node`` or a timeout ends them), which imported torch, DCP and dcp_nvme once:
    a launch pays no interpreter start and no import. What a launch leaves in its session ends
    with it; the node's ``/dev/shm`` lives on between launches, as a real node's does."""
    _servers: dict[int, WarmPython] = field(default_factory=dict, repr=False)
    _server_disks: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    _runs: list[ClusterRun] = field(default_factory=list, repr=False)
    _count: int = field(default=0, repr=False)
    _net: Network | None = field(default=None, repr=False)
    _owns_net: bool = field(default=False, repr=False)
    _netnodes: list[NetNode] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self.mount = Path(self.mount) if self.mount is not None else self.root / "nvme"
        self.mount.mkdir(parents=True, exist_ok=True)
        for i in range(self.nodes):
            self.node_disk(i).mkdir(parents=True, exist_ok=True)
            self._tmp(i).mkdir(parents=True, exist_ok=True)
        if self.network is True:
            self._net, self._owns_net = Network(), True
        elif isinstance(self.network, Network):
            self._net = self.network
        if self._net is not None:
            try:
                self._netnodes = [self._net.add_node(self.hostname(i)) for i in range(self.nodes)]
            except BaseException:
                self.close()
                raise

    @property
    def net(self) -> Network | None:
        """The private network the nodes are on, if any."""
        return self._net

    def addr(self, i: int) -> str:
        """Node ``i``'s address: on the private network, or 127.0.0.1 on the host's."""
        self._check_node(i)
        return self._netnodes[i].addr if self._netnodes else "127.0.0.1"

    def _hosts_file(self) -> str:
        """The nodes' /etc/hosts ("" without a network); rewritten in place, so running nodes
        see nodes that joined the network since (the file's inode is what they mounted)."""
        if self._net is None:
            return ""
        path = self.root / "hosts"
        text = self._net.hosts({self.hostname(i): n.addr for i, n in enumerate(self._netnodes)})
        if not path.exists() or path.read_text() != text:
            with open(path, "r+" if path.exists() else "w") as f:
                f.write(text)
                f.truncate()
        return str(path)

    def node_disk(self, i: int) -> Path:
        """The host's view of the directory that node ``i`` sees at ``mount``."""
        self._check_node(i)
        return self.root / f"node{i}" / "disk"

    def hostname(self, i: int) -> str:
        self._check_node(i)
        return f"node{i}"

    def _tmp(self, i: int) -> Path:
        return self.root / f"node{i}" / "tmp"

    def _check_node(self, i: int) -> None:
        if not 0 <= i < self.nodes:
            raise IndexError(f"node {i}: this cluster has nodes 0..{self.nodes - 1}")

    def node_env(self, i: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of node ``i``'s processes (before torchrun adds the rank variables)."""
        out = _base_env()
        out.update(GLOO_SOCKET_IFNAME="eth0" if self._net is not None else "lo", TMPDIR=str(self._tmp(i)),
                   MULTINODE_MOUNT=str(self.mount), MULTINODE_NODE=str(i), MULTINODE_ADDR=self.addr(i))
        out.update(env or {})
        return out

    def _wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        # nsenter joins the node's network namespace and execs unshare: the pid stays the same
        enter = self._net.enter(self._netnodes[i]) if self._net is not None else []
        return [*enter, *_UNSHARE, "sh", "-c", _NODE_SH, f"node{i}-sh", self.hostname(i), str(self.node_disk(i)),
                str(self.mount), self._hosts_file(), *map(str, argv)]

    def start(
        self,
        script: str | os.PathLike,
        *args: object,
        env: Mapping[str, str] | None = None,
        env_per_node: Mapping[int, Mapping[str, str]] | None = None,
        nodes: Sequence[int] | None = None,
        ranks_per_node: int | None = None,
        launcher: str | None = None,
    ) -> ClusterRun:
        """Launch torchrun on the nodes at once and return without waiting (see ``run``)."""
        nodes = list(range(self.nodes)) if nodes is None else list(nodes)
        if not nodes or len(set(nodes)) != len(nodes):
            raise ValueError(f"nodes={nodes}: expected distinct cluster node indices")
        ranks = ranks_per_node or self.ranks_per_node
        forked = (launcher or self.launcher) == "fork"
        if (launcher or self.launcher) not in ("fork", "torchrun"):
            raise ValueError(f"launcher={launcher or self.launcher!r}: expected 'fork' or 'torchrun'")
        command = ["-m", "dcp_nvme_harness.launch"] if forked else [sys.executable, "-m", "torch.distributed.run"]
        port = free_port()
        self._count += 1
        logs = self.root / "logs" / f"run{self._count}"
        logs.mkdir(parents=True)
        launched = []
        try:
            for node_rank, i in enumerate(nodes):
                argv = [*command, "--nnodes", str(len(nodes)), "--node-rank", str(node_rank),
                        "--nproc-per-node", str(ranks), "--master-addr", self.addr(nodes[0]), "--master-port", str(port),
                        "--max-restarts", "0", "--monitor-interval", "0.1", os.path.abspath(script), *map(str, args)]
                out, err = logs / f"node{i}.out", logs / f"node{i}.err"
                node_env = self.node_env(i, {**(env or {}), **(env_per_node or {}).get(i, {})})
                with open(out, "wb") as out_f, open(err, "wb") as err_f:
                    if forked:
                        proc: subprocess.Popen | WarmProcess = self._server(i).start(
                            argv, cwd=self._tmp(i), env=node_env, stdout=out_f.fileno(), stderr=err_f.fileno(),
                            end_session=True)
                    else:
                        proc = subprocess.Popen(self._wrap(i, argv), stdout=out_f, stderr=err_f,
                                                stdin=subprocess.DEVNULL, env=node_env, cwd=self._tmp(i),
                                                start_new_session=True)
                launched.append(_Launched(i, node_rank, proc, out, err,
                                          power_off=functools.partial(self._power_off, i) if forked else None))
        finally:
            run = ClusterRun(launched, port)
            self._runs.append(run)
            if len(launched) != len(nodes):
                run.kill_all("launch failed")
        return run

    def run(
        self,
        script: str | os.PathLike,
        *args: object,
        env: Mapping[str, str] | None = None,
        env_per_node: Mapping[int, Mapping[str, str]] | None = None,
        timeout: float = 120,
        nodes: Sequence[int] | None = None,
        ranks_per_node: int | None = None,
        check: bool = True,
        launcher: str | None = None,
    ) -> list[NodeResult]:
        """Run ``script *args`` under torchrun on every node (or on ``nodes``, in node-rank order:
        ``nodes=[0]`` is a world of one node on node 0's disk) and wait for all of them.

        ``env`` goes to every node, ``env_per_node[i]`` to node ``i`` on top (e.g. to make one
        node's ranks fail). Each run gets a fresh master port. With ``check`` (the default) a
        node that fails or times out raises NodeFailure, whose message holds every node's
        status and the tails of the failed nodes' stdout/stderr; else the results say it.
        """
        run = self.start(script, *args, env=env, env_per_node=env_per_node, nodes=nodes,
                         ranks_per_node=ranks_per_node, launcher=launcher)
        return run.wait(timeout=timeout, check=check)

    def _end_runs(self, why: str) -> None:
        """Kill whatever a started run left running (a test that failed before waiting)."""
        for run in self._runs:
            if not run.done:
                run.kill_all(why)
                run.wait(timeout=30, check=False)
        self._runs.clear()

    def reset(self) -> None:
        """As if new, keeping the nodes' servers: runs ended, every node's disk, temporary directory
        and ``/dev/shm`` emptied (a test fixture hands one cluster to the tests of a module)."""
        self._end_runs("cluster reset")
        for i in range(self.nodes):
            if self.node_disk(i).is_symlink():  # a test made it another node's
                self.node_disk(i).unlink()
                self.node_disk(i).mkdir()
            for folder in (self.node_disk(i), self._tmp(i)):
                for entry in list(folder.iterdir()):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
        for i, server in list(self._servers.items()):
            done = server.run(["-c", _EMPTY_SHM], timeout=60)
            if done.returncode != 0:  # a node that cannot be emptied starts afresh at its next launch
                self._power_off(i)

    def _server(self, i: int) -> WarmPython:
        """Node ``i``'s server: started in the node's namespaces at its first launch, and again
        when the directory its disk names is another one than it mounted (a test that made
        node 1's disk a link to node 0's: its namespaces see what they mounted)."""
        disk = os.stat(self.node_disk(i))
        if self._server_disks.get(i) != (disk.st_dev, disk.st_ino):
            self._power_off(i)
            self._server_disks[i] = (disk.st_dev, disk.st_ino)
        if i not in self._servers:
            # forked from the zygote into the node's namespaces; its socket in the host's temporary
            # directory, which the node sees too (a path under a test's tmp_path can pass the 108
            # bytes a socket's name may have)
            node = [self.hostname(i), str(self.node_disk(i)), str(self.mount), self._hosts_file(),
                    self._netnodes[i].netns if self._netnodes else ""]
            self._servers[i] = WarmPython(NODE_PRELOAD, env=self.node_env(i), via=node_zygote(),
                                          via_module="dcp_nvme_harness.node_server", via_args=node)
        return self._servers[i]

    def _power_off(self, i: int) -> None:
        """Every process of node ``i`` ends at once (its server's namespaces with it)."""
        server = self._servers.pop(i, None)
        if server is not None:
            server.close()

    def on_node(
        self,
        i: int,
        argv: Sequence[str | os.PathLike],
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run one plain command inside node ``i`` (its host name, its disk at ``mount``).

        Output is captured as text. On timeout the node's processes are killed and NodeFailure
        is raised; with ``check``, so is it for a non-zero exit. A Python command (``argv[0]`` is
        this interpreter) of a ``"fork"`` cluster is forked from the node's server.
        """
        argv = [str(a) for a in argv]
        if argv[0] == sys.executable and self.launcher == "fork":
            try:
                done = self._server(i).run(argv[1:], cwd=self._tmp(i), env=self.node_env(i, env), timeout=timeout)
            except subprocess.TimeoutExpired as exc:  # its session was killed
                raise NodeFailure(f"on_node({i}, {argv}) timed out after {timeout:.0f}s",
                                  [NodeResult(i, 0, None, _text(exc.stdout), _text(exc.stderr), "timeout")]) from None
            if check and done.returncode != 0:
                raise NodeFailure(f"on_node({i}, {argv}) failed",
                                  [NodeResult(i, 0, done.returncode, done.stdout, done.stderr)])
            return subprocess.CompletedProcess(argv, done.returncode, done.stdout, done.stderr)
        proc = subprocess.Popen(self._wrap(i, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, env=self.node_env(i, env), cwd=self._tmp(i),
                                start_new_session=True, errors="replace")
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with _quiet():
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise NodeFailure(f"on_node({i}, {argv}) timed out after {timeout:.0f}s",
                              [NodeResult(i, 0, proc.returncode, stdout, stderr, "timeout")]) from None
        if check and proc.returncode != 0:
            raise NodeFailure(f"on_node({i}, {argv}) failed", [NodeResult(i, 0, proc.returncode, stdout, stderr)])
        return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)

    def close(self) -> None:
        """Kill whatever a started run left running (a test that failed before waiting); take the
        nodes off the network (and end the network if the cluster made it)."""
        self._end_runs("cluster closed")
        for i in list(self._servers):
            self._power_off(i)
        if self._net is not None:
            for node in self._netnodes:
                self._net.remove_node(node)
            self._netnodes = []
            if self._owns_net:
                self._net.close()
            self._net = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
