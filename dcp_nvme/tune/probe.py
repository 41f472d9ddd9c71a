"""Measure one I/O point and choose among points: queue depth x block size (x O_DIRECT).

Each point writes a fresh file of ``--size`` bytes from one aligned buffer through
``PosixEngine.write_file`` (fsync included), evicts it from the page cache, reads it back
through ``PosixEngine.read``, and deletes it.

The best point maximises the geometric mean of write and read GB/s; points within 3 % of it
count as equal and the one with the smallest write window (queue_depth x block_size, which is
also the bounce-buffer memory per rank) wins."""

from __future__ import annotations

import math
import os
import statistics
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

from dcp_nvme.config import ALIGN, IOConfig
from dcp_nvme.engines.host_io import aligned_buffer
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.humanize import format_size, progress_bar
from dcp_nvme.load.planning import Need, plan_reads
from dcp_nvme.observe.machine import evict_from_page_cache, machine_info

TIE_TOLERANCE = 0.03


@dataclass
class ProbeResult:
    """One raw engine pass: a file written from an aligned buffer, then read back cold."""

    config: IOConfig
    nbytes: int
    write_seconds: float
    read_seconds: float
    write_io: dict[str, Any]
    read_io: dict[str, Any]
    eviction: str

    @property
    def write_gbps(self) -> float:
        return self.nbytes / self.write_seconds / 1e9

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.read_seconds / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue_depth": self.config.queue_depth, "block_size": self.config.block_size,
            "direct_io": self.config.direct_io, "bytes": self.nbytes,
            "write_seconds": round(self.write_seconds, 6), "read_seconds": round(self.read_seconds, 6),
            "write_gbps": round(self.write_gbps, 3), "read_gbps": round(self.read_gbps, 3),
            "write_io": self.write_io, "read_io": self.read_io, "eviction": self.eviction,
        }


