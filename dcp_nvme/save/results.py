"""The end of a save, its records (pure): each rank's WriteResults (its index rows, its
container's blocks-table record and figures, ``write_results``); on the coordinator, all of them
gathered in the plan's order for the tables and the manifest (``collect``, ``collect_rows``), the
planner data checked as JSON (``check_planner_data``), and the save's figures per rank and per
node with the straggler, for the manifest and the log (``layer_summary``, ``rank_stats_doc``)."""

from __future__ import annotations

import gc
import itertools
import operator
import os
import statistics
from dataclasses import replace
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from dcp_nvme.errors import SaveError
from dcp_nvme.format.container import (
    FORMAT_VERSION,
    FQN_KEYS_VERSION,
    ContainerLayout,
    new_save_key,
    save_key_of,
)
from dcp_nvme.format.manifest import encode_json
from dcp_nvme.format.tables import (
    FileRecord,
    StoredItem,
    as_numpy,
    chunk_rows,
    gc_paused,
    rows_blob,
    rows_from_blobs,
)

FQN_KEYS = FORMAT_VERSION >= FQN_KEYS_VERSION
"""This writer's index rows leave out keys that are the fqn (format 4)."""

def write_results(plan: SavePlan, resolved: list, layout: ContainerLayout, written: Any,
                  stats: dict[str, Any], copies_from: int | None = None) -> list[WriteResult]:
    """DCP's WriteResults: each item's index row at its place in the container; the first also
    carries the container's blocks-table record, this rank's figures, and its rows encoded --
    the items from ``copies_from`` on (copies, ``save.copies``) apart from the others."""
    name = stats["file"]
    file_record = FileRecord(name, stats["rank"], written.size, written.data_start,
                             written.checksum_block, written.header_crc, tuple(written.crcs))
    placed = [replace(record, file=name, byte_offset=layout.data_start + layout.offsets[position])
              for position, (_, _, record) in enumerate(resolved)]
    split = len(placed) if copies_from is None else copies_from
    results = []
    for position, (item, (_, source, _)) in enumerate(zip(plan.items, resolved)):
        stored = StoredItem(placed[position])
        if position == 0:
            stored = StoredItem(placed[0], file_record, stats, rows_blob(placed[:split], FQN_KEYS), len(placed) - split,
                                rows_blob(placed[split:], FQN_KEYS) if split < len(placed) else None)
        results.append(WriteResult(index=item.index, size_in_bytes=source.numel(), storage_data=stored))
    return results


def without_copies(results: list[list[WriteResult]]) -> list[list[WriteResult]]:
    """Each rank's results less its copies (the last ``copies`` of them, as its first says)."""
    out = []
    for rank_results in results:
        head = rank_results[0].storage_data if rank_results else None
        copies = head.copies if isinstance(head, StoredItem) else 0
        out.append(rank_results[:len(rank_results) - copies] if copies else rank_results)
    return out


def copy_rows(results: list[list[WriteResult]]) -> pa.Table | None:
    """The copies' index rows of every rank, in rank order; None when no rank wrote a copy."""
    blobs = [head.copy_rows for rank_results in results if rank_results
             and isinstance(head := rank_results[0].storage_data, StoredItem) and head.copy_rows]
    return rows_from_blobs(blobs) if blobs else None


def storage_meta_doc(meta: StorageMeta) -> dict[str, Any]:
    """DCP's StorageMeta as JSON; ``load_id`` belongs to a load, never to the checkpoint."""
    return {"checkpoint_id": os.fspath(meta.checkpoint_id) if meta.checkpoint_id is not None else None,
            "save_id": meta.save_id, "modules": list(meta.modules)}


def key_from_results(results: list[list[WriteResult]]) -> str:
    for rank_results in results:
        for result in rank_results:
            key = save_key_of(result.storage_data.chunk.file)
            if key:
                return key
    return new_save_key()  # nothing was written by any rank (an empty state dict)


