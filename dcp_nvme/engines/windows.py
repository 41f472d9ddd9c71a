"""One container being written, window by window: what each window's bytes are and where
they come from (tensor memory straight, or through a bounce buffer), and the crc32c of every
checksum block as the windows land."""

from __future__ import annotations

import ctypes
import errno
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import crc32c
import torch

from ..config import ALIGN
from ..observe.stats import IOStats
from .base import FileWriteResult
from .buffers import DioAlignment, aligned_buffer, dio_alignment
from .files import IOV_MAX, pwritev_all, thread_stream
from .requests import Window, plan_segments, plan_windows

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .posix import PosixEngine


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
    stream = thread_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # what produced src comes first
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()  # the bounce buffer is written or reused once this returns


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
        segments = plan_segments(window, self.addresses, self.align, max_segments=IOV_MAX)
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
        views = [memory_at(address, length) for address, length in prepared.spans]
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
                    pwritev_all(self.fd, [memory_at(a, n) for a, n in prepared.spans],
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
