"""Reading another node's checkpoint files, and copying a file from any source, verified.

``PeerSource`` asks one peer's server (``peers.server``) for ranges; ``MirrorSource`` does the
same with ranged reads of an fsspec URL; ``LocalSource`` of a directory on this node.
``fetch_file`` copies one file from a source into a directory: ``queue_depth`` requests of
``block_size`` bytes in flight, each on its own connection, each checked against the blocks
table before it is written (a damaged copy fails with ChecksumMismatchError naming it), under a
bandwidth cap, into a temp name that is fsynced and renamed only when all of it arrived.

Servers publish their address and token in the job's store (``host.job.job_store``, which
``save.node_commit`` uses too: torch's ``_get_default_store``, reached through ``compat``).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dcp_nvme.errors import ManifestError, PeerError
from dcp_nvme.format.pieces import plan_pieces, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import (
    create_no_follow,
    fsync_dir,
    open_regular,
    pwrite_all,
    read_regular,
    write_file_fresh,
)
from dcp_nvme.peers.server import MAX_READ, recv_exact, recv_frame, send_frame

CONNECT_TIMEOUT = 10.0
IO_TIMEOUT = 120.0
ADDR_ENV = "DCP_NVME_PEER_ADDR"
"""The address this node's peer server listens on and publishes (else found as below)."""


def server_address(environ: dict[str, str] | None = None) -> str:
    """``DCP_NVME_PEER_ADDR``, else the local address of the interface that reaches MASTER_ADDR
    (a UDP connect sends nothing: it only asks the kernel for the route)."""
    env = os.environ if environ is None else environ
    if env.get(ADDR_ENV):
        return env[ADDR_ENV].strip()
    master = env.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, int(env.get("MASTER_PORT", "29500") or 29500)))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


class Limiter:
    """A bandwidth cap shared by the threads of one copy: ``take(n)`` sleeps until n bytes may go."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.next = rate, time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self.next)
            self.next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


# --------------------------------------------------------------------------- sources


class PeerSource:
    """Files of one checkpoint directory on a peer: its own copy (``holder=""``) or its
    replica of node ``holder``. A connection per thread."""

    def __init__(self, info: dict[str, Any], directory: str, holder: str = "", node: str = "?") -> None:
        host, port, token = info.get("host"), info.get("port"), info.get("token")
        if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536 or not isinstance(token, str):
            raise PeerError(f"node {node} published a malformed peer address {info!r}")
        self.address, self.token, self.directory, self.holder, self.node = (host, port), token, directory, holder, node
        self._local = threading.local()
        self._open: list[socket.socket] = []
        self._open_lock = threading.Lock()
        self.kind = "peer"

    def describe(self, name: str = "") -> str:
        where = f"{self.directory}/.replicas/{self.holder}" if self.holder else self.directory
        return f"node {self.node} ({self.address[0]}:{self.address[1]}) {where}/{name}".rstrip("/")

    def _conn(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            try:
                sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT)
            except OSError as exc:
                raise PeerError(f"cannot reach {self.describe()}: {exc}") from exc
            sock.settimeout(IO_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = sock
            with self._open_lock:
                self._open.append(sock)
        return sock

    def _ask(self, head: dict[str, Any]) -> tuple[socket.socket, dict[str, Any]]:
        sock = self._conn()
        try:
            send_frame(sock, {"token": self.token, "dir": self.directory, "holder": self.holder, **head})
            answer = recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            self._drop()
            raise PeerError(f"{self.describe(head.get('name', ''))}: the peer went away: {exc}") from exc
        if not answer.get("ok"):
            error = str(answer.get("error", "refused"))[:500]
            if "FileNotFoundError" in error:
                raise FileNotFoundError(f"{self.describe(head.get('name', ''))}: {error}")
            raise PeerError(f"{self.describe(head.get('name', ''))}: {error}")
        return sock, answer

    def size(self, name: str) -> int:
        _, answer = self._ask({"op": "stat", "name": name})
        if type(answer.get("size")) is not int or answer["size"] < 0:
            raise PeerError(f"{self.describe(name)}: a malformed size {answer.get('size')!r}")
        return answer["size"]

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        out = bytearray(length)
        view, done = memoryview(out), 0
        while done < length:  # ranges larger than one request are asked in parts
            part = min(MAX_READ, length - done)
            sock, answer = self._ask({"op": "read", "name": name, "offset": offset + done, "length": part})
            if answer.get("length") != part:
                self._drop()
                raise PeerError(f"{self.describe(name)}: answered {answer.get('length')!r} bytes for {part}")
            try:
                recv_exact(sock, part, view[done:done + part])
            except (OSError, ConnectionError) as exc:
                self._drop()
                raise PeerError(f"{self.describe(name)}: the peer went away mid-read: {exc}") from exc
            done += part
        return bytes(out)

    def read(self, name: str, max_size: int) -> bytes:
        size = self.size(name)
        if size > max_size:
            raise ManifestError(f"{self.describe(name)} is {size} bytes, more than the {max_size} a file "
                                "of its kind may have")
        return self.read_range(name, 0, size)

    def _drop(self) -> None:
        """This thread's connection, after an error: the next request opens a fresh one."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None

    def close(self) -> None:
        """Every connection this source opened, on any thread."""
        with self._open_lock:
            socks, self._open = self._open, []
        for sock in socks:
            sock.close()
        self._local = threading.local()