def collect(metadata: Metadata, results: list[list[WriteResult]]):
    """Chunk records (copies left out) in an order that gives the metadata's tensors, each with
    its chunks, in the metadata's order; file records by rank; each rank's figures.

    Linear in rows with a small constant: the ranks' order is kept when it already gives that
    (``_same_metadata``, DefaultSavePlanner's case), else items are sorted by ``(fqn, offsets)``
    tuples (a torch.Size hashes as its tuple); no MetadataIndex is made per row, and the cyclic
    GC is paused while the lists of a large save are built."""
    was = gc.isenabled()
    gc.disable()
    try:
        records, files, stats = [], [], []
        for rank_results in results:
            primary = len(rank_results) - (rank_results[0].storage_data.copies if rank_results else 0)
            for position, result in enumerate(rank_results):
                stored: StoredItem = result.storage_data
                if position < primary:  # a copy's row goes to the copies table
                    records.append(stored.chunk)
                if stored.file is not None:
                    files.append(stored.file)
                if stored.stats is not None:
                    stats.append(stored.stats)
        if not _same_metadata(records, metadata):
            planned: list[tuple] = []
            for fqn, entry in metadata.state_dict_metadata.items():
                chunks = getattr(entry, "chunks", None)
                planned.extend([(fqn, None)] if chunks is None else [(fqn, c.offsets) for c in chunks])
            keys = [(r.fqn, r.offsets if r.kind == "tensor" else None) for r in records]
            records = _in_plan_order(records, keys, planned)
    finally:
        if was:
            gc.enable()
    files.sort(key=lambda f: f.rank)
    return records, files, stats


def collect_rows(metadata: Metadata, results: list[list[WriteResult]]):
    """``collect``, with the chunk records as index rows (an Arrow table). When every rank sent
    its rows encoded (``rows_blob``, on its first result) and their order is the metadata's
    (``rows_in_metadata_order``), the rows are the ranks' concatenated: no object per row on
    the coordinator. Else ``collect``'s records, made into rows."""
    heads = [rank_results[0].storage_data for rank_results in results if rank_results]
    blobs = [head.rows for head in heads if isinstance(head, StoredItem) and head.rows]
    if len(blobs) == len(heads):  # every rank sent its rows
        rows = rows_from_blobs(blobs)
        if rows.num_rows == sum(map(len, without_copies(results))) and rows_in_metadata_order(rows, metadata):
            files = sorted((h.file for h in heads if h.file is not None), key=lambda f: f.rank)
            return rows, files, [h.stats for h in heads if h.stats is not None]
    records, files, stats = collect(metadata, results)
    return chunk_rows(records, FQN_KEYS), files, stats


def rows_in_metadata_order(rows: pa.Table, metadata: Metadata) -> bool:
    """``_same_metadata`` on index rows: the tensors first appear in the metadata's order, each
    has the metadata's chunks in its order (a bytes item: one row), by array comparisons and a
    pass over the metadata's chunks."""
    entries = metadata.state_dict_metadata
    fqn = pc.dictionary_encode(rows.column("fqn").combine_chunks())  # codes in order of first use
    if fqn.dictionary.to_pylist() != list(entries):
        return False
    codes = as_numpy(fqn.indices, np.int64)
    expected_counts, is_bytes, dims, flat = [], [], [], []
    with gc_paused():
        for entry in entries.values():
            chunks = getattr(entry, "chunks", None)
            is_bytes.append(chunks is None)
            expected_counts.append(1 if chunks is None else len(chunks))
            if chunks:
                # getattr above is duck typing mypy cannot follow: an entry with chunks is a tensor's
                dims.append(len(cast(TensorStorageMetadata, entry).size))
                flat.append(np.fromiter(itertools.chain.from_iterable(map(_offsets_of, chunks)), np.int64))
    if not np.array_equal(np.bincount(codes, minlength=len(entries)), expected_counts):
        return False
    row_bytes = as_numpy(pc.equal(rows.column("kind"), "bytes").combine_chunks().cast(pa.int8()), np.int8) > 0
    if not np.array_equal(row_bytes, np.array(is_bytes, dtype=bool)[codes]):
        return False
    tensor_rows = np.flatnonzero(~row_bytes)
    order = tensor_rows[np.argsort(codes[tensor_rows], kind="stable")]
    offsets = rows.column("chunk_offsets").combine_chunks().take(pa.array(order))
    got_lengths = np.diff(as_numpy(offsets.offsets, np.int64))
    # every chunk as long as its tensor's shape (else a mismatch: the exact path decides)
    counts = np.array([c for c, b in zip(expected_counts, is_bytes) if not b], dtype=np.int64)
    expected_lengths = np.repeat(np.array(dims, dtype=np.int64), counts[counts > 0]) if dims else np.zeros(0, np.int64)
    expected = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    return np.array_equal(got_lengths, expected_lengths) and \
        np.array_equal(as_numpy(offsets.flatten(), np.int64), expected)

