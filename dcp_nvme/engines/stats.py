"""What an I/O pass measured: bytes, seconds, requests, the depth reached, request latency."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


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
