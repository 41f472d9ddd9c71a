"""``dcp-nvme tune --ranks N``: N processes write (then read) at once, as a node's ranks do.

Each point is a node depth D: every process keeps ``max(1, D // N)`` requests in flight on its
own file of ``size // N`` bytes, all processes start the write together and the read together
(a barrier), and the point's time is the slowest process's: the node's checkpoint time. The best
point is stored with ``node_queue_depth = D``, so writers on a node of N ranks share D.

Each node depth is also measured staggered: the processes take turns (``host.job.node_turn``), each
with all D requests; the point's time is then the last process's end. Whichever order wins is
stored as ``node_write_order``.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

from dcp_nvme.config import ALIGN, IOConfig
from dcp_nvme.errors import BenchError
from dcp_nvme.host.job import effective_queue_depth, node_turn
from dcp_nvme.humanize import format_size, progress_bar
from dcp_nvme.observe.machine import machine_info
from dcp_nvme.tune.probe import CHOSEN_BY, engine_probe, pick_best

BARRIER_SECONDS = 3600.0


def _worker(index: int, directory: str, nbytes: int, tasks, results, barrier) -> None:
    """One process: probe each task's config in step with the others; ``None`` ends it."""
    from dcp_nvme.engines.host_io import aligned_buffer

    buffer = aligned_buffer(nbytes, pin=False)
    own = os.path.join(directory, f"rank{index}")
    os.makedirs(own, exist_ok=True)
    while True:
        task = tasks.get()
        if task is None:
            return
        config = IOConfig(**task)
        turn = (lambda: node_turn(directory)) if config.node_write_order == "staggered" else nullcontext
        try:
            probe = engine_probe(own, nbytes, config, buffer=buffer,
                                 sync=lambda: barrier.wait(BARRIER_SECONDS), turn=turn)
            results.put((index, probe.to_dict()))
        except BaseException as exc:  # the others must not wait at the barrier for this one
            barrier.abort()
            results.put((index, {"error": f"{type(exc).__name__}: {exc}"}))
            return


def combine(per_rank: list[dict[str, Any]], node_depth: int, order: str = "together") -> dict[str, Any]:
    """One point from the processes' probes: bytes add up, the slowest process sets the time."""
    first = per_rank[0]
    nbytes = sum(p["bytes"] for p in per_rank)
    write_seconds = max(p["write_seconds"] for p in per_rank)
    read_seconds = max(p["read_seconds"] for p in per_rank)

    def io(op: str) -> dict[str, Any]:
        return {"bytes": sum(p[op]["bytes"] for p in per_rank),
                "max_inflight": sum(p[op]["max_inflight"] for p in per_rank),  # an upper bound
                "latency_p50_ms": max(p[op]["latency_p50_ms"] for p in per_rank),
                "latency_p99_ms": max(p[op]["latency_p99_ms"] for p in per_rank)}

    return {"ranks": len(per_rank), "node_queue_depth": node_depth, "node_write_order": order,
            "queue_depth": first["queue_depth"],
            "block_size": first["block_size"], "direct_io": first["direct_io"], "bytes": nbytes,
            "write_seconds": round(write_seconds, 6), "read_seconds": round(read_seconds, 6),
            "write_gbps": round(nbytes / write_seconds / 1e9, 3), "read_gbps": round(nbytes / read_seconds / 1e9, 3),
            "write_io": io("write_io"), "read_io": io("read_io"), "eviction": first["eviction"],
            "per_rank": per_rank}


def node_grid(ranks: int, node_depths: list[int]) -> list[tuple[int, int]]:
    """(node depth, per-rank depth) pairs, one per distinct per-rank depth, smallest node depth first."""
    seen: dict[int, int] = {}
    for depth in sorted(node_depths):
        per_rank = effective_queue_depth(IOConfig(node_queue_depth=depth), ranks)
        seen.setdefault(per_rank, depth)
    return [(node, per_rank) for per_rank, node in sorted(seen.items())]


def order_grid(ranks: int, node_depths: list[int]) -> list[tuple[str, int, int]]:
    """(write order, node depth, per-rank depth) points: the together grid, then each node depth
    staggered (one process at a time with all of it) when there is more than one process."""
    points = [("together", node, per_rank) for node, per_rank in node_grid(ranks, node_depths)]
    if ranks > 1:
        staggered = IOConfig(node_write_order="staggered")
        points += [("staggered", node, effective_queue_depth(replace(staggered, node_queue_depth=node), ranks))
                   for node in sorted(set(node_depths))]
    return points


def sweep_ranks(directory: str, nbytes: int, ranks: int, node_depths: list[int], block_sizes: list[int],
                directs: list[bool], repeat: int = 1, progress: bool = True) -> dict[str, Any]:
    """Measure every point with ``ranks`` processes at once; return the tune document."""
    per_rank_bytes = max(ALIGN, nbytes // ranks // ALIGN * ALIGN)
    grid = [(d, order, node, per_rank, b) for d in directs for b in block_sizes
            for order, node, per_rank in order_grid(ranks, node_depths)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(ranks)
    results = context.Queue()
    inboxes = [context.Queue() for _ in range(ranks)]
    workers = [context.Process(target=_worker, args=(i, directory, per_rank_bytes, inboxes[i], results, barrier),
                               daemon=True) for i in range(ranks)]
    for worker in workers:
        worker.start()
    bar = progress_bar(len(grid) * repeat, progress, unit="pt")
    points = []
    try:
        for direct, order, node, per_rank, block in grid:
            task = {"queue_depth": per_rank, "block_size": block, "direct_io": direct, "engine": "posix",
                    "node_write_order": order}
            runs = []
            for _ in range(repeat):
                bar.set_description(f"tune {ranks} ranks {order} node qd={node} bs={format_size(block)} "
                                    f"direct={int(direct)}")
                for inbox in inboxes:
                    inbox.put(task)
                runs.append(combine(_collect(results, workers), node, order))
                bar.update(1)
            point = min(runs, key=lambda p: p["write_seconds"]) if repeat == 1 else _median(runs)
            points.append(point)
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
        for index in range(ranks):  # each process's probe files are gone; its directory goes too
            own = os.path.join(directory, f"rank{index}")
            if os.path.isdir(own) and not os.listdir(own):
                os.rmdir(own)
        bar.close()
    best = pick_best(points)
    chosen = next(p for p in points if all(p[k] == best[k] for k in CHOSEN_BY))
    best["node_queue_depth"] = chosen["node_queue_depth"]
    best["node_write_order"] = chosen["node_write_order"]
    best["ranks"] = ranks
    return {"format": "dcp_nvme.tune", "format_version": 1, "created_unix": time.time(), "best": best,
            "size": nbytes, "ranks": ranks, "repeat": repeat, "points": points,
            "machine": machine_info(directory)}


def _collect(results, workers) -> list[dict[str, Any]]:
    per_rank: dict[int, dict[str, Any]] = {}
    while len(per_rank) < len(workers):
        try:
            index, result = results.get(timeout=5)
        except queue.Empty:
            dead = [i for i, w in enumerate(workers) if not w.is_alive() and i not in per_rank]
            if dead:
                raise BenchError(f"tune --ranks: process {dead[0]} exited without a result") from None
            continue
        if "error" in result:
            raise BenchError(f"tune --ranks: process {index} failed: {result['error']}")
        per_rank[index] = result
    return [per_rank[i] for i in sorted(per_rank)]


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda p: p["write_seconds"])
    point = dict(ordered[len(ordered) // 2])
    point["repeats"] = runs
    return point