_offsets_of = operator.attrgetter("offsets")


def _same_metadata(records: list, metadata: Metadata) -> bool:
    """Whether the rows in the ranks' order already give the metadata's tensors in its order,
    each with its chunks in its order (DefaultSavePlanner builds the metadata rank by rank, as
    the results come): then they are kept as they are, with no sort."""
    by_fqn: dict[str, list] = {}
    for r in records:
        by_fqn.setdefault(r.fqn, []).append(r.offsets if r.kind == "tensor" else None)
    if list(by_fqn) != list(metadata.state_dict_metadata):
        return False
    for fqn, entry in metadata.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        if by_fqn[fqn] != ([None] if chunks is None else [c.offsets for c in chunks]):
            return False
    return True


def _in_plan_order(records: list, keys: list[tuple], planned: list[tuple]) -> list:
    order: dict[tuple, int] = {}
    for key in planned:
        order.setdefault(key, len(order))
    written = set(keys)
    missing = [key for key in order if key not in written]
    if missing:
        fqn, offsets = missing[0]
        raise SaveError(f"no rank wrote {len(missing)} item(s) of the plan, e.g. {MetadataIndex(fqn, offsets)}")
    end = len(order)
    ranks = [order.get(key, end) for key in keys]
    return [records[i] for i in sorted(range(len(records)), key=ranks.__getitem__)]


def check_planner_data(plans: list[SavePlan]) -> None:
    """Every rank's planner data is JSON we can store (``encode_json`` raises otherwise). Ranks
    of one model send equal planner data (DefaultSavePlanner's flattening map): each distinct
    value is encoded once, not once per rank."""
    last: list[Any] = []
    for plan in plans:
        data = plan.planner_data
        if last and _same(data, last[0]):
            continue
        encode_json(data)
        last = [data]


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # e.g. a tensor in planner data: encode_json then names it
        return False


RANK_STATS_INLINE = 64
"""Up to this many ranks, manifest.json carries each rank's write figures; beyond, a summary:
every rank parses manifest.json on load, so it must not grow with the world size."""


def rank_stats_doc(rank_stats: list[dict[str, Any]], layers: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``ranks`` and ``layers`` entries: in full for a small world; for a large
    one, the straggler, the throttled ranks and the spread of the ranks' bandwidth (pure)."""
    if len(rank_stats) <= RANK_STATS_INLINE:
        return {"ranks": rank_stats, "layers": layers}
    speeds = sorted(r["gbps"] for r in layers["ranks"])
    nodes = sorted(n["gbps"] for n in layers["nodes"].values())
    return {"layers": {
        "straggler": layers["straggler"], "throttled_ranks": layers["throttled_ranks"][:RANK_STATS_INLINE],
        "summary": {"ranks": len(speeds), "nodes": len(nodes),
                    "rank_gbps": _spread(speeds), "node_gbps": _spread(nodes)}}}


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"min": values[0], "median": values[len(values) // 2], "max": values[-1]}


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
