"""POSIX engine: worker threads doing positional I/O, optionally with O_DIRECT.

Writes stream the container as ``block_size`` requests with ``queue_depth`` in flight. Each
request is one vectored write (``layout.plan_segments``): the aligned bulk of host memory (a
staging arena, or a tensor the writer placed congruent to its address) straight from that
memory; the rest (unaligned edges, pads, small items, device memory, the unaligned tail) copied
into one of ``queue_depth`` page-aligned bounce buffers, which are reused across saves. Reads
are the mirror image. ``os.pwritev``/``os.preadv``, ``crc32c`` and torch copies all release the
GIL, so the threads overlap copying, checksumming and the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import crc32c
import torch

from ..checksums import check_host
from ..concurrency import run_bounded
from ..config import ALIGN, IOConfig
from ..dio import DioAlignment, dio_alignment
from ..errors import DCPNVMeError
from ..layout import (
    SCRATCH,
    ReadRequest,
    Segment,
    Window,
    align_down,
    align_up,
    plan_read_segments,
    plan_segments,
    plan_windows,
)
from ..memory import aligned_buffer
from ..stats import IOStats
from ..store import open_regular
from .base import FileWriteResult, PicklesAsConfig

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_IOV_MAX = 1024
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
    pages already on their way. Only a regular file is opened (store.open_regular), so a FIFO,
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


def pwrite_all(fd: int, buffer: memoryview, offset: int) -> None:
    while len(buffer):
        written = os.pwrite(fd, buffer, offset)
        buffer, offset = buffer[written:], offset + written


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """pwritev until every view is written, at most IOV_MAX views a call."""
    pending = [v for v in views if len(v)]
    while pending:
        written = os.pwritev(fd, pending[:_IOV_MAX], offset)
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


def _thread_stream(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between flat uint8 tensors; host to host by memmove (12 GB/s here, GIL released),
    where torch's copy_ split over 2 threads ran 3.6 GB/s and fought the I/O threads.

    A copy to or from CUDA runs on this thread's own stream: on the shared default stream each
    thread's implicit synchronize would also wait for the copies other threads queued."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
        return
    device = src.device if src.device.type == "cuda" else dst.device
    if device.type != "cuda":
        dst.copy_(src)
        return
    stream = _thread_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # what produced src comes first
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()  # the bounce buffer is written or reused once this returns


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
    the file run one at a time; into reserved blocks they run in parallel (8 threads x 8 MiB,
    1 GiB: 1.67-1.83 GB/s fresh vs 1.79-2.11 GB/s preallocated, interleaved). Plain fallocate,
    not posix_fallocate, which writes zeros where the filesystem cannot reserve. Returns False
    where unsupported; a full disk raises ENOSPC here, before any data is written."""
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


class PrefixTracker:
    """Turns completions in any order into "the first N bytes are written" for ``on_progress``."""

    def __init__(self, callback) -> None:
        self.callback = callback
        self.prefix = 0
        self._pending: dict[int, int] = {}
        self._lock = threading.Lock()

    def done(self, offset: int, length: int) -> None:
        with self._lock:
            self._pending[offset] = length
            before = self.prefix
            while self.prefix in self._pending:
                self.prefix += self._pending.pop(self.prefix)
            prefix = self.prefix
        if prefix > before:
            self.callback(prefix)