def engine_probe(directory: str, nbytes: int, config: IOConfig, buffer=None, keep: bool = False,
                 sync=None, engine_class=PosixEngine, turn=nullcontext) -> ProbeResult:
    """Write ``nbytes`` to a new file with the plugin's engine, evict it, read it back, delete it.

    The data comes from (and returns to) one page-aligned buffer, so the engine takes its
    zero-copy path: this is the best the engine can do on this directory, the device limit as
    the plugin sees it. The engine is warmed on a small file first so that allocating its
    bounce buffers is not timed. ``sync``, when given, is called before the timed write and
    before the timed read: processes measured together (``tune --ranks``) start each at once.
    ``turn`` wraps the timed write (a node write turn when they write staggered): waiting for it
    counts, as it does for a rank.
    """
    nbytes = max(ALIGN, nbytes // ALIGN * ALIGN)
    os.makedirs(directory, exist_ok=True)
    engine = engine_class(config)
    source = buffer if buffer is not None else aligned_buffer(nbytes, pin=False)
    source = source[:nbytes]
    header = bytes(ALIGN)
    tag = uuid.uuid4().hex[:8]
    warm = os.path.join(directory, f".probe-warm-{tag}")
    path = os.path.join(directory, f"probe-{tag}.bin")
    try:
        engine.write_file(warm, header, [source[:ALIGN]], config.checksum_block)
        os.unlink(warm)
        if sync is not None:
            sync()
        started = time.perf_counter()
        with turn():
            written = engine.write_file(path, header, [source], config.checksum_block)
        write_seconds = time.perf_counter() - started
        eviction = evict_from_page_cache([path])
        dest = aligned_buffer(nbytes, pin=False) if buffer is None else source
        requests = plan_reads(path, [Need(ALIGN, nbytes, 0, 0)], max_request=config.block_size)
        if sync is not None:
            sync()
        started = time.perf_counter()
        read_stats = engine.read(requests, [dest])
        read_seconds = time.perf_counter() - started
    finally:
        engine.close()
        for leftover in (warm, path):
            if not keep and os.path.exists(leftover):
                os.unlink(leftover)
    return ProbeResult(config, nbytes, write_seconds, read_seconds, written.stats.to_dict(),
                       read_stats.to_dict(), eviction)


CHOSEN_BY = ("queue_depth", "block_size", "direct_io", "write_gbps", "read_gbps")
"""pick_best copies these from the winning point: together they find it again among the points."""


def pick_best(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The point with the best geometric mean of write and read GB/s; near-ties go to the
    smallest write window (less memory, less queueing behind a checkpoint)."""
    def score(point: dict[str, Any]) -> float:
        return math.sqrt(max(point["write_gbps"], 0.0) * max(point["read_gbps"], 0.0))

    if not points:
        raise ValueError("no tune points to choose from")
    top = max(score(p) for p in points)
    near = [p for p in points if score(p) >= (1 - TIE_TOLERANCE) * top]
    best = min(near, key=lambda p: (p["queue_depth"] * p["block_size"], -score(p)))
    return {k: best[k] for k in CHOSEN_BY} | {"score_gbps": round(score(best), 3)}


def _median_point(runs: list[ProbeResult]) -> dict[str, Any]:
    point = runs[0].to_dict()
    if len(runs) > 1:
        point["write_seconds"] = statistics.median(r.write_seconds for r in runs)
        point["read_seconds"] = statistics.median(r.read_seconds for r in runs)
        point["write_gbps"] = round(point["bytes"] / point["write_seconds"] / 1e9, 3)
        point["read_gbps"] = round(point["bytes"] / point["read_seconds"] / 1e9, 3)
        point["repeats"] = [r.to_dict() for r in runs]
    return point


def sweep(directory: str, nbytes: int, queue_depths: list[int], block_sizes: list[int],
          directs: list[bool], repeat: int = 1, progress: bool = True) -> dict[str, Any]:
    """Measure every point; return the tune document (best, points, machine)."""
    grid = [(d, q, b) for d in directs for b in block_sizes for q in queue_depths]
    buffer = aligned_buffer(max(ALIGN, nbytes // ALIGN * ALIGN), pin=False)
    points = []
    bar = progress_bar(len(grid) * repeat, progress, unit="pt")
    try:
        for direct, depth, block in grid:
            config = IOConfig(queue_depth=depth, block_size=block, direct_io=direct, engine="posix")
            runs = []
            for _ in range(repeat):
                bar.set_description(f"tune qd={depth} bs={format_size(block)} direct={int(direct)}")
                runs.append(engine_probe(directory, nbytes, config, buffer=buffer))
                bar.update(1)
            points.append(_median_point(runs))
    finally:
        bar.close()
    best = pick_best(points)
    best_config = IOConfig(queue_depth=best["queue_depth"], block_size=best["block_size"],
                           direct_io=best["direct_io"], engine="posix")
    modes = measure_read_modes(directory, nbytes, best_config, buffer, repeat)
    best["read_mode"] = pick_read_mode(modes)
    host_engines = measure_host_engines(directory, nbytes, best_config, buffer, repeat)
    best["host_engine"] = pick_host_engine(host_engines)
    return {
        "format": "dcp_nvme.tune", "format_version": 1, "created_unix": time.time(),
        "best": best, "size": nbytes, "repeat": repeat, "points": points,
        "read_modes": modes, "host_engines": host_engines, "machine": machine_info(directory),
    }


def measure_host_engines(directory: str, nbytes: int, config: IOConfig, buffer=None,
                         repeat: int = 1) -> dict[str, dict[str, Any]]:
    """Write GB/s and CPU seconds per GB (user+sys of this process) of the threads and io_uring
    engines at one point, alternating, median of ``repeat`` rounds each."""
    import resource

    from dcp_nvme.engines.uring import UringEngine, uring_unavailable_reason

    classes = {"posix": PosixEngine, "uring": UringEngine}
    reason = uring_unavailable_reason()
    runs: dict[str, list[tuple[float, float]]] = {"posix": []} if reason else {"posix": [], "uring": []}
    for _ in range(repeat):
        for name in runs:
            before = resource.getrusage(resource.RUSAGE_SELF)
            probe = engine_probe(directory, nbytes, config, buffer=buffer, engine_class=classes[name])
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            runs[name].append((probe.write_gbps, cpu / (2 * probe.nbytes / 1e9)))  # written + read
    out: dict[str, dict[str, Any]] = {
        name: {"write_gbps": round(statistics.median(r[0] for r in values), 3),
               "cpu_seconds_per_gb": round(statistics.median(r[1] for r in values), 4)}
        for name, values in runs.items()}
    if reason:
        out["uring"] = {"unavailable": reason}
    return out


def pick_host_engine(measured: dict[str, dict[str, Any]]) -> str:
    """io_uring when it is available, writes within 3 % of the threads engine or faster, and
    costs less CPU per GB; otherwise the threads engine."""
    uring, posix = measured.get("uring", {}), measured["posix"]
    if "write_gbps" not in uring:
        return "posix"
    fast_enough = uring["write_gbps"] >= (1 - TIE_TOLERANCE) * posix["write_gbps"]
    return "uring" if fast_enough and uring["cpu_seconds_per_gb"] < posix["cpu_seconds_per_gb"] else "posix"


def measure_read_modes(directory: str, nbytes: int, config: IOConfig, buffer=None,
                       repeat: int = 1) -> dict[str, float]:
    """Cold-read GB/s of one file, O_DIRECT against buffered with sequential readahead
    (``read_mode`` direct / buffered), alternating, median of ``repeat`` rounds each."""
    nbytes = max(ALIGN, nbytes // ALIGN * ALIGN)
    source = buffer[:nbytes] if buffer is not None else aligned_buffer(nbytes, pin=False)
    path = os.path.join(directory, f"probe-read-{uuid.uuid4().hex[:8]}.bin")
    engine = PosixEngine(replace(config, read_mode="direct"))
    seconds: dict[str, list[float]] = {"direct": [], "buffered": []}
    try:
        engine.write_file(path, bytes(ALIGN), [source], config.checksum_block)
        requests = plan_reads(path, [Need(ALIGN, nbytes, 0, 0)], max_request=config.block_size)
        for _ in range(repeat):
            for mode in seconds:
                reader = PosixEngine(replace(config, read_mode=mode))
                evict_from_page_cache([path])
                started = time.perf_counter()
                reader.read(requests, [source])
                seconds[mode].append(time.perf_counter() - started)
                reader.close()
    finally:
        engine.close()
        if os.path.exists(path):
            os.unlink(path)
    return {mode: round(nbytes / statistics.median(values) / 1e9, 3) for mode, values in seconds.items()}


def pick_read_mode(gbps: dict[str, float]) -> str:
    """The faster read mode; a near tie (within 3 %) keeps O_DIRECT, which leaves the page cache
    to the training job."""
    return "buffered" if gbps["buffered"] > (1 + TIE_TOLERANCE) * gbps["direct"] else "direct"
