"""The index decoded and checked once per node: the node's ranks share one mapped copy.

Every rank of a load reads the whole index to plan (DCP's ``read_metadata`` runs on each), so
with 8 ranks a node decoded and checked it 8 times and held 8 copies of its arrays (a 16k-rank
checkpoint's index is tens of millions of rows). Here the first rank of the node to take the
index's lock decodes and checks it, then writes the checked columns to a node-local file
(``format.column_store``, in ``/dev/shm`` where there is one); the others wait on the lock and
map that file: read-only views, one copy in the page cache for the whole node, no decode.

The file is named by the index's crc32c, size and save key (from the manifest, which each rank
still reads and checks itself), lives in a directory only this user can open, carries a crc32c
of its arrays and is checked as it is mapped; anything wrong and the rank decodes the index
itself. The last of the node's ``LOCAL_WORLD_SIZE`` ranks to map it removes it; a leftover (a
rank died first) is removed by the next build after an hour. Used only under a launcher that
sets ``LOCAL_WORLD_SIZE`` > 1 and for indexes of at least ``MIN_ROWS`` rows (below, decoding
is quicker than waiting on a peer)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from dcp_nvme.errors import ManifestError
from dcp_nvme.format import column_store
from dcp_nvme.format.columns import ChunkColumns
from dcp_nvme.format.manifest import fqn_keys
from dcp_nvme.host.files import create_no_follow, open_regular, read_regular
from dcp_nvme.host.job import local_world_size

log = logging.getLogger(__name__)

MIN_ROWS = 1 << 16
"""Indexes smaller than this are decoded by each rank (a few tens of milliseconds)."""

MAX_COUNT_BYTES = 32
"""A rank counter longer than this is not one of ours: it is not read."""

STALE_SECONDS = 3600.0
"""A shared index file this old is a leftover of a rank that died before mapping it."""

ENABLED = True
"""False turns the sharing off: each rank decodes the index itself (tests set it; sharing
already falls back to decoding by itself on any failure)."""


def cache_directory() -> str | None:
    """``/dev/shm/dcp_nvme-<uid>`` (else the temp directory's), made 0700 and checked to be ours;
    None when it cannot be (then nothing is shared)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(base, f"dcp_nvme-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        log.warning("dcp_nvme: %s is not a private directory of this user: the index is not shared", path)
        return None
    return path


def shared_columns(doc: dict[str, Any], rows: int, build: Callable[[], ChunkColumns]) -> ChunkColumns:
    """The checked columns of the index ``doc`` names: mapped from this node's shared file when
    another rank made it, else ``build()`` (decode and check) and shared. A ``build`` that raises
    shares nothing: every rank then raises the same error from its own decode."""
    local = local_world_size()
    if not ENABLED or local <= 1 or rows < MIN_ROWS:
        return build()
    directory = cache_directory()
    if directory is None:
        return build()
    source = {"index": doc["index"]["name"], "size": doc["index"]["size"], "crc32c": doc["index"]["crc32c"],
              "save_key": doc["save_key"]}
    stem = os.path.join(directory, f"index-{source['save_key']}-{source['crc32c']:08x}-{source['size']}")
    with _locked(stem + ".lock") as held:
        if not held:
            return build()
        columns = _map(stem + ".cols", source)
        if columns is None:
            columns = build()
            if column_store.storable(columns):
                _sweep(directory)
                _write(stem + ".cols", column_store.encode(columns, source))
                _count(stem, local, built=True)
            return columns
        _count(stem, local, built=False)
        columns.fqn_keys = fqn_keys(doc)  # a stored index holds no keys: the version says what they are
        return columns


@contextlib.contextmanager
def _locked(path: str) -> Iterator[bool]:
    """Holds the index's node-wide lock; yields False (nothing held) when the lock file cannot
    be made, e.g. on a full /dev/shm: the rank then decodes the index itself."""
    try:
        fd = create_no_follow(path, os.O_RDWR, 0o600)
    except OSError as exc:
        log.warning("dcp_nvme: cannot open the node's index lock %s (%s): decoding the index here", path, exc)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # drops the lock


def _map(path: str, source: dict[str, Any]) -> ChunkColumns | None:
    try:  # non-blocking and no link followed: opening a FIFO planted here would block the rank
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except (OSError, ManifestError) as exc:
        log.warning("dcp_nvme: cannot open the node's shared index %s (%s): decoding it here", path, exc)
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or not info.st_size:
            return None
        mapped = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return column_store.decode(memoryview(mapped), source, path)
    except ManifestError as exc:
        log.warning("dcp_nvme: the node's shared index is unusable (%s): decoding it here", exc)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None


def _write(path: str, pieces: list) -> None:
    """Written whole under a temporary name, then renamed: a reader never maps half a file."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        fd = create_no_follow(temporary, os.O_WRONLY, 0o600, fresh=True)
        try:
            for piece in pieces:
                view = memoryview(piece).cast("B")
                while view.nbytes:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except OSError as exc:  # e.g. /dev/shm full: the other ranks decode for themselves
        log.warning("dcp_nvme: cannot share the decoded index through %s (%s)", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _count(stem: str, local: int, built: bool) -> None:
    """One more of the node's ranks has the columns; the last removes the shared file (those
    that mapped it keep their mapping)."""
    counter = stem + ".count"
    seen = 0
    if not built:  # read bounded, never through a link or from a FIFO; anything odd counts as none
        with contextlib.suppress(OSError, ValueError):  # ManifestError is a ValueError
            seen = int(read_regular(counter, MAX_COUNT_BYTES) or 0)
    seen += 1
    if seen >= local:
        for suffix in (".cols", ".count"):
            with contextlib.suppress(OSError):
                os.unlink(stem + suffix)
        return
    with contextlib.suppress(OSError):
        fd = create_no_follow(counter, os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.write(fd, str(seen).encode())
        finally:
            os.close(fd)


def _sweep(directory: str) -> None:
    """Remove shared files older than ``STALE_SECONDS`` (their ranks died before mapping them)."""
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and now - entry.stat(follow_symlinks=False).st_mtime \
                        > STALE_SECONDS:
                    os.unlink(entry.path)