class LocalSource:
    """Files of a directory on this node (its own copy, or a replica it holds)."""

    kind = "local"

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def describe(self, name: str = "") -> str:
        return os.path.join(self.directory, name) if name else self.directory

    def size(self, name: str) -> int:
        fd = open_regular(os.path.join(self.directory, name))
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        fd = open_regular(os.path.join(self.directory, name))
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise ManifestError(f"{self.describe(name)} is shorter than its manifest says")
        return data

    def read(self, name: str, max_size: int) -> bytes:
        return read_regular(os.path.join(self.directory, name), max_size)

    def close(self) -> None:
        pass


class MirrorSource:
    """Files of a checkpoint's mirror (any fsspec URL), by ranged reads."""

    kind = "mirror"

    def __init__(self, store: Any) -> None:
        self.store = store  # storage.fsspec_dir.FsspecStore or LocalStore

    def describe(self, name: str = "") -> str:
        where = getattr(self.store, "url", None) or getattr(self.store, "root", "?")
        return f"{where}/{name}" if name else str(where)

    def size(self, name: str) -> int:
        return self.store.size(name)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if hasattr(self.store, "read_range"):
            data = self.store.read_range(name, offset, offset + length)
        else:
            data = LocalSource(self.store.root).read_range(name, offset, length)
        if len(data) != length:
            raise ManifestError(f"{self.describe(name)} is shorter than its manifest says")
        return data

    def read(self, name: str, max_size: int) -> bytes:
        return self.store.read(name, max_size)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- one verified copy


def fetch_file(source: Any, record: FileRecord, directory: str, *, queue_depth: int = 8,
               block_size: int = 8 << 20, limiter: Limiter | None = None,
               cancelled: Callable[[], bool] | None = None) -> int:
    """Copy ``record`` from ``source`` into ``directory`` under its own name, verified against
    the blocks table piece by piece; returns the bytes copied. Only a complete, fsynced file is
    renamed into place: a failure (a damaged copy, a peer gone) leaves nothing under the name."""
    size = source.size(record.name)
    if size != record.size:
        raise ManifestError(f"{source.describe(record.name)} has {size} bytes, the manifest says {record.size}")
    pieces = plan_pieces(record.size, record.data_start, record.checksum_block, block_size)
    temp = os.path.join(directory, f".{record.name}.fetch-{secrets.token_hex(4)}")
    fd = create_no_follow(temp, os.O_WRONLY, fresh=True)
    done = False
    try:
        def one(piece) -> None:
            if cancelled is not None and cancelled():
                raise PeerError(f"the copy of {record.name} was cancelled")
            if limiter is not None:
                limiter.take(piece.length)
            data = source.read_range(record.name, piece.offset, piece.length)
            verify_piece(record, piece.offset, data, source.describe(record.name))  # never write bad bytes
            pwrite_all(fd, data, piece.offset)

        if queue_depth <= 1 or len(pieces) == 1:
            for piece in pieces:
                one(piece)
        else:
            with ThreadPoolExecutor(max_workers=min(queue_depth, len(pieces)),
                                    thread_name_prefix="dcp-nvme-fetch") as pool:
                for future in [pool.submit(one, p) for p in pieces]:
                    future.result()
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(temp, os.path.join(directory, record.name))
        fsync_dir(directory)
        done = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not done:
            try:
                os.unlink(temp)
            except OSError:
                pass
    return record.size


