"""File-level POSIX I/O shared by every engine: open (O_DIRECT where taken), positional
writes of whole buffers, the header, preallocation, the final cut and fsync."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Sequence

import torch

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.requests import ReadRequest
from dcp_nvme.engines.stats import IOStats
from dcp_nvme.errors import DCPNVMeError
from dcp_nvme.host.files import open_regular, pwrite_all

log = logging.getLogger(__name__)


_O_DIRECT = getattr(os, "O_DIRECT", 0)


IOV_MAX = 1024


_warned_dirs: set[str] = set()


def _note_fallback(path: str, reason: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in _warned_dirs:
        _warned_dirs.add(directory)
        log.warning("O_DIRECT refused for %s (%s); using buffered I/O + fsync there", directory, reason)


def open_file(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    """Open with O_DIRECT when asked and allowed; return the fd and whether O_DIRECT is on."""
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _note_fallback(path, os.strerror(exc.errno))
    elif direct:
        _note_fallback(path, "this platform has no O_DIRECT")
    return os.open(path, flags, 0o644), False


def open_for_reading(path: str, config: IOConfig) -> tuple[int, bool]:
    """Open a container for reading in the configured read mode. Buffered reads tell the kernel
    the access is sequential (a larger readahead window), so our block_size preads find the next
    pages already on their way. Only a regular file is opened (``host.files.open_regular``), so a FIFO,
    device or link in a checkpoint directory is refused instead of hanging or leading out."""
    if config.reads_direct and _O_DIRECT:
        try:
            return open_regular(path, _O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _note_fallback(path, os.strerror(exc.errno))
    elif config.reads_direct:
        _note_fallback(path, "this platform has no O_DIRECT")
    fd = open_regular(path)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd, False


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """pwritev until every view is written, at most IOV_MAX views a call."""
    pending = [v for v in views if len(v)]
    while pending:
        written = os.pwritev(fd, pending[:IOV_MAX], offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
        offset += written
        _consume(pending, written)


def _consume(pending: list[memoryview], count: int) -> None:
    """Drop the first ``count`` bytes of ``pending`` (a vectored call's progress) in place."""
    while pending and count >= len(pending[0]):
        count -= len(pending[0])
        pending.pop(0)
    if count:
        pending[0] = pending[0][count:]


_local = threading.local()


def thread_stream(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def write_header(path: str, fd: int, direct: bool, view: memoryview) -> tuple[int, bool]:
    """Write a container's header (an aligned buffer) at offset 0. It is the first write, so it is
    also the probe that O_DIRECT writes work: where refused, reopen buffered and say why."""
    try:
        pwrite_all(fd, view, 0)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        _note_fallback(path, "write refused: " + os.strerror(exc.errno))
        os.close(fd)
        fd, direct = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, False)
        pwrite_all(fd, view, 0)
    return fd, direct


_FALLOCATE_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _libc_fallocate():
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    function.restype = ctypes.c_int
    return function


_fallocate = _libc_fallocate()


def preallocate(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes of the new file before O_DIRECT writes fill it. Why: ext4 (and
    others) serialise O_DIRECT writes that extend a file under the inode's exclusive lock, held
    through the I/O when the write is synchronous, so depth-8 threaded pwrites past the end of
    the file run one at a time; into reserved blocks they run in parallel (figures:
    docs/benchmarks.md). Plain fallocate, not posix_fallocate, which writes zeros where the
    filesystem cannot reserve. Returns False where unsupported; a full disk raises ENOSPC here,
    before any data is written."""
    if _fallocate is None or size <= 0:
        return False
    if _fallocate(fd, 0, 0, size) == 0:
        return True
    code = ctypes.get_errno()
    if code in _FALLOCATE_UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code))


def finish_file(fd: int, size: int, stats: IOStats) -> None:
    """Cut the O_DIRECT tail padding back to the real size, then fsync (timed into ``stats``)."""
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)
    started = time.perf_counter()
    os.fsync(fd)
    stats.fsync_seconds = time.perf_counter() - started


def pread_into(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv until every view is full or the file ends; returns the bytes read."""
    total = 0
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:IOV_MAX]
        got = os.preadv(fd, batch, offset + total)
        if got == 0:
            break
        total += got
        _consume(pending, got)
    return total


def check_length(request: ReadRequest, end_read: int) -> None:
    needed = request.file_offset + request.length
    if end_read < needed:
        raise DCPNVMeError(
            f"{request.file} is truncated: needed bytes up to {needed}, the file ends at "
            f"{end_read}. The checkpoint is damaged; load an earlier one or restore this file."
        )


def clip_views(views: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
    """Bytes ``[start, start + length)`` of ``views`` taken back to back, as views."""
    out = []
    for view in views:
        if start >= len(view):
            start -= len(view)
            continue
        take = view[start : start + length]
        out.append(take)
        length -= len(take)
        start = 0
        if not length:
            break
    return out


def with_path(exc: OSError, path: str) -> OSError:
    """``exc`` naming ``path`` when it names no file yet."""
    if exc.filename:
        return exc
    return type(exc)(exc.errno, f"{exc.strerror} (while doing I/O on {path})", path)
