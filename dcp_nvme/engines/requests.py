"""The I/O requests of a file (pure): write windows, their segments, and read requests.

A container's data region is cut into ``block_size`` windows (``plan_windows``); each window is
cut into segments (``plan_segments``): the O_DIRECT-aligned bulk of host memory written straight
from that memory, the rest copied into a bounce buffer. ``plan_read_segments`` is the mirror
image for reads; ``run_bounded`` runs requests with at most ``queue_depth`` in flight, and
``IOStats`` is what running them measured (bytes, seconds, requests, the depth reached, request
latency; ``PhaseTimer`` times a save's phases)."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from dcp_nvme.config import ALIGN
from dcp_nvme.format.container import align_down, align_up


@dataclass(frozen=True)
class SourceSpan:
    """``length`` bytes of source ``source`` from ``src_offset`` land at ``dst_offset``."""

    source: int
    src_offset: int
    length: int
    dst_offset: int


@dataclass(frozen=True)
class Window:
    """One write request: ``length`` bytes at data-region offset ``offset``."""

    offset: int
    length: int
    pieces: tuple[SourceSpan, ...]


def plan_windows(sizes: Sequence[int], block_size: int) -> Iterator[Window]:
    """Cut the concatenation of ``sizes`` into requests of ``block_size`` bytes (the last shorter)."""
    total = sum(sizes)
    source, consumed = 0, 0  # current source and bytes of it already placed
    for start in range(0, total, block_size):
        length = min(block_size, total - start)
        pieces: list[SourceSpan] = []
        filled = 0
        while filled < length:
            while sizes[source] - consumed == 0:
                source, consumed = source + 1, 0
            take = min(sizes[source] - consumed, length - filled)
            pieces.append(SourceSpan(source, consumed, take, filled))
            consumed += take
            filled += take
        yield Window(start, length, tuple(pieces))


@dataclass(frozen=True)
class Segment:
    """One iovec of a window's write: ``length`` bytes at window offset ``offset``, straight from
    host memory at ``address``, or (``address`` None) from the window's bounce buffer at the same
    offset, filled from ``pieces`` (``dst_offset`` relative to the window) then ``fill`` zero
    bytes (the O_DIRECT round-up of the file's last window)."""

    offset: int
    length: int
    address: int | None
    pieces: tuple[SourceSpan, ...] = ()
    fill: int = 0


def _host_runs(window: Window, addresses: Sequence[int | None]) -> list[tuple[int, int, int | None]]:
    """``(window offset, length, address)`` of the window's pieces, merged where they are one
    span of host memory (address None: not in host memory)."""
    runs: list[tuple[int, int, int | None]] = []
    for piece in window.pieces:
        base = addresses[piece.source]
        address = None if base is None else base + piece.src_offset
        if runs and address is not None:
            position, length, start = runs[-1]
            if start is not None and start + length == address:
                runs[-1] = (position, length + piece.length, start)
                continue
        runs.append((piece.dst_offset, piece.length, address))
    return runs


def _direct_spans(window: Window, addresses: Sequence[int | None], align: int,
                  min_direct: int) -> list[tuple[int, int, int]]:
    """The aligned bulk of every host run whose memory is congruent to its file offset."""
    spans = []
    for position, length, address in _host_runs(window, addresses):
        if address is None or (address - window.offset - position) % align:
            continue
        lo, hi = align_up(position, align), align_down(position + length, align)
        if hi - lo >= max(min_direct, 1):
            spans.append((lo, hi - lo, address + lo - position))
    return spans


def _clip(window: Window, starts: Sequence[int], lo: int, hi: int) -> tuple[SourceSpan, ...]:
    """The window's pieces cut to window offsets ``[lo, hi)`` (``starts``: their dst offsets)."""
    out = []
    index = max(bisect.bisect_right(starts, lo) - 1, 0)
    for piece in window.pieces[index:]:
        if piece.dst_offset >= hi:
            break
        start, end = max(lo, piece.dst_offset), min(hi, piece.dst_offset + piece.length)
        if start < end:
            out.append(SourceSpan(piece.source, piece.src_offset + start - piece.dst_offset, end - start, start))
    return tuple(out)


def plan_segments(
    window: Window, addresses: Sequence[int | None], align: int = 1, *, min_direct: int = ALIGN,
    max_segments: int = 1024,
) -> list[Segment]:
    """Cut one write window into segments: the ``align``-aligned bulk of each host run (a tensor,
    or tensors one after the other in memory) whose address is congruent to its file offset
    modulo ``align`` is written from its own memory; the rest (edges, pads, small items, device
    memory) through a bounce buffer. Every segment but the last starts and ends on an ``align``
    boundary, the last is rounded up with ``fill``, so O_DIRECT takes the whole list as one
    vectored write (``align``: the larger of its memory and offset alignments; 1 when buffered).

    ``addresses``: each source's host address (None: not in host memory). The window's file
    offset must be a multiple of ``align``: the data region starts on a page. Direct spans
    shorter than ``min_direct`` bounce (a memcpy beats an iovec); at most ``max_segments``
    (IOV_MAX) come out, the shortest direct spans bouncing first.
    """
    if window.offset % align:
        raise ValueError(f"window at {window.offset} is not aligned to {align}")
    spans = _direct_spans(window, addresses, align, min_direct)
    keep = max((max_segments - 1) // 2, 0)  # each direct span may bring a bounce segment
    if len(spans) > keep:
        spans = sorted(sorted(spans, key=lambda span: -span[1])[:keep])
    starts = [piece.dst_offset for piece in window.pieces]
    segments: list[Segment] = []
    position = 0
    for lo, length, address in spans:
        if lo > position:
            segments.append(Segment(position, lo - position, None, _clip(window, starts, position, lo)))
        segments.append(Segment(lo, length, address))
        position = lo + length
    if position < window.length:
        fill = align_up(window.length, align) - window.length
        segments.append(Segment(position, window.length - position, None,
                                _clip(window, starts, position, window.length), fill))
    return segments


def plan_read_segments(
    offset: int, pieces: Sequence[tuple[int, int | None]], lo: int, hi: int, align: int = 1, *,
    min_direct: int = ALIGN, max_segments: int = 1024,
) -> list[Segment]:
    """Cut one read of file bytes ``[lo, hi)`` into segments, the mirror of ``plan_segments``:
    the ``align``-aligned bulk of each piece whose destination address is congruent to its file
    offset is read straight into that memory, the rest (edges, bytes nobody wants, pieces with
    no host address, the rounding out to ``[lo, hi)``) into the bounce buffer at the same offset
    from ``lo``, so the whole list is one vectored O_DIRECT read.

    ``pieces``: ``(length, address)`` of the request's bytes from file offset ``offset`` on, in
    order (address None: not host memory, or scratch). Each segment's ``pieces`` name them by
    index as ``source`` (``src_offset`` within the piece, ``dst_offset`` from ``lo``); source
    ``len(pieces)`` is the rounding, which goes nowhere.
    """
    end = offset + sum(length for length, _ in pieces)
    if not lo <= offset <= end <= hi:
        raise ValueError(f"read range [{lo}, {hi}) does not hold the request [{offset}, {end})")
    rounding = len(pieces)
    spans, position = [], offset - lo
    if position:
        spans.append(SourceSpan(rounding, 0, position, 0))
    for source, (length, _) in enumerate(pieces):
        if length:
            spans.append(SourceSpan(source, 0, length, position))
            position += length
    if position < hi - lo:
        spans.append(SourceSpan(rounding, 0, hi - lo - position, position))
    addresses = [address for _, address in pieces] + [None]
    return plan_segments(Window(lo, hi - lo, tuple(spans)), addresses, align, min_direct=min_direct,
                         max_segments=max_segments)


SCRATCH = -1
"""Destination id of bytes that are read (to be verified) but wanted by nobody."""


@dataclass
class ReadRequest:
    """One positional read of a contiguous file range, scattered into destination pieces.

    ``pieces`` are ``(dest, dest_offset, length)`` in file order and sum to ``length``;
    ``checks`` are ``(offset_in_request, length, expected_crc32c)`` for whole checksum blocks.
    """

    file: str
    file_offset: int
    length: int
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    checks: list[tuple[int, int, int]] = field(default_factory=list)


T = TypeVar("T")
_NONE = object()


def run_bounded(depth: int, tasks: Iterable[T], work: Callable[[T], object], name: str = "dcp-nvme-io",
                peek: bool = False) -> None:
    """Run ``work(task)`` for each task with at most ``depth`` in flight, on ``depth`` threads.

    Tasks are drawn lazily (a generator of millions of requests costs no memory); after the first
    failure no new task starts, the running ones finish, and that failure is re-raised. With
    ``peek`` (tasks whose drawing never waits on the work, as an engine's planned requests), a
    single task runs on the calling thread: a small save or load pays no thread start. Without it
    no task is drawn before the one before it started (a drain draws pieces as they are coded).
    """
    tasks = iter(tasks)
    if not peek:
        _run_pooled(depth, tasks, work, name)
        return
    first = next(tasks, _NONE)
    if first is _NONE:
        return
    second = next(tasks, _NONE)
    if second is _NONE:
        work(cast(T, first))
        return
    _run_pooled(depth, itertools.chain((cast(T, first), cast(T, second)), tasks), work, name)


def _run_pooled(depth: int, tasks: Iterator[T], work: Callable[[T], object], name: str) -> None:
    slots = threading.BoundedSemaphore(depth)
    failure: list[BaseException] = []

    def done(future: Future) -> None:
        error = future.exception()
        if error is not None and not failure:
            failure.append(error)
        slots.release()

    with ThreadPoolExecutor(depth, thread_name_prefix=name) as pool:
        for task in tasks:
            slots.acquire()
            if failure:
                slots.release()
                break
            pool.submit(work, task).add_done_callback(done)
    if failure:
        raise failure[0]


# What an I/O pass measured.

def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class IOStats:
    """Counters for one engine pass; I/O threads update them through ``begin`` and ``end``."""

    op: str
    bytes: int = 0
    requests: int = 0
    seconds: float = 0.0
    max_inflight: int = 0
    copied_bytes: int = 0
    """Bytes that went through a bounce buffer rather than straight from/to the caller's memory."""
    direct_io: bool = False
    fsync_seconds: float = 0.0
    decoded_bytes: int = 0
    """Bytes decoded from a compressed mirror's chunks (reads of a plain checkpoint: 0)."""
    decode_seconds: float = 0.0
    """CPU time of that decoding (thread time, summed over the threads that decoded)."""
    latencies: list[float] = field(default_factory=list, repr=False)
    _inflight: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self) -> float:
        with self._lock:
            self._inflight += 1
            self.max_inflight = max(self.max_inflight, self._inflight)
        return time.perf_counter()

    def end(self, started: float, nbytes: int, copied: int = 0) -> None:
        elapsed = time.perf_counter() - started
        with self._lock:
            self._inflight -= 1
            self.requests += 1
            self.bytes += nbytes
            self.copied_bytes += copied
            self.latencies.append(elapsed)

    def decoded(self, nbytes: int, seconds: float) -> None:
        """Count ``nbytes`` decoded in ``seconds`` of a thread's CPU time."""
        with self._lock:
            self.decoded_bytes += nbytes
            self.decode_seconds += seconds

    @property
    def decode_mbps(self) -> float:
        """Decoded MB per CPU second of decoding (one core's rate)."""
        return self.decoded_bytes / self.decode_seconds / 1e6 if self.decode_seconds > 0 else 0.0

    def merge(self, other: IOStats) -> None:
        self.bytes += other.bytes
        self.requests += other.requests
        self.seconds += other.seconds
        self.copied_bytes += other.copied_bytes
        self.fsync_seconds += other.fsync_seconds
        self.decoded_bytes += other.decoded_bytes
        self.decode_seconds += other.decode_seconds
        self.max_inflight = max(self.max_inflight, other.max_inflight)
        self.direct_io = self.direct_io or other.direct_io
        self.latencies.extend(other.latencies)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        decode = {} if not self.decoded_bytes else {
            "decoded_bytes": self.decoded_bytes, "decode_cpu_seconds": round(self.decode_seconds, 6),
            "decode_MBps_per_core": round(self.decode_mbps, 1)}
        return {
            "op": self.op,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 6),
            "gbps": round(self.gbps, 3),
            "requests": self.requests,
            "max_inflight": self.max_inflight,
            "copied_bytes": self.copied_bytes,
            "direct_io": self.direct_io,
            "fsync_seconds": round(self.fsync_seconds, 6),
            "latency_p50_ms": round(percentile(self.latencies, 50) * 1e3, 3),
            "latency_p99_ms": round(percentile(self.latencies, 99) * 1e3, 3),
            **decode,
        }


@dataclass
class PhaseTimer:
    """Seconds by named phase (plan, stage, write, fsync, commit...)."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    class _Span:
        def __init__(self, timer: PhaseTimer, name: str) -> None:
            self.timer, self.name = timer, name

        def __enter__(self) -> None:
            self.start = time.perf_counter()

        def __exit__(self, *exc: object) -> None:
            self.timer.add(self.name, time.perf_counter() - self.start)

    def span(self, name: str) -> PhaseTimer._Span:
        return PhaseTimer._Span(self, name)
