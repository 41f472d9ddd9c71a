"""Copying a file, or a checkpoint's metadata, from a source, verified against the blocks table.

The sources are on this node or reached by their own client, never by a network server of
ours: ``LocalSource`` reads a directory here (this node's copy, or a replica it holds under
``.replicas/<node>/``); ``MirrorSource`` does ranged reads of the checkpoint's mirror (any
fsspec URL). ``fetch_file`` copies one file from a source into a directory: ``queue_depth``
reads of ``block_size`` bytes in flight, each checked against the blocks table before it is
written (a damaged copy fails with ChecksumMismatchError naming it), under a bandwidth cap
(``Limiter``), into a temp name that is fsynced and renamed only when all of it arrived.
``fetch_metadata`` reads a manifest and its tables from a source and validates them as a whole
(``MemoryStore``) before ``write_metadata`` writes them, manifest last. ``replica_files`` names
the files of a complete replica held here.

Bytes between nodes move over gloo groups instead (``peers.exchange``, ``peers.replicate``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dcp_nvme import seams
from dcp_nvme.errors import ManifestError, PeerError
from dcp_nvme.format.container import REPLICA_MARKER, REPLICAS_DIR, is_served_name, save_key_of
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

MAX_MARKER = 1 << 20
"""A replica's marker is refused above this size before a byte is read."""

log = logging.getLogger(__name__)


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

    def __init__(self, store: Any, storage_options: dict[str, Any] | None = None) -> None:
        self.store = store  # storage.fsspec_dir.FsspecStore or LocalStore
        self.storage_options = storage_options
        """What opened it: a step restored from it journals them (without credentials)."""

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

    def read_into(self, name: str, offset: int, into: memoryview) -> None:
        """``len(into)`` bytes at ``offset``, read straight into ``into`` (no copy of them on the way)."""
        if self.store.read_into(name, offset, into) != len(into):
            raise ManifestError(f"{self.describe(name)} is shorter than its manifest says")

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
    renamed into place: a failure (a damaged copy, a source gone) leaves nothing under the name."""
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


class OtherCheckpointError(ManifestError):
    """Metadata another copy holds is another checkpoint's (another save, another step)."""


def data_keys(directory: str) -> set[str]:
    """The saves whose data files ``directory`` holds (by their names)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {key for name in names if name.startswith("rank_") and (key := save_key_of(name))}


def check_this_checkpoint(manifest: Any, path: str, keys_here: set[str], where: str) -> None:
    """Metadata from another copy is this checkpoint's: the save whose data files this node
    holds (when it holds any), saved under this directory's name. A stale replica left from
    before an overwrite, or a mirror of another step, is refused naming both."""
    if keys_here and manifest.save_key not in keys_here:
        raise OtherCheckpointError(
            f"{where} describes save {manifest.save_key}, but {path} holds data files of save "
            f"{', '.join(sorted(keys_here))}: it is another save's metadata and is not used")
    saved_as = (manifest.doc.get("storage_meta") or {}).get("checkpoint_id")
    if isinstance(saved_as, str) and saved_as and _last_name(saved_as) != _last_name(path):
        raise OtherCheckpointError(
            f"{where} was saved as {saved_as}, not as {_last_name(path)}: it is another checkpoint's "
            f"metadata and is not used (if this directory was renamed after its save, load that copy "
            f"itself, NVMeReader(<its location>))")


def _last_name(location: str) -> str:
    return location.rstrip("/").rsplit("/", 1)[-1]


def journal_restored(directory: str, source: Any, save_key: str) -> None:
    """The metadata of ``directory`` came from ``source``: when that is the mirror, the step is
    journaled as mirrored there (the ``mirror_restored`` seam); never fatal to the load."""
    if not isinstance(source, MirrorSource) or not seams.mirror_restored.plugged:
        return
    try:
        seams.mirror_restored(directory, source.describe(), save_key, source.storage_options)
    except OSError as exc:
        log.warning("dcp_nvme: %s: restored from the mirror %s, but its drain journal could not be "
                    "written (%s): it shows as local", directory, source.describe(), exc)


def write_metadata(directory: str, manifest_bytes: bytes, tables: list[tuple[str, bytes]]) -> None:
    """What ``fetch_metadata`` returned, written into ``directory``: the tables, then the
    manifest last (the manifest present means the tables it names are complete)."""
    from dcp_nvme.format.container import MANIFEST

    for name, data in tables:
        write_small(directory, name, data)
    write_small(directory, MANIFEST, manifest_bytes)
