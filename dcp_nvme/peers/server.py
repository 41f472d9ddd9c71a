"""A node's peer byte server: read-only ranged reads of its checkpoint files, over plain TCP.

Why not gloo: replication runs in the background while the training job's collectives run,
and a background stream on the job's process group would interleave with them; a peer that
dies would also poison that group for every rank. A socket per pull, owned by the pull, fails
alone, with a timeout. The server runs on a daemon thread of the node's first rank (the node
writer while saving, the node's first reader while restoring) and serves only:

* directories registered with ``register`` (checkpoint directories this process saved or loads);
* under them, the manifest, rank files and tables of any save (``format.container.is_served_name``),
  of the node's own copy (``holder=""``) or of a complete replica it holds
  (``holder=<node>``: ``.replicas/<node>/`` with its marker written, and only names it lists);
* regular files only (``open_regular``: no link, FIFO or device), ranges of at most
  ``MAX_READ`` bytes inside the file.

Every request carries the job's random token (published in the job's store next to the
address); a request without it is answered with nothing and the connection closed.

Frames: ``<u32 length><JSON>``; a ``read`` answer's JSON is followed by its ``length`` bytes.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
from typing import Any

from dcp_nvme.errors import ManifestError, PeerError
from dcp_nvme.format.container import MANIFEST, REPLICA_MARKER, REPLICAS_DIR, check_node_name, is_served_name
from dcp_nvme.host.files import open_regular, read_regular

log = logging.getLogger(__name__)

MAX_FRAME = 64 << 10
"""A request or answer head is a few hundred bytes of JSON; more is refused."""
MAX_READ = 64 << 20
"""The largest range one request may ask for."""
MAX_INFLIGHT = 16
"""Reads a server holds in memory at once, whatever the number of connections: at most
``MAX_INFLIGHT x MAX_READ`` bytes (16 x 8 MiB with the default block size)."""
MAX_MARKER = 1 << 20
IDLE_TIMEOUT = 600.0
"""Seconds a connection may sit idle before the server drops it."""


def send_frame(sock: socket.socket, head: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    data = json.dumps(head).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)
    if payload:
        sock.sendall(payload)


def recv_exact(sock: socket.socket, count: int, into: memoryview | None = None) -> memoryview:
    buffer = into if into is not None else memoryview(bytearray(count))
    got = 0
    while got < count:
        n = sock.recv_into(buffer[got:count])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {count} bytes")
        got += n
    return buffer[:count]


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = struct.unpack("<I", recv_exact(sock, 4))
    if length > MAX_FRAME:
        raise PeerError(f"a peer sent a {length}-byte frame head, more than the {MAX_FRAME} allowed")
    try:
        head = json.loads(bytes(recv_exact(sock, length)))
    except ValueError as exc:
        raise PeerError(f"a peer sent a frame that is not JSON: {exc}") from None
    if not isinstance(head, dict):
        raise PeerError("a peer sent a frame that is not a JSON object")
    return head


def replica_files(directory: str, holder: str) -> dict[str, int] | None:
    """The files of the complete replica of ``holder`` under ``directory`` (name -> size, from
    its marker), or None when there is no complete one."""
    try:
        doc = json.loads(read_regular(os.path.join(directory, REPLICAS_DIR, holder, REPLICA_MARKER), MAX_MARKER))
        files = doc["files"]
        if not isinstance(files, dict) or not all(is_served_name(n) and type(s) is int for n, s in files.items()):
            return None
        return files
    except (OSError, ValueError, KeyError, TypeError, ManifestError):
        return None


class PeerServer:
    """One per process: a listening socket and a thread per connection."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        self.token = token or secrets.token_hex(16)
        self._dirs: dict[str, str] = {}
        """The directory a request names -> the directory here that answers it."""
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self.requests = 0
        self._inflight = threading.BoundedSemaphore(MAX_INFLIGHT)
        threading.Thread(target=self._accept, name="dcp-nvme-peer-server", daemon=True).start()

    def register(self, directory: str, served_as: str | None = None) -> None:
        """Serve ``directory`` (under its own path, or as ``served_as``: a test's second "node")."""
        with self._lock:
            self._dirs[os.path.abspath(served_as or directory)] = os.path.abspath(directory)

    def info(self) -> dict[str, Any]:
        return {"host": self.address[0], "port": self.address[1], "token": self.token}

    def close(self) -> None:
        """Stop listening and drop every connection (a pull in flight sees its peer vanish)."""
        self._closed = True
        with self._lock:
            conns = list(self._conns)
        for sock in [self._sock, *conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.settimeout(IDLE_TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="dcp-nvme-peer-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed:
                try:
                    head = recv_frame(conn)
                except (ConnectionError, struct.error, OSError, PeerError):
                    return
                if not hmac.compare_digest(str(head.get("token", "")).encode(), self.token.encode()):
                    log.warning("dcp_nvme: peer server: a request without the job's token was refused")
                    return
                self.requests += 1
                try:
                    self._answer(conn, head)
                except (PeerError, ManifestError, OSError, ValueError) as exc:
                    send_frame(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def resolve(self, directory: Any, holder: Any, name: Any) -> str:
        """The local path a request names, checked: a registered directory, a valid holder, a
        name we serve (and, of a replica, one its marker lists). PeerError otherwise."""
        base = self._dirs.get(os.path.abspath(directory)) if isinstance(directory, str) and directory else None
        if base is None:
            raise PeerError(f"{directory!r} is not a checkpoint directory this node serves")
        if not is_served_name(name):
            raise PeerError(f"{name!r} is not a checkpoint file name this node serves")
        if holder:
            holder = check_node_name(holder, "peer request")
            listed = replica_files(base, holder)
            if listed is None or (name != MANIFEST and name not in listed):
                raise FileNotFoundError(f"no complete replica of node {holder} holds {name}")
            base = os.path.join(base, REPLICAS_DIR, holder)
        return os.path.join(base, name)

    def _answer(self, conn: socket.socket, head: dict[str, Any]) -> None:
        path = self.resolve(head.get("dir"), head.get("holder", ""), head.get("name"))
        op = head.get("op")
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            if op == "stat":
                send_frame(conn, {"ok": True, "size": size})
                return
            if op != "read":
                raise PeerError(f"unknown operation {op!r}")
            offset, length = head.get("offset"), head.get("length")
            if type(offset) is not int or type(length) is not int or offset < 0 or not 0 <= length <= MAX_READ:
                raise PeerError(f"a range of {length!r} bytes at {offset!r} is not one this node serves "
                                f"(at most {MAX_READ} bytes)")
            if offset + length > size:
                raise PeerError(f"{path}: bytes {offset}-{offset + length} lie past its end ({size} bytes)")
            with self._inflight:
                data = os.pread(fd, length, offset)
                if len(data) != length:
                    raise PeerError(f"{path} shrank while it was read")
                send_frame(conn, {"ok": True, "length": length}, data)
        finally:
            os.close(fd)


_server: PeerServer | None = None
_server_lock = threading.Lock()


def process_server(host: str) -> PeerServer:
    """This process's server (started on first use, bound to ``host``, kept for the process)."""
    global _server
    with _server_lock:
        if _server is None or _server._closed:
            _server = PeerServer(host)
        return _server
