"""What the ranks wrote, as records: each rank's WriteResults (its index rows, its container's
blocks-table record and figures), and on the coordinator all of them gathered in the plan's order
for the tables and the manifest (pure)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
)
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import SaveError
from ..format.names import (
    new_save_key,
    save_key_of,
)
from ..format.placement import ContainerLayout
from ..format.tables import FileRecord, StoredItem


def write_results(plan: SavePlan, resolved: list, layout: ContainerLayout, written: Any,
             stats: dict[str, Any]) -> list[WriteResult]:
    """DCP's WriteResults: each item's index row at its place in the container; the first also
    carries the container's blocks-table record and this rank's figures."""
    name = stats["file"]
    file_record = FileRecord(name, stats["rank"], written.size, written.data_start,
                             written.checksum_block, written.header_crc, tuple(written.crcs))
    results = []
    for position, (item, (_, source, record)) in enumerate(zip(plan.items, resolved)):
        placed = replace(record, file=name, byte_offset=layout.data_start + layout.offsets[position])
        stored = StoredItem(placed, file_record if position == 0 else None, stats if position == 0 else None)
        results.append(WriteResult(index=item.index, size_in_bytes=source.numel(), storage_data=stored))
    return results


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
    """Chunk records in the metadata's order, file records by rank, and each rank's figures."""
    order: dict[MetadataIndex, int] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        if chunks is None:
            order[MetadataIndex(fqn)] = len(order)
        else:
            for chunk in chunks:
                order[MetadataIndex(fqn, chunk.offsets)] = len(order)
    records, files, stats = [], [], []
    for rank_results in results:
        for result in rank_results:
            stored: StoredItem = result.storage_data
            records.append(stored.chunk)
            if stored.file is not None:
                files.append(stored.file)
            if stored.stats is not None:
                stats.append(stored.stats)
    written = {r.index for r in records}
    missing = [index for index in order if index not in written]
    if missing:
        raise SaveError(f"no rank wrote {len(missing)} item(s) of the plan, e.g. {missing[0]}")
    records.sort(key=lambda r: order.get(r.index, len(order)))
    files.sort(key=lambda f: f.rank)
    return records, files, stats
