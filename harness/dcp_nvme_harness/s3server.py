"""A real S3-compatible server on loopback for tests: moto's standalone server
in a subprocess, optionally fronted by a switchable fault-injecting proxy.

Typical use::

    srv = S3Server()            # picks free ports, nothing fixed
    srv.start()                 # spawns `python -m moto.server`, waits until it answers
    fs = srv.s3fs()             # s3fs.S3FileSystem talking to srv.endpoint_url
    ...
    with srv.proxy.fault("error", status=503):      # every request answers 503 SlowDown
        ...
    with srv.proxy.fault("drop", count=2):          # next 2 requests: connection closed, no answer
        ...
    srv.proxy.down(); srv.proxy.up()                # front door closed: ECONNREFUSED, moto state kept
    srv.stop(); srv.start()                         # real crash + restart on the same port: state LOST
    srv.stop(preserve=True); srv.start()            # restart keeping buckets/objects (snapshot+restore)
    srv.close()

State and restarts
------------------
moto keeps everything in memory, so a killed server comes back empty (no buckets,
no objects, no in-progress multipart uploads).  moto has a request *recorder*
(``MOTO_ENABLE_RECORDING`` / ``/moto-api/recorder/replay-recording``) but it
cannot restore multipart uploads: upload ids come from ``os.urandom`` and replayed
``UploadPart``/``CompleteMultipartUpload`` calls name the old id, so the replay fails
for exactly the objects a checkpoint drain writes.  It also stores every body
base64'd in a JSON-lines file.  Therefore:

* "server unreachable for a while, then back with its data" -> ``proxy.down()`` /
  ``proxy.up()`` (moto keeps running; clients get connection refused, and open
  keep-alive connections are cut).
* "server crashed and came back with the completed objects" ->
  ``stop(preserve=True)`` + ``start()``: completed objects are copied out before the
  kill and written back after the restart; in-progress multipart uploads are lost
  (stricter than real S3, which keeps them until aborted/expired).
* "server crashed and came back empty" -> ``stop()`` + ``start()``.

Every moto subprocess gets PR_SET_PDEATHSIG=SIGKILL (Linux), so it dies with the
*thread* that started it even if pytest is SIGKILLed; start servers from the main
thread (the fixtures do).  An atexit hook kills whatever is still running.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dcp_nvme_harness.ports import reserve_port

__all__ = ["S3Server", "FaultProxy", "Fault", "free_port", "DUMMY_KEY", "DUMMY_SECRET", "REGION"]

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"
# Not us-east-1 on purpose: s3fs.mkdir(bucket) sends CreateBucketConfiguration=
# {LocationConstraint: <client region>}, which S3 (and moto) reject for us-east-1.
REGION = "eu-west-1"

_LIVE: weakref.WeakSet[S3Server] = weakref.WeakSet()


def _kill_all_at_exit() -> None:
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.close()


atexit.register(_kill_all_at_exit)


def free_port(host: str = "127.0.0.1") -> int:
    """A port held for this process alone (see ports.reserve_port)."""
    return reserve_port(host)


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# --------------------------------------------------------------------------
# Fault-injecting proxy
# --------------------------------------------------------------------------

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
}

_S3_CODES = {
    400: "BadRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    409: "OperationAborted",
    429: "SlowDown",
    500: "InternalError",
    502: "BadGateway",
    503: "SlowDown",
    504: "GatewayTimeout",
}

MODES = ("error", "drop", "reset", "delay")


@dataclass
class Fault:
    """One fault rule.

    mode:
      ``error`` answer ``status`` with an S3 XML error body (``code`` defaults per status:
                503 -> SlowDown, 500 -> InternalError, ...); the request never reaches moto.
      ``drop``  read the whole request, then close the connection without answering
                (client sees "server disconnected"); the request never reaches moto.
      ``reset`` close the connection with a TCP RST before reading the request body
                (client sees a reset / broken pipe mid-upload).
      ``delay`` sleep ``delay`` seconds, then forward normally (for client timeouts).
    count:  apply to this many matching requests, then the rule expires (None: forever).
    after:  let this many matching requests through untouched before the rule starts.
    methods / path_regex / match: which requests the rule concerns (all by default).
            ``path`` is the raw request target, query string included, e.g.
            ``/bucket/key?partNumber=2&uploadId=...``.
    """

    mode: str = "error"
    status: int = 503
    code: str | None = None
    count: int | None = None
    after: int = 0
    delay: float = 0.0
    methods: tuple | None = None
    path_regex: str | None = None
    match: Callable[[str, str], bool] | None = None
    hits: int = field(default=0, init=False)
    _seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.methods is not None:
            self.methods = tuple(m.upper() for m in self.methods)
        self._rx = re.compile(self.path_regex) if self.path_regex else None

    def _concerns(self, method: str, path: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        if self._rx is not None and not self._rx.search(path):
            return False
        if self.match is not None and not self.match(method, path):
            return False
        return True

    @property
    def exhausted(self) -> bool:
        return self.count is not None and self.hits >= self.count


class _ProxyHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, proxy: FaultProxy):
        self.proxy = proxy
        self.active: set = set()
        self._active_lock = threading.Lock()
        super().__init__(addr, _ProxyHandler)

    def get_request(self):
        sock, addr = super().get_request()
        with self._active_lock:
            self.active.add(sock)
        return sock, addr

    def shutdown_request(self, request):
        with self._active_lock:
            self.active.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address):  # quiet: clients vanish all the time here
        pass

    def cut_all(self) -> None:
        with self._active_lock:
            socks = list(self.active)
            self.active.clear()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class _Abort(Exception):
    pass


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyHTTPServer

    def log_message(self, format, *args):  # noqa: A002
        pass

    # -- body -------------------------------------------------------------
    def _read_body(self) -> bytes:
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in te:
            out = bytearray()
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise _Abort()
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline(65537)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # -- fault actions ----------------------------------------------------
    def _rst(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            self.connection.close()

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _send(self, status: int, headers: list, body: bytes, head: bool, content_length=None) -> None:
        self.send_response_only(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _error(self, fault: Fault, head: bool) -> None:
        code = fault.code or _S3_CODES.get(fault.status, "InternalError")
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>injected by FaultProxy</Message>"
            f"<Resource>{self.path}</Resource><RequestId>FAULTPROXY</RequestId></Error>"
        ).encode()
        self._send(fault.status, [("Content-Type", "application/xml")], b"" if head else body, head)

    # -- main -------------------------------------------------------------
    def _handle(self) -> None:
        proxy = self.server.proxy
        method, path = self.command, self.path
        fault = proxy._pick(method, path)
        try:
            if fault is not None and fault.mode == "reset":
                proxy._log(method, path, "reset")
                self._rst()
                return
            body = self._read_body()
            if fault is not None and fault.mode == "drop":
                proxy._log(method, path, "drop")
                self._drop()
                return
            if fault is not None and fault.mode == "error":
                proxy._log(method, path, fault.status)
                self._error(fault, head=method == "HEAD")
                return
            if fault is not None and fault.mode == "delay":
                time.sleep(fault.delay)
            self._forward(method, path, body)
        except (_Abort, OSError, http.client.HTTPException):
            self._drop()

    def _forward(self, method: str, path: str, body: bytes) -> None:
        proxy = self.server.proxy
        up = http.client.HTTPConnection(
            proxy.upstream_host, proxy.upstream_port, timeout=proxy.upstream_timeout
        )
        try:
            try:
                up.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() in _HOP_BY_HOP or k.lower() == "content-length":
                        continue
                    up.putheader(k, v)
                if body or method in ("PUT", "POST"):
                    up.putheader("Content-Length", str(len(body)))
                up.endheaders(body if body else None)
                resp = up.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                # moto is gone (killed) or broke the connection: behave like a dead server
                proxy._log(method, path, "upstream-dead")
                self._drop()
                return
            headers = [
                (k, v)
                for k, v in resp.getheaders()
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"
            ]
            if method == "HEAD":
                self._send(
                    resp.status, headers, b"", head=True, content_length=resp.getheader("Content-Length", "0")
                )
            else:
                self._send(resp.status, headers, data, head=False)
            proxy._log(method, path, resp.status)
        finally:
            up.close()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = do_PATCH = do_OPTIONS = _handle


class FaultProxy:
    """Threaded HTTP/1.1 forwarding proxy (stdlib only) on loopback, in front of moto.

    Requests are buffered whole in memory and forwarded on a fresh upstream connection.
    ``faults`` is an ordered list of :class:`Fault`; the first live rule that concerns a
    request decides its fate.  ``log`` records ``(method, path, outcome)`` per request.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        host: str = "127.0.0.1",
        port: int | None = None,
        upstream_timeout: float = 120.0,
    ):
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.upstream_timeout = upstream_timeout
        self.host = host
        self.port = port or 0
        self.faults: list[Fault] = []
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._server: _ProxyHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._server is not None

    def up(self) -> None:
        """Start listening (on the same port as before, if it had one)."""
        if self._server is not None:
            return
        deadline = time.monotonic() + 10
        while True:
            try:
                self._server = _ProxyHTTPServer((self.host, self.port), self)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"FaultProxy:{self.port}",
            daemon=True,
        )
        self._thread.start()

    def down(self) -> None:
        """Stop listening and cut every open client connection (clients then get
        connection refused / reset).  The upstream (moto) is untouched."""
        srv, self._server = self._server, None
        if srv is None:
            return
        srv.shutdown()
        srv.server_close()
        srv.cut_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- faults -----------------------------------------------------------
    def add_fault(self, mode: str = "error", **kw) -> Fault:
        f = Fault(mode=mode, **kw)
        with self._lock:
            self.faults.append(f)
        return f

    def remove_fault(self, f: Fault) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self.faults.remove(f)

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    @contextlib.contextmanager
    def fault(self, mode: str = "error", **kw) -> Iterator[Fault]:
        f = self.add_fault(mode, **kw)
        try:
            yield f
        finally:
            self.remove_fault(f)

    def _pick(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in list(self.faults):
                if f.exhausted:
                    continue
                if not f._concerns(method, path):
                    continue
                f._seen += 1
                if f._seen <= f.after:
                    continue
                f.hits += 1
                return f
        return None

    def _log(self, method: str, path: str, outcome) -> None:
        self.log.append((method, path, outcome))


# --------------------------------------------------------------------------
# moto server
# --------------------------------------------------------------------------


class S3Server:
    """moto standalone server (subprocess) on 127.0.0.1, optionally behind a FaultProxy.

    ``endpoint_url`` is the proxy's URL when ``proxy=True`` (default), else moto's.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        proxy: bool = True,
        startup_timeout: float = 30.0,
        env: dict | None = None,
        log_dir: str | None = None,
    ):
        self.host = host
        self.port = port  # moto's port; None -> pick a free one at first start, then keep it
        self._fixed_port = port is not None
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        self._log_dir = log_dir or tempfile.mkdtemp(prefix="moto-s3-")
        self.log_path = os.path.join(self._log_dir, "moto.log")
        self.proc: subprocess.Popen | None = None
        self._log_fh = None
        self._snapshot: dict | None = None
        self.proxy: FaultProxy | None = None
        self._want_proxy = proxy
        self.starts = 0
        _LIVE.add(self)

    # -- urls / client config ---------------------------------------------
    @property
    def moto_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def endpoint_url(self) -> str:
        return self.proxy.url if self.proxy is not None else self.moto_url

    def storage_options(self, *, retries: int | None = None, direct: bool = False, **overrides) -> dict:
        """kwargs for ``s3fs.S3FileSystem`` / fsspec ``storage_options``.

        ``retries=N`` sets botocore's ``max_attempts=N`` (standard mode) and short
        timeouts so error tests stay fast; None keeps defaults (botocore legacy mode:
        5 attempts, times s3fs's own 5 -> slow against a failing server).
        ``direct=True`` talks to moto, bypassing the fault proxy.
        """
        url = self.moto_url if direct else self.endpoint_url
        opts: dict = {
            "key": DUMMY_KEY,
            "secret": DUMMY_SECRET,
            "endpoint_url": url,
            "client_kwargs": {"region_name": REGION},
            "skip_instance_cache": True,
        }
        if retries is not None:
            # NB: s3fs's own retry count is the *class attribute* S3FileSystem.retries (5);
            # it is not a constructor kwarg (passing retries= reaches AioSession and fails).
            # s3fs() below sets it on the instance; for fsspec-created instances set
            # ``fs.retries`` afterwards.  Only botocore's part can travel in storage options.
            opts["config_kwargs"] = {
                "retries": {"max_attempts": retries, "mode": "standard"},
                "connect_timeout": 2,
                "read_timeout": 30,
            }
        opts.update(overrides)
        return opts

    def s3fs(self, *, retries: int | None = None, **kw):
        """A fresh (uncached) s3fs.S3FileSystem for this server; ``retries`` sets both
        botocore's attempts and s3fs's own retry loop."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options(retries=retries, **kw))
        if retries is not None:
            fs.retries = retries
        return fs

    def boto3_client(self, direct: bool = True):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.moto_url if direct else self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=DUMMY_KEY,
            aws_secret_access_key=DUMMY_SECRET,
            config=Config(retries={"max_attempts": 2, "mode": "standard"}),
        )

    # -- lifecycle --------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> S3Server:
        """Start moto (same port as before if it ran already) and wait until it answers.
        Restores a ``stop(preserve=True)`` snapshot if there is one."""
        if not self.is_running:
            if self.port is None:
                self.port = free_port(self.host)
            # a free_port() race can only be retried before the first start; after it the port is fixed
            retry_ports = not self._fixed_port and self.starts == 0
            for i in range(3 if retry_ports else 1):
                try:
                    self._spawn()
                    break
                except RuntimeError:
                    if not retry_ports or i == 2:
                        raise
                    self.port = free_port(self.host)
            self.starts += 1
        if self._want_proxy:
            if self.proxy is None:
                self.proxy = FaultProxy(self.host, self.port)
            self.proxy.up()
        if self._snapshot is not None:
            snap, self._snapshot = self._snapshot, None
            self._restore(snap)
        return self

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.update(
            {
                "AWS_ACCESS_KEY_ID": DUMMY_KEY,
                "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
                "AWS_DEFAULT_REGION": REGION,
                "MOTO_PORT": str(self.port),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.env)
        if self._log_fh is None:
            self._log_fh = open(self.log_path, "ab")
        self._log_fh.write(f"\n=== start {time.ctime()} port {self.port}\n".encode())
        self._log_fh.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
        )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(
                    f"moto server exited during startup on port {self.port}:\n{self.log_tail()}"
                )
            if self._answers():
                return
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(
                    f"moto server did not answer within {self.startup_timeout}s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            c = http.client.HTTPConnection(self.host, self.port, timeout=2)
            c.request("GET", "/", headers={"Host": f"{self.host}:{self.port}"})
            c.getresponse().read()  # any HTTP answer means it is serving
            c.close()
            return True
        except (OSError, http.client.HTTPException):
            return False

    def _kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            p.kill()  # SIGKILL: a crash, not a graceful shutdown
        with contextlib.suppress(Exception):
            p.wait(timeout=10)

    def stop(self, *, preserve: bool = False, proxy_too: bool = True) -> None:
        """Kill moto (SIGKILL).  Its in-memory state is lost unless ``preserve=True``,
        which first snapshots every bucket and completed object (and restores them on
        the next ``start()``).  With ``proxy_too`` the proxy stops listening as well,
        so clients see connection refused rather than dropped connections."""
        if preserve and self.is_running:
            self._snapshot = self._take_snapshot()
        if proxy_too and self.proxy is not None:
            self.proxy.down()
        self._kill()

    def restart(self, *, preserve: bool = False) -> S3Server:
        self.stop(preserve=preserve)
        return self.start()

    def reset(self) -> None:
        """Wipe moto's state without a restart (POST /moto-api/reset)."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=10)
        c.request("POST", "/moto-api/reset", headers={"Host": f"{self.host}:{self.port}"})
        c.getresponse().read()
        c.close()

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.down()
        self._kill()
        if self._log_fh is not None:
            with contextlib.suppress(Exception):
                self._log_fh.close()
            self._log_fh = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode(errors="replace")
        return ""

    # -- snapshot / restore (completed objects only) ------------------------
    def _take_snapshot(self) -> dict:
        cli = self.boto3_client(direct=True)
        snap: dict = {}
        for b in cli.list_buckets().get("Buckets", []):
            name = b["Name"]
            objs = {}
            for page in cli.get_paginator("list_objects_v2").paginate(Bucket=name):
                for o in page.get("Contents", []):
                    objs[o["Key"]] = cli.get_object(Bucket=name, Key=o["Key"])["Body"].read()
            snap[name] = objs
        return snap

    def _restore(self, snap: dict) -> None:
        cli = self.boto3_client(direct=True)
        for name, objs in snap.items():
            cli.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})
            for key, data in objs.items():
                cli.put_object(Bucket=name, Key=key, Body=data)
