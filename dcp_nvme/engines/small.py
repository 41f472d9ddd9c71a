"""Containers of one request: written and read without the O_DIRECT machinery.

A container no larger than one ``block_size`` is one request whatever the engine, so its
fixed costs are the whole cost: an O_DIRECT probe, a preallocation, a bounce copy, a cut back
to size, a pool of threads. ``write_small`` writes it with one buffered ``pwritev`` of the
header and the sources' own memory, on the calling thread, computing the block crc32c from that
same memory. Its fsync may be deferred (``defer=True``): the kernel is told to start the
writeback at once (``sync_file_range``) and the caller owes an fsync before anything names the
file; the writer's commit joins it to the tables' and the manifest's fsync round
(``storage.local_dir.write_commit_files``), one journal commit instead of two.

On load, a container no larger than ``block_size`` is read buffered
(``reads.read_buffered_if_small``): it was written moments ago or is read often (a small
state), so the page cache usually holds it, and O_DIRECT would fetch it from the device again."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence

import crc32c
import torch

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.base import FileWriteResult
from dcp_nvme.engines.host_io import block_crcs, libc_function, memory_at, pwritev_all, with_path
from dcp_nvme.engines.requests import IOStats
from dcp_nvme.format.container import save_key_of

_SYNC_FILE_RANGE_WRITE = 2


_sync_file_range = libc_function("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages now, without waiting for them: the
    fsync that follows later finds less to do. Best effort (a no-op where unsupported)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def fits_one_request(header: bytes, sources: Sequence[torch.Tensor], block_size: int) -> bool:
    """Whether a container is one request: no larger than ``block_size``, every source in host
    memory (device memory goes through its engine, which copies or reads it straight)."""
    return (len(header) + sum(int(s.numel()) for s in sources) <= block_size
            and all(s.device.type == "cpu" for s in sources))


def write_small(path: str, header: bytes, sources: Sequence[torch.Tensor], checksum_block: int,
                defer: bool = False, on_progress=None) -> FileWriteResult:
    """Write a container of one request (``fits_one_request``): the header and the sources
    back to back in one buffered ``pwritev`` from their own memory, the crc32c of every
    checksum block from that memory; then fsync, or with ``defer`` only start the writeback
    (the caller fsyncs before the commit). ``on_progress(n)`` is told once all ``n`` data bytes
    are written. A failure removes nothing: the caller does (as for the engines)."""
    stats = IOStats("write")
    started = time.perf_counter()
    data = [memory_at(s.data_ptr(), int(s.numel())) for s in sources if s.numel()]
    size = sum(len(v) for v in data)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            begun = stats.begin()
            pwritev_all(fd, [memoryview(header), *data], 0)
            stats.end(begun, size)
            if defer:
                start_writeback(fd)
            else:
                synced = time.perf_counter()
                os.fsync(fd)
                stats.fsync_seconds = time.perf_counter() - synced
        finally:
            os.close(fd)
    except OSError as exc:
        raise with_path(exc, path) from exc
    crcs = block_crcs(data, size, checksum_block)
    if on_progress is not None:
        on_progress(size)
    stats.seconds = time.perf_counter() - started
    return FileWriteResult(path, len(header) + size, len(header), checksum_block, crcs,
                           crc32c.crc32c(header), stats)


def write_container(engine, path: str, header: bytes, sources: Sequence[torch.Tensor], config: IOConfig,
                    defer: bool = False, on_progress=None) -> FileWriteResult:
    """A container written and fsynced: by ``write_small`` when it is one request, else by
    ``engine``. ``defer`` (one request only): its fsync is owed (``take_owed``)."""
    if fits_one_request(header, sources, config.block_size):
        result = write_small(path, header, sources, config.checksum_block, defer, on_progress)
        if defer:
            with _owed_lock:
                _owed.setdefault(os.path.dirname(os.path.abspath(path)), []).append(path)
        return result
    progress = {"on_progress": on_progress} if on_progress is not None and engine.name in ("posix", "uring") else {}
    return engine.write_file(path, header, sources, config.checksum_block, **progress)


_owed: dict[str, list[str]] = {}
"""Directory -> containers written with ``defer``, whose fsync the commit owes."""
_owed_lock = threading.Lock()


def take_owed(directory: str, save_key: str) -> list[str]:
    """The containers of save ``save_key`` in ``directory`` whose fsync is owed; the directory's
    other entries (of a save that never reached its commit) are forgotten."""
    with _owed_lock:
        paths = _owed.pop(os.path.abspath(directory), [])
    return [p for p in paths if save_key_of(os.path.basename(p)) == save_key]