def write_small(directory: str, name: str, data: bytes) -> None:
    """A small file (table, manifest, marker) written whole: temp, fsync, rename, fsync dir."""
    temp = os.path.join(directory, f".{name}.fetch-{secrets.token_hex(4)}")
    write_file_fresh(temp, data)  # every byte written (a short write resumed), or the temp removed
    os.replace(temp, os.path.join(directory, name))
    fsync_dir(directory)


class MemoryStore:
    """Files held in memory with the read side of ``LocalStore``: a manifest and its tables
    fetched from elsewhere are validated by ``read_manifest`` before they touch the disk.
    ``size_of`` gives the size of a file held elsewhere (the data files, which bound how many
    rows the tables may claim)."""

    def __init__(self, files: dict[str, bytes], location: str,
                 size_of: Callable[[str], int] | None = None) -> None:
        self.files, self.location, self.size_of = files, location, size_of

    def exists(self) -> bool:
        return True

    def has(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return sorted(self.files)

    def size(self, name: str) -> int:
        if name in self.files:
            return len(self.files[name])
        if self.size_of is not None:
            return self.size_of(name)
        raise FileNotFoundError(f"{self.location}/{name}")

    def read(self, name: str, max_size: int | None = None) -> bytes:
        data = self.files.get(name)
        if data is None:
            raise FileNotFoundError(f"{self.location}/{name}")
        if max_size is not None and len(data) > max_size:
            raise ManifestError(f"{self.location}/{name} is {len(data)} bytes, more than {max_size}")
        return data

    def path(self, name: str) -> str:
        return f"{self.location}/{name}"


MAX_TABLE = 1 << 30
"""A table fetched from elsewhere is refused above this size before a byte is read."""


def fetch_metadata(source: Any, location: str) -> tuple[bytes, list[tuple[str, bytes]], Any]:
    """The manifest and both tables from ``source``, validated as a whole (``read_manifest``,
    ``read_files``) before anything is written: (manifest bytes, [(table name, bytes)], Manifest)."""
    import json

    from dcp_nvme.format.container import MANIFEST, check_name, check_save_key, tables_of
    from dcp_nvme.format.manifest import MAX_MANIFEST, read_files, read_manifest

    manifest_bytes = source.read(MANIFEST, MAX_MANIFEST)
    where = source.describe(MANIFEST)
    try:
        doc = json.loads(manifest_bytes)
        key = check_save_key(doc.get("save_key"), where)
        entries = tables_of(doc)
        names = [check_name(entry.get("name"), kind, key, where) for kind, entry in entries]
    except (ValueError, AttributeError, KeyError, TypeError) as exc:
        raise ManifestError(f"{where} is not a valid manifest: {exc}") from None
    files = {MANIFEST: manifest_bytes}
    for name in names:
        files[name] = source.read(name, MAX_TABLE)
    store = MemoryStore(files, location, size_of=source.size)
    manifest = read_manifest(store, source.describe())
    read_files(store, manifest, source.describe())
    return manifest_bytes, [(name, files[name]) for name in names], manifest


def write_metadata(directory: str, manifest_bytes: bytes, tables: list[tuple[str, bytes]]) -> None:
    """What ``fetch_metadata`` returned, written into ``directory``: the tables, then the
    manifest last (the manifest present means the tables it names are complete)."""
    from dcp_nvme.format.container import MANIFEST

    for name, data in tables:
        write_small(directory, name, data)
    write_small(directory, MANIFEST, manifest_bytes)