def _memory_at(address: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class _BouncePool:
    """``count`` page-aligned buffers of ``size`` bytes, handed out one per request in flight."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self.buffers = [aligned_buffer(size) for _ in range(count)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(count):
            self.free.put(index)


class PosixEngine(PicklesAsConfig):
    """Threads + pwrite/preadv, with O_DIRECT where the filesystem takes it."""

    name = "posix"

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self._pool: _BouncePool | None = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ shared

    def _bounce(self) -> _BouncePool:
        with self._pool_lock:
            if self._pool is None:
                # room for an unaligned request rounded out to ALIGN on both sides
                self._pool = _BouncePool(self.config.queue_depth, self.config.block_size + 2 * ALIGN)
            return self._pool

    def close(self) -> None:
        self._pool = None

    # ------------------------------------------------------------------ write

    def write_file(
        self, path: str, header: bytes, sources: Sequence[torch.Tensor], checksum_block: int,
        on_progress=None,
    ) -> FileWriteResult:
        """``on_progress(n)``, if given, is called as the first ``n`` data bytes are written."""
        with self.open_container(path, header, sources, checksum_block) as container:
            tracker = PrefixTracker(on_progress) if on_progress is not None else None

            def write(window: Window) -> None:
                container.write_host_window(window)
                if tracker is not None:
                    tracker.done(window.offset, window.length)

            run_bounded(self.config.queue_depth, container.windows(), write)
        return container.result

    @contextlib.contextmanager
    def open_container(
        self, path: str, header: bytes, sources: Sequence[torch.Tensor], checksum_block: int
    ) -> Iterator[ContainerWrite]:
        """Create ``path`` and write ``header`` (the O_DIRECT probe); the caller writes the
        windows; on a clean exit the file is cut to size and fsynced and ``.result`` is set.
        An engine that builds on this one (kvikio) writes its own windows in between."""
        if len(header) % ALIGN:
            raise ValueError(f"header of {len(header)} bytes is not a multiple of {ALIGN}")
        if self.config.block_size % checksum_block:
            raise ValueError("checksum_block must divide block_size")
        fd, direct = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.config.direct_io)
        stats = IOStats("write")
        started = time.perf_counter()
        try:
            fd, direct = self._write_header(path, fd, direct, header)
            stats.direct_io = direct
            container = ContainerWrite(self, path, fd, direct, len(header), sources, checksum_block, stats)
            if direct:
                preallocate(fd, align_up(container.size))  # cut back to size by finish_file
            yield container
            finish_file(fd, container.size, stats)
        except OSError as exc:
            raise with_path(exc, path) from exc
        finally:
            os.close(fd)
        stats.seconds = time.perf_counter() - started
        container.result = FileWriteResult(path, container.size, container.data_start, checksum_block,
                                           container.crcs, crc32c.crc32c(header), stats)

    def _write_header(self, path: str, fd: int, direct: bool, header: bytes) -> tuple[int, bool]:
        """Write the header; it is also the probe that O_DIRECT writes really work here."""
        pool = self._bounce()
        index = pool.free.get()
        try:
            if len(header) <= pool.size:
                buffer = pool.buffers[index]
                buffer[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                view = buffer.numpy()[: len(header)].data
            else:  # a header larger than a request (hundreds of thousands of items)
                big = aligned_buffer(len(header), pin=False)
                big.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                view = big.numpy().data
            return write_header(path, fd, direct, view)
        finally:
            pool.free.put(index)

    # ------------------------------------------------------------------ read

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats:
        stats = IOStats("read")
        started = time.perf_counter()
        handles: dict[str, ReadSource] = {}
        handles_lock = threading.Lock()
        dest_arrays = [d.numpy() if d.device.type == "cpu" else None for d in dests]
        addresses = [host_address(d) for d in dests]

        def handle(path: str) -> ReadSource:
            with handles_lock:
                if path not in handles:
                    try:
                        handles[path] = ReadSource.open(path, self.config)
                    except OSError as exc:
                        raise with_path(exc, path) from exc
                return handles[path]

        def run(request: ReadRequest) -> None:
            source = handle(request.file)
            try:
                if source.direct or any(addresses[d] is None for d, _, _ in request.pieces if d != SCRATCH):
                    self._read_planned(source, request, dests, addresses, stats)
                else:
                    self._read_scattered(source.fd, request, dest_arrays, stats)
            except OSError as exc:
                raise with_path(exc, request.file) from exc

        try:
            run_bounded(self.config.queue_depth, requests, run)
        finally:
            for source in handles.values():
                stats.direct_io = stats.direct_io or source.direct
                os.close(source.fd)
        stats.seconds = time.perf_counter() - started
        return stats

    def _read_planned(self, source: ReadSource, request: ReadRequest, dests: Sequence[torch.Tensor],
                      addresses: Sequence[int | None], stats: IOStats) -> None:
        """One preadv of the request's range: straight into host destinations where their
        memory is congruent to the file, the rest into a bounce buffer (``prepare_read``). When
        O_DIRECT refuses the destinations' memory, the request is read again with every byte
        bounced, after its first buffer went back to the pool (as ``write_host_window``)."""
        pool = self._bounce()
        while True:
            prepared = prepare_read(request, source, addresses, pool, pool.free.get)
            try:
                begun = stats.begin()
                try:
                    got = _pread_into(source.fd, [_memory_at(a, n) for a, n in prepared.spans], prepared.lo)
                except OSError as exc:
                    if not source.refused_direct_memory(exc, prepared):
                        raise
                    stats.end(begun, 0)
                    continue  # again, every byte through a bounce buffer
                stats.end(begun, request.length, prepared.copied)
                finish_read(prepared, got, pool, dests)
                return
            finally:
                if prepared.buffer >= 0:
                    pool.free.put(prepared.buffer)

    def _read_scattered(self, fd, request, dest_arrays, stats) -> None:
        scratch_len = sum(n for d, _, n in request.pieces if d == SCRATCH)
        scratch = memoryview(bytearray(scratch_len)) if scratch_len else None
        views, used = [], 0
        for dest, dest_offset, length in request.pieces:
            if dest == SCRATCH:
                views.append(scratch[used : used + length])
                used += length
            else:
                views.append(dest_arrays[dest][dest_offset : dest_offset + length].data)
        begun = stats.begin()
        got = _pread_into(fd, views, request.file_offset)
        stats.end(begun, request.length)
        check_length(request, request.file_offset + got)
        check_host(request.file, request.file_offset, request.checks, views)


class ContainerWrite:
    """A container being written by ``PosixEngine.open_container``: where its data goes, the
    crc32c of every checksum block as windows land, and the write's figures."""

    def __init__(self, engine: PosixEngine, path: str, fd: int, direct: bool, data_start: int,
                 sources: Sequence[torch.Tensor], checksum_block: int, stats: IOStats) -> None:
        self.engine, self.path, self.fd, self.direct = engine, path, fd, direct
        self.data_start, self.sources, self.stats = data_start, sources, stats
        self.checksum_block = checksum_block
        self.sizes = [int(s.numel()) for s in sources]
        self.size = data_start + sum(self.sizes)
        self.crcs = [0] * (-(-sum(self.sizes) // checksum_block))
        self.addresses = [host_address(s) for s in sources]
        self.dio: DioAlignment | None = dio_alignment(fd) if direct else None
        """What O_DIRECT needs on this file (statx, else the device's logical block size)."""
        self.align = self.dio.span if self.dio else 1
        """Where a segment may start and end; 1 when buffered (any address will do)."""
        self.result: FileWriteResult | None = None

    def windows(self) -> Iterator[Window]:
        """The data region cut into requests of ``block_size`` bytes."""
        return plan_windows(self.sizes, self.engine.config.block_size)

    def record_crcs(self, window: Window, values: Sequence[int]) -> None:
        """The crc32c of the window's checksum blocks, in order."""
        first = window.offset // self.checksum_block
        self.crcs[first : first + len(values)] = values

    def prepare(self, window: Window, take: Callable[[], int], give: Callable[[int], None]) -> PreparedWindow:
        """The window's segments as ``(address, length)`` spans, its bounce parts copied into the
        buffer ``take()`` hands out (taken only when something bounces; ``give`` returns it if
        the copy fails, else the caller does once the write is done)."""
        segments = plan_segments(window, self.addresses, self.align, max_segments=_IOV_MAX)
        index = take() if any(s.address is None for s in segments) else -1
        try:
            buffer = self.engine._bounce().buffers[index] if index >= 0 else None
            spans, copied = [], 0
            for segment in segments:
                if segment.address is not None:
                    spans.append((segment.address, segment.length))
                    continue
                for piece in segment.pieces:
                    src = self.sources[piece.source][piece.src_offset : piece.src_offset + piece.length]
                    copy_bytes(buffer[piece.dst_offset : piece.dst_offset + piece.length], src)
                end = segment.offset + segment.length
                if segment.fill:
                    buffer[end : end + segment.fill].zero_()
                spans.append((buffer.data_ptr() + segment.offset, segment.length + segment.fill))
                copied += segment.length
        except BaseException:
            if index >= 0:
                give(index)
            raise
        direct = sum(s.length for s in segments if s.address is not None)
        return PreparedWindow(window, spans, copied, index, direct)

    def finish(self, prepared: PreparedWindow) -> None:
        """Record the crc32c of the written window's checksum blocks, across its segments."""
        views = [_memory_at(address, length) for address, length in prepared.spans]
        self.record_crcs(prepared.window, block_crcs(views, prepared.window.length, self.checksum_block))

    def write_host_window(self, window: Window) -> None:
        """Write one window from host memory in one vectored write: direct spans from their own
        memory, the rest through a bounce buffer (``prepare``). When O_DIRECT refuses the
        sources' memory, the window is written again with every byte bounced, after its first
        buffer went back to the pool: with every I/O thread retrying at once, none may hold a
        buffer while waiting for another."""
        pool = self.engine._bounce()
        while True:
            prepared = self.prepare(window, pool.free.get, pool.free.put)
            try:
                begun = self.stats.begin()
                try:
                    pwritev_all(self.fd, [_memory_at(a, n) for a, n in prepared.spans],
                                self.data_start + window.offset)
                except OSError as exc:
                    if not self.refused_direct_memory(exc, prepared):
                        raise
                    self.stats.end(begun, 0)
                    continue  # again, every byte through a bounce buffer
                self.stats.end(begun, window.length, prepared.copied)
                self.finish(prepared)
                return
            finally:
                if prepared.buffer >= 0:
                    pool.free.put(prepared.buffer)

    def refused_direct_memory(self, exc: OSError, prepared: PreparedWindow) -> bool:
        """Whether O_DIRECT refused a write from the sources' own memory (EINVAL: the alignment
        the kernel or device reported was not enough); if so, every later window of this file
        (and this one, written again) bounces through page-aligned buffers, page-rounded."""
        if not self.direct or exc.errno != errno.EINVAL or not prepared.direct_bytes:
            return False  # a buffered write, or one bounced already: a real error
        if any(a is not None for a in self.addresses):
            log.warning("dcp_nvme: O_DIRECT refused a write from tensor memory aligned to %d for %s; "
                        "bouncing every write of this file", self.align, self.path)
            self.align = ALIGN  # what every device takes; first, so no bounce uses the old one
            self.addresses = [None] * len(self.addresses)
        return True


@dataclass(frozen=True)
class PreparedWindow:
    """A window ready to write: ``spans`` of host memory in file order, the bytes copied into
    the bounce buffer ``buffer`` (-1: none taken) to get there."""

    window: Window
    spans: list[tuple[int, int]]
    copied: int
    buffer: int
    direct_bytes: int = 0
    """Bytes written straight from the sources' memory."""


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


def _pread_into(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv until every view is full or the file ends; returns the bytes read."""
    total = 0
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:_IOV_MAX]
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


_warned_read_memory: set[str] = set()


@dataclass
class ReadSource:
    """A container open for reading: its fd, whether O_DIRECT is on, and the alignment a span
    read straight into destination memory needs (1 when buffered)."""

    path: str
    fd: int
    direct: bool
    align: int
    zero_copy: bool = True
    """False once O_DIRECT refused destination memory: every later read of the file bounces."""

    @classmethod
    def open(cls, path: str, config: IOConfig) -> ReadSource:
        fd, direct = open_for_reading(path, config)
        try:
            dio = dio_alignment(fd) if direct else None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, direct, dio.span if dio else 1)

    def refused_direct_memory(self, exc: OSError, prepared: PreparedRead) -> bool:
        """Whether O_DIRECT refused a read into destination memory (EINVAL: the reported
        alignment was not enough); if so this read and every later one of the file bounce
        through page-aligned buffers, as writes do (``ContainerWrite.refused_direct_memory``)."""
        if not self.direct or exc.errno != errno.EINVAL or not prepared.direct_bytes:
            return False  # a buffered read, or one bounced already: a real error
        if self.path not in _warned_read_memory:
            _warned_read_memory.add(self.path)
            log.warning("dcp_nvme: O_DIRECT refused a read into tensor memory aligned to %d for %s; "
                        "bouncing every read of this file", self.align, self.path)
        self.zero_copy = False
        return True


@dataclass(frozen=True)
class PreparedRead:
    """A request ready to read from file offset ``lo``: ``spans`` of host memory in file order
    (destination memory, or the bounce buffer ``buffer``, -1: none taken)."""

    request: ReadRequest
    lo: int
    segments: list[Segment]
    spans: list[tuple[int, int]]
    buffer: int
    copied: int
    """Bytes to copy out of the bounce buffer into destinations once read."""
    direct_bytes: int
    """Bytes read straight into destination memory."""


def read_range(request: ReadRequest, direct: bool) -> tuple[int, int]:
    """The file bytes a request reads: rounded out to pages under O_DIRECT."""
    end = request.file_offset + request.length
    return (align_down(request.file_offset), align_up(end)) if direct else (request.file_offset, end)


def prepare_read(request: ReadRequest, source: ReadSource, addresses: Sequence[int | None],
                 pool: _BouncePool, take: Callable[[], int]) -> PreparedRead:
    """Plan one request's read (``layout.plan_read_segments``) into host destinations
    (``addresses``: each destination's, None for device memory) and the bounce buffer ``take()``
    hands out, taken only when something bounces."""
    lo, hi = read_range(request, source.direct)
    if hi - lo > pool.size:
        raise ValueError(f"read request of {hi - lo} bytes exceeds the {pool.size}-byte buffer")
    pieces = [(length, None if dest == SCRATCH or addresses[dest] is None or not source.zero_copy
               else addresses[dest] + dest_offset) for dest, dest_offset, length in request.pieces]
    segments = plan_read_segments(request.file_offset, pieces, lo, hi, source.align, max_segments=_IOV_MAX)
    bounced = [s for s in segments if s.address is None]
    index = take() if bounced else -1
    base = pool.buffers[index].data_ptr() if index >= 0 else 0
    spans = [(s.address, s.length) if s.address is not None else (base + s.offset, s.length)
             for s in segments]
    copied = sum(p.length for s in bounced for p in s.pieces
                 if p.source < len(request.pieces) and request.pieces[p.source][0] != SCRATCH)
    return PreparedRead(request, lo, segments, spans, index, copied, hi - lo - sum(s.length for s in bounced))


def finish_read(prepared: PreparedRead, got: int, pool: _BouncePool, dests: Sequence[torch.Tensor]) -> None:
    """A request's bytes landed (``got`` of them from ``prepared.lo``): its length and block
    crcs checked across the direct and bounced spans in file order, then the bounced pieces
    copied out of the bounce buffer to their destinations."""
    request = prepared.request
    check_length(request, prepared.lo + got)
    views = _clip_views([_memory_at(a, n) for a, n in prepared.spans], request.file_offset - prepared.lo,
                        request.length)
    check_host(request.file, request.file_offset, request.checks, views)
    if prepared.buffer < 0:
        return
    buffer = pool.buffers[prepared.buffer]
    for segment in prepared.segments:
        if segment.address is not None:
            continue
        for piece in segment.pieces:
            if piece.source == len(request.pieces):
                continue  # the O_DIRECT rounding
            dest, dest_offset, _ = request.pieces[piece.source]
            if dest != SCRATCH:
                start = dest_offset + piece.src_offset
                copy_bytes(dests[dest][start : start + piece.length],
                           buffer[piece.dst_offset : piece.dst_offset + piece.length])


def _clip_views(views: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
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
