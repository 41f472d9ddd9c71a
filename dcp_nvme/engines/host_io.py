"""The host side of every engine's I/O: the files -- open (O_DIRECT where taken), positional
writes of whole buffers, the header, preallocation, the final cut and fsync -- and the memory --
aligned buffers and the reused bounce buffers (``BouncePool``), tensor bytes and host addresses,
copies between them (``copy_bytes``), crc32c per checksum block, and what O_DIRECT needs on one
file (``dio_alignment``: memory and offset/length alignment).

Linux >= 6.1 reports both alignments through ``statx(STATX_DIOALIGN)`` (``stx_dio_mem_align``,
``stx_dio_offset_align``; 0 when the file does not support direct I/O). Elsewhere the device's
logical block size (``/sys/dev/block/MAJ:MIN/queue/logical_block_size``) is the usual rule for
both; when even that cannot be read, the page size (4096), which every device accepts.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c
import torch

from dcp_nvme.config import ALIGN, IOConfig
from dcp_nvme.engines.requests import IOStats, ReadRequest
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


def libc_function(name: str, *argtypes: type) -> Callable[..., int] | None:
    """libc's ``name`` (returning an int, errno kept), or None where this libc has none."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_fallocate = libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


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


# The engines' memory.

_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256
_MASK_AT, _DIO_AT = 0, 0x98  # offsets of stx_mask and stx_dio_mem_align in struct statx


@dataclass(frozen=True)
class DioAlignment:
    memory: int
    """Buffers handed to O_DIRECT reads and writes start on a multiple of this."""
    offset: int
    """File offsets and lengths of O_DIRECT requests are multiples of this."""
    source: str
    """Where the figures came from: ``statx``, ``logical_block_size`` or ``default``."""

    @property
    def span(self) -> int:
        """What a span of host memory moved straight to or from the file must start and end on:
        its address and its file offset alike (the larger of the two alignments)."""
        return max(self.memory, self.offset)


DEFAULT_DIO = DioAlignment(ALIGN, ALIGN, "default")


def _statx(fd: int) -> tuple[int, int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buffer) != 0:
        return None
    (mask,) = struct.unpack_from("<I", buffer, _MASK_AT)
    if not mask & _STATX_DIOALIGN:
        return None  # kernel before 6.1, or a filesystem that does not say
    memory, offset = struct.unpack_from("<II", buffer, _DIO_AT)
    return memory, offset


def _logical_block_size(fd: int) -> int | None:
    device = os.fstat(fd).st_dev
    base = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for candidate in (f"{base}/queue/logical_block_size", f"{base}/../queue/logical_block_size"):
        try:
            with open(candidate) as handle:
                size = int(handle.read().strip())
        except (OSError, ValueError):
            continue
        if 0 < size <= ALIGN and size & (size - 1) == 0:  # a power of two up to a page: sane
            return size
    return None


def dio_alignment(fd: int) -> DioAlignment:
    """The O_DIRECT alignment for the open file ``fd`` (never larger than a page)."""
    reported = _statx(fd)
    if reported is not None and all(0 < n <= ALIGN and n & (n - 1) == 0 for n in reported):
        return DioAlignment(reported[0], reported[1], "statx")
    size = _logical_block_size(fd)
    if size is not None:
        return DioAlignment(size, size, "logical_block_size")
    return DEFAULT_DIO


def cuda_available() -> bool:
    """Asked at run time, never at import time."""
    return torch.cuda.is_available()


def aligned_buffer(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A flat uint8 CPU tensor whose data starts on a page boundary, touched once.

    ``pin=None`` pins when CUDA is available, so device-to-host copies into it run at full speed.
    """
    nbytes = max(nbytes, 1)
    if pin is None:
        pin = cuda_available()
    if pin:
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if tensor.data_ptr() % ALIGN == 0:
            tensor.zero_()
            return tensor
    # anonymous mmap memory is page aligned and zero-filled; zero_() touches every page now so
    # the first save does not pay for page faults
    region = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    tensor.zero_()
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(-1).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between flat uint8 tensors; host to host by one memmove (GIL released):
    torch's copy_ splits a copy over the intra-op threads, which on the I/O threads fight them for
    the cores, and the I/O threads are parallel already (figures: docs/benchmarks.md).

    A copy to or from CUDA runs on this thread's own stream: on the shared default stream each
    thread's implicit synchronize would also wait for the copies other threads queued."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
        return
    device = src.device if src.device.type == "cuda" else dst.device
    if device.type != "cuda":
        dst.copy_(src)
        return
    stream = thread_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # what produced src comes first
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()  # the bounce buffer is written or reused once this returns


def memory_at(address: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class BouncePool:
    """``count`` page-aligned buffers of ``size`` bytes, handed out one per request in flight."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self.buffers = [aligned_buffer(size) for _ in range(count)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(count):
            self.free.put(index)


def host_address(tensor: torch.Tensor) -> int | None:
    """Where a source's bytes are in host memory (None: device memory)."""
    return tensor.data_ptr() if tensor.device.type == "cpu" else None


def block_crcs(views: Sequence[memoryview], length: int, block: int) -> list[int]:
    """The crc32c of each ``block`` bytes of the first ``length`` bytes of ``views`` joined."""
    crcs, value, filled = [], 0, 0
    for view in views:
        view = view[: max(length, 0)]
        length -= len(view)
        while len(view):
            take = min(block - filled, len(view))
            value = crc32c.crc32c(view[:take], value)
            filled, view = filled + take, view[take:]
            if filled == block:
                crcs.append(value)
                value, filled = 0, 0
    if filled:
        crcs.append(value)
    return crcs
