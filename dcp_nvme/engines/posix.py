"""The POSIX (threads) engine, ``PosixEngine``: worker threads doing positional I/O, optionally
with O_DIRECT; and one container's write as windows (``ContainerWrite``: crc32c of its blocks,
the written prefix a staged save waits on), which the io_uring and kvikio engines build on.

Writes stream the container as ``block_size`` requests with ``queue_depth`` in flight. Each
request is one vectored write (``requests.plan_segments``): the aligned bulk of host memory (a
staging arena, or a tensor the writer placed congruent to its address) straight from that
memory; the rest (unaligned edges, pads, small items, device memory, the unaligned tail) copied
into one of ``queue_depth`` page-aligned bounce buffers, which are reused across saves. Reads
are the mirror image. ``os.pwritev``/``os.preadv``, ``crc32c`` and torch copies all release the
GIL, so the threads overlap copying, checksumming and the device."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import crc32c
import torch

from dcp_nvme.config import ALIGN, IOConfig
from dcp_nvme.engines.base import FileWriteResult, PicklesAsConfig
from dcp_nvme.engines.host_io import (
    IOV_MAX,
    BouncePool,
    DioAlignment,
    aligned_buffer,
    block_crcs,
    check_length,
    copy_bytes,
    dio_alignment,
    finish_file,
    host_address,
    memory_at,
    open_file,
    pread_into,
    preallocate,
    pwritev_all,
    with_path,
    write_header,
)
from dcp_nvme.engines.reads import ReadSource, finish_read, prepare_read
from dcp_nvme.engines.requests import (
    SCRATCH,
    IOStats,
    ReadRequest,
    Window,
    plan_segments,
    plan_windows,
    run_bounded,
)
from dcp_nvme.format.checksums import check_host
from dcp_nvme.format.container import align_up

log = logging.getLogger(__name__)


class PosixEngine(PicklesAsConfig):
    """Threads + pwrite/preadv, with O_DIRECT where the filesystem takes it."""

    name = "posix"

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self._pool: BouncePool | None = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ shared

    def bounce_pool(self) -> BouncePool:
        """The engine's queue_depth bounce buffers (made at first use, kept across saves and loads)."""
        with self._pool_lock:
            if self._pool is None:
                # room for an unaligned request rounded out to ALIGN on both sides
                self._pool = BouncePool(self.config.queue_depth, self.config.block_size + 2 * ALIGN)
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

            run_bounded(self.config.queue_depth, container.windows(), write, peek=True)
        assert container.result is not None  # set by open_container on a clean exit
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
        pool = self.bounce_pool()
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
            run_bounded(self.config.queue_depth, requests, run, peek=True)
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
        pool = self.bounce_pool()
        while True:
            prepared = prepare_read(request, source, addresses, pool, pool.free.get)
            try:
                begun = stats.begin()
                try:
                    got = pread_into(source.fd, [memory_at(a, n) for a, n in prepared.spans], prepared.lo)
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
                assert scratch is not None  # a SCRATCH piece is never empty (load/planning.py)
                views.append(scratch[used : used + length])
                used += length
            else:
                views.append(dest_arrays[dest][dest_offset : dest_offset + length].data)
        begun = stats.begin()
        got = pread_into(fd, views, request.file_offset)
        stats.end(begun, request.length)
        check_length(request, request.file_offset + got)
        check_host(request.file, request.file_offset, request.checks, views)


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
            buffer = self.engine.bounce_pool().buffers[index] if index >= 0 else None
            spans, copied = [], 0
            for segment in segments:
                if segment.address is not None:
                    spans.append((segment.address, segment.length))
                    continue
                assert buffer is not None  # taken above: this segment bounces
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
        pool = self.engine.bounce_pool()
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
