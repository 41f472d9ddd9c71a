"""Where a node-local checkpoint's index names a file on another node's disk: the other places
the chunk is stored (the copies ``save.copies`` wrote on each node), each checked to be that
chunk. Pure: the reader (``load.reader``) and a restore (``peers.restore``) both use them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.tables import ChunkRecord


def local_copies(manifest: Manifest, here: set[str], storage_data: Mapping[Any, ChunkRecord],
                 location: str) -> dict[tuple, ChunkRecord]:
    """``(fqn, offsets)`` -> the index row moved to its copy in a file ``here``, for each chunk
    whose index row names a file not here. Empty when no such chunk has a copy here.

    A copy must be the chunk its index row describes -- same kind, dtype, shape and length --
    else the manifest is refused (its bytes would land in a tensor of another shape)."""
    absent = set(manifest.file_names) - here
    if not absent or not manifest.copies:
        return {}
    found: dict[tuple, ChunkRecord] = {}
    for copy in manifest.copies:
        key = (copy.fqn, copy.offsets if copy.kind == "tensor" else None)
        if copy.file not in here or key in found:
            continue
        primary = _get(storage_data, copy.index)
        if primary is None:
            raise ManifestError(f"{location}: the copies table holds {copy.fqn!r} at {list(copy.offsets)} in "
                                f"{copy.file}, a chunk the index does not have; the checkpoint is damaged")
        if primary.file not in absent:
            continue
        if (copy.kind, copy.dtype, copy.sizes, copy.length) != (primary.kind, primary.dtype, primary.sizes,
                                                                  primary.length):
            raise ManifestError(
                f"{location}: the copy of {copy.fqn!r} in {copy.file} is {copy.kind} {copy.dtype} "
                f"{list(copy.sizes)} ({copy.length} bytes), the index says {primary.kind} {primary.dtype} "
                f"{list(primary.sizes)} ({primary.length} bytes); the checkpoint is damaged or forged")
        found[key] = replace(primary, file=copy.file, byte_offset=copy.byte_offset, key=copy.key)
    return found


def _get(storage_data: Mapping[Any, ChunkRecord], index: Any) -> ChunkRecord | None:
    try:
        return storage_data[index]  # DCP's dict, or the index's lazy view
    except KeyError:
        return None


def places_of(manifest: Manifest, storage_data: Mapping[Any, ChunkRecord], keys: set[tuple],
              location: str) -> dict[tuple, list[ChunkRecord]]:
    """For each chunk of ``keys``: every place it is stored, the index's row first, then its
    copies (each checked as ``local_copies`` checks it), as rows a read can use."""
    places: dict[tuple, list[ChunkRecord]] = {}
    for copy in manifest.copies:
        key = (copy.fqn, copy.offsets if copy.kind == "tensor" else None)
        if key not in keys:
            continue
        primary = _get(storage_data, copy.index)
        if primary is None or (copy.kind, copy.dtype, copy.sizes, copy.length) != (
                primary.kind, primary.dtype, primary.sizes, primary.length):
            raise ManifestError(f"{location}: the copy of {copy.fqn!r} in {copy.file} is not the chunk the "
                                "index describes; the checkpoint is damaged or forged")
        places.setdefault(key, [primary]).append(
            replace(primary, file=copy.file, byte_offset=copy.byte_offset, key=copy.key))
    return places
