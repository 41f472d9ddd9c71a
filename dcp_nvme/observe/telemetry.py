"""One save seen through the layers: per rank, per node, and the straggler (pure: stats in).

At scale the slowest rank is the checkpoint time, so the summary names it and says how far it
is behind the median. Per node, ``max_inflight_sum`` adds the ranks' own maxima: an upper bound
of what the node's drive had queued at once (the ranks' peaks need not coincide).
"""

from __future__ import annotations

import statistics
from typing import Any


def _write_seconds(stats: dict[str, Any]) -> float:
    phases = stats.get("phases") or {}
    return float(phases.get("write") or (stats.get("io") or {}).get("seconds") or 0.0)


def layer_summary(rank_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Ranks, nodes and the straggler from the per-rank write statistics of one save."""
    ranks = []
    for stats in sorted(rank_stats, key=lambda s: s.get("rank", 0)):
        io = stats.get("io") or {}
        seconds = _write_seconds(stats)
        drive = stats.get("drive") or {}
        ranks.append({
            "rank": stats.get("rank"), "host": stats.get("host"), "bytes": stats.get("bytes", 0),
            "seconds": round(seconds, 6),
            "gbps": round(stats.get("bytes", 0) / seconds / 1e9, 3) if seconds > 0 else 0.0,
            "max_inflight": io.get("max_inflight", 0),
            "queue_depth": (stats.get("config") or {}).get("queue_depth"),
            "local_ranks": stats.get("local_ranks"),
            "drive_throttled": bool(drive.get("throttled")),
        })
    nodes: dict[str, dict[str, Any]] = {}
    for entry in ranks:
        node = nodes.setdefault(str(entry["host"]), {"ranks": [], "bytes": 0, "seconds": 0.0,
                                                     "max_inflight_sum": 0, "queue_depth_sum": 0})
        node["ranks"].append(entry["rank"])
        node["bytes"] += entry["bytes"]
        node["seconds"] = max(node["seconds"], entry["seconds"])
        node["max_inflight_sum"] += entry["max_inflight"]
        node["queue_depth_sum"] += entry["queue_depth"] or 0
    for node in nodes.values():
        node["gbps"] = round(node["bytes"] / node["seconds"] / 1e9, 3) if node["seconds"] > 0 else 0.0
    summary: dict[str, Any] = {"ranks": ranks, "nodes": nodes, "straggler": None,
                               "throttled_ranks": [r["rank"] for r in ranks if r["drive_throttled"]]}
    timed = [r for r in ranks if r["seconds"] > 0]
    if timed:
        slowest = max(timed, key=lambda r: r["seconds"])
        median = statistics.median(r["seconds"] for r in timed)
        summary["straggler"] = {"rank": slowest["rank"], "host": slowest["host"],
                                "seconds": slowest["seconds"], "median_seconds": round(median, 6),
                                "slowest_over_median": round(slowest["seconds"] / median, 3)}
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """One log line: nodes' bandwidth and depth, and the straggler."""
    parts = [f"node {host}: {len(n['ranks'])} rank(s), {n['gbps']:.2f} GB/s, in flight <= {n['max_inflight_sum']} "
             f"(budget {n['queue_depth_sum']})" for host, n in summary["nodes"].items()]
    straggler = summary.get("straggler")
    if straggler:
        parts.append(f"slowest rank {straggler['rank']} {straggler['seconds']:.3f} s = "
                     f"{straggler['slowest_over_median']:.2f} x median")
    if summary.get("throttled_ranks"):
        parts.append(f"drive throttled under rank(s) {summary['throttled_ranks']}")
    return "; ".join(parts)
