"""Checks of what a checkpoint says about itself, before any of it is trusted: the manifest
document, the index rows (each chunk inside its tensor, a tensor's chunks tiling it), the blocks
table against the manifest, and each container's header against the index."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, TypeGuard

import crc32c

from dcp_nvme.errors import (
    ChecksumMismatchError,
    ManifestError,
)
from dcp_nvme.format.container import (
    MANIFEST,
    MAX_HEADER,
    MAX_NDIM,
    RAW_DTYPE,
    HeaderItem,
    check_name,
    check_save_key,
    dtype_itemsize,
    header_length,
    parse_header,
    rank_of,
    stored_as,
    tables_of,
)
from dcp_nvme.format.tables import MAX_CHECKSUM_BLOCK, MAX_TABLE, MIN_CHECKSUM_BLOCK, ChunkRecord, FileRecord

MAX_WORLD = 1 << 20

class Manifest(Protocol):
    """What the checks read of ``format.manifest.Manifest`` (which calls them: no import back)."""

    doc: dict[str, Any]

    def rows_of_file(self, name: str) -> Sequence[ChunkRecord]: ...

    def rows_before(self, data_start: dict[str, int]) -> Sequence[ChunkRecord]: ...


def _is_count(value: object, limit: int = 1 << 62) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def check_doc(doc: dict[str, Any], where: str) -> None:
    """The manifest's names and numbers: a hex save key, table entries and a files list whose
    names are bare file names of this save, sizes and ranks in range. Raises ManifestError."""
    for required in ("save_key", "index", "blocks", "files", "world_size"):
        if required not in doc:
            raise ManifestError(f"{where} lacks {required!r}")
    key = check_save_key(doc["save_key"], where)
    world = doc["world_size"]
    if not _is_count(world, MAX_WORLD) or world == 0:
        raise ManifestError(f"{where}: world_size {world!r} is not a rank count")
    for kind, entry in tables_of(doc):
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: {kind!r} is not an object")
        check_name(entry.get("name"), kind, key, f"{where} {kind!r}")
        if not _is_count(entry.get("size"), MAX_TABLE) or not _is_count(entry.get("crc32c"), 0xFFFFFFFF):
            raise ManifestError(f"{where}: {kind!r} has a bad size or crc32c ({entry.get('size')!r}, "
                                f"{entry.get('crc32c')!r})")
        if "rows" in entry and not _is_count(entry["rows"]):
            raise ManifestError(f"{where}: {kind!r} has a bad row count {entry['rows']!r}")
    files = doc["files"]
    if not isinstance(files, list) or len(files) > world:
        raise ManifestError(f"{where}: 'files' is not a list of at most world_size ({world}) files")
    seen: set[str] = set()
    for entry in files:
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: an entry of 'files' is not an object")
        name = check_name(entry.get("name"), "data", key, f"{where} 'files'")
        rank, size = entry.get("rank"), entry.get("size")
        if name in seen:
            raise ManifestError(f"{where}: file {name} is listed twice")
        seen.add(name)
        if not _is_count(rank) or rank >= world or rank != rank_of(name):
            raise ManifestError(f"{where}: file {name} has rank {rank!r} (world_size {world})")
        if not _is_count(size) or size < 8:
            raise ManifestError(f"{where}: file {name} has a bad size {size!r}")
    if "topology" in doc:
        check_topology(doc["topology"], world, where)


TOPOLOGY_MODES = ("shared", "node-local")
MAX_NODE_NAME = 255


def check_topology(topology: Any, world: int, where: str) -> None:
    """Where the ranks' files were written: a mode, node names, and each rank's node index."""
    if not isinstance(topology, dict) or topology.get("mode") not in TOPOLOGY_MODES:
        raise ManifestError(f"{where}: 'topology' is not an object with a mode of {TOPOLOGY_MODES}")
    nodes, rank_nodes = topology.get("nodes"), topology.get("rank_nodes")
    if (not isinstance(nodes, list) or not 0 < len(nodes) <= world
            or not all(isinstance(n, str) and 0 < len(n) <= MAX_NODE_NAME for n in nodes)
            or len(set(nodes)) != len(nodes)):
        raise ManifestError(f"{where}: 'topology' names its nodes badly: {str(nodes)[:200]}")
    if (not isinstance(rank_nodes, list) or len(rank_nodes) != world
            or not all(_is_count(i) and i < len(nodes) for i in rank_nodes)):
        raise ManifestError(f"{where}: 'topology' does not give a node for each of {world} ranks")


def check_chunks(chunks: Sequence[ChunkRecord], doc: dict[str, Any], where: str) -> None:
    """Every index row against itself, the manifest's file sizes and the other rows: names of
    listed files; known kinds and dtypes; a chunk inside its tensor, of exactly numel x itemsize
    bytes, inside its file; no two rows share bytes; each tensor's chunks tiling it exactly.
    (``column_checks.check_columns`` runs the same checks on the index as columns.)"""
    sizes = {f["name"]: f["size"] for f in doc["files"]}
    key = doc["save_key"]
    per_file: dict[str, list[ChunkRecord]] = {}
    per_fqn: dict[str, list[ChunkRecord]] = {}
    for chunk in chunks:
        check_row(chunk, sizes, key, where)
        per_file.setdefault(chunk.file, []).append(chunk)
        per_fqn.setdefault(chunk.fqn, []).append(chunk)
    for name, rows in per_file.items():
        check_file_rows(name, rows, where)
    for fqn, rows in per_fqn.items():
        message = tiling_problem(rows)
        if message:
            raise ManifestError(f"{where}: {fqn!r}: {message}")


def check_row(chunk: ChunkRecord, sizes: dict[str, int], key: str, where: str) -> None:
    """One index row on its own and against its file's size (``sizes``: the manifest's)."""
    item = f"{where}: row {chunk.key!r} of {chunk.fqn!r}"
    if not chunk.key or not chunk.fqn:
        raise ManifestError(f"{item}: an empty name")
    check_name(chunk.file, "data", key, item)
    if chunk.file not in sizes:
        raise ManifestError(f"{item}: names file {chunk.file}, which {MANIFEST} does not list")
    message = chunk_problem(chunk)
    if message:
        raise ManifestError(f"{item}: {message}")
    if chunk.byte_offset < 8 or chunk.byte_offset + chunk.length > sizes[chunk.file]:
        raise ManifestError(f"{item}: bytes [{chunk.byte_offset}, {chunk.byte_offset + chunk.length}) "
                            f"are outside {chunk.file} ({sizes[chunk.file]} bytes)")


def check_file_rows(name: str, rows: Sequence[ChunkRecord], where: str) -> None:
    """The rows of one file: each key once, no two sharing bytes."""
    keys: set[str] = set()
    end, last = -1, None
    for chunk in sorted(rows, key=lambda c: (c.byte_offset, c.length)):
        if chunk.key in keys:
            raise ManifestError(f"{where}: item key {chunk.key!r} appears twice in {name}")
        keys.add(chunk.key)
        if chunk.byte_offset < end and chunk.length:
            assert last is not None  # end > -1: set with last (offsets are >= 8: check_row ran first)
            raise ManifestError(f"{where}: rows {last.key!r} and {chunk.key!r} share bytes of {name}")
        if chunk.byte_offset + chunk.length > end:
            end, last = chunk.byte_offset + chunk.length, chunk


def chunk_problem(chunk: ChunkRecord) -> str:
    """What is wrong with one index row on its own, or ""."""
    if chunk.kind == "bytes":
        if chunk.offsets or chunk.sizes or chunk.global_shape or chunk.dtype != "uint8":
            return "a non-tensor item with a shape or dtype"
        return ""
    if chunk.kind != "tensor":
        return f"unknown kind {chunk.kind!r}"
    try:
        itemsize = dtype_itemsize(chunk.dtype)
    except ManifestError as exc:
        return str(exc)
    dims = (len(chunk.offsets), len(chunk.sizes), len(chunk.global_shape))
    if len(set(dims)) != 1 or dims[0] > MAX_NDIM:
        return f"offsets/sizes/shape have ranks {dims}"
    if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, chunk.global_shape)):
        return f"chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} lies outside the shape {list(chunk.global_shape)}"
    if math.prod(chunk.sizes) * itemsize != chunk.length:
        return f"length {chunk.length} is not {list(chunk.sizes)} x {itemsize} bytes"
    return ""


def tiling_problem(rows: Sequence[ChunkRecord]) -> str:
    """Whether one fqn's rows agree and tile its tensor exactly (no overlap, no hole), or ""."""
    first = rows[0]
    if any(r.kind != first.kind or r.dtype != first.dtype or r.global_shape != first.global_shape
           for r in rows):
        return "its rows disagree on kind, dtype or shape"
    if first.kind == "bytes":
        return "" if len(rows) == 1 else f"a non-tensor item stored {len(rows)} times"
    total = sum(math.prod(r.sizes) for r in rows)
    if total != math.prod(first.global_shape):
        return (f"its chunks hold {total} of {math.prod(first.global_shape)} elements "
                "(they overlap or leave a hole)")
    if len(rows) > 1:
        # equal counts, so any overlap also leaves a hole: sweep along the most-cut dimension
        dim = max(range(len(first.offsets)), key=lambda d: len({r.offsets[d] for r in rows}), default=0)
        pair = first_overlap([(r.offsets, r.sizes) for r in rows if math.prod(r.sizes)], dim)
        if pair:
            return f"chunks at {list(pair[0])} and {list(pair[1])} overlap"
    return ""


def first_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], dim: int):
    """The offsets of two boxes ``(offsets, sizes)`` that overlap, or None (pure). A sweep along
    ``dim``: each box is compared only with the boxes that start before it ends there, by
    index (no copy of the rest of the list), so a one-dimensional cut costs O(k log k)."""
    boxes = sorted(boxes, key=lambda b: b[0][dim])
    count = len(boxes)
    for i in range(count):
        a_off, a_size = boxes[i]
        a_end = a_off[dim] + a_size[dim]
        j = i + 1
        while j < count:
            b_off, b_size = boxes[j]
            if b_off[dim] >= a_end:
                break
            if all(b_off[d] < a_off[d] + a_size[d] and a_off[d] < b_off[d] + b_size[d]
                   for d in range(len(a_off))):
                return a_off, b_off
            j += 1
    return None


def check_files(files: dict[str, FileRecord], manifest: Manifest, where: str) -> None:
    """The blocks table: the manifest's files, each with a sane checksum block, a data start
    inside the file and past a bounded header, one crc per block; every chunk in a data region."""
    listed = {f["name"]: f for f in manifest.doc["files"]}
    if set(files) != set(listed):
        raise ManifestError(f"{where} lists {sorted(set(files) ^ set(listed))[:3]} differently from {MANIFEST}")
    for name, record in files.items():
        entry = listed[name]
        if record.rank != entry["rank"] or record.size != entry["size"]:
            raise ManifestError(f"{where}: {name} has rank {record.rank}, {record.size} bytes; {MANIFEST} "
                                f"says rank {entry['rank']}, {entry['size']} bytes")
        block = record.checksum_block
        if not MIN_CHECKSUM_BLOCK <= block <= MAX_CHECKSUM_BLOCK or block & (block - 1):
            raise ManifestError(f"{where}: {name} has checksum_block {block}, not a power of two in "
                                f"[{MIN_CHECKSUM_BLOCK}, {MAX_CHECKSUM_BLOCK}]")
        if not 8 <= record.data_start <= min(record.size, 8 + MAX_HEADER):
            raise ManifestError(f"{where}: {name} has data_start {record.data_start}, outside its "
                                f"{record.size} bytes or past the largest header")
        if not _is_count(record.header_crc, 0xFFFFFFFF):
            raise ManifestError(f"{where}: {name} has a bad header_crc {record.header_crc}")
        if len(record.crcs) != -(-record.data_size // record.checksum_block):
            raise ManifestError(f"{where}: {name} has {len(record.crcs)} checksums for a "
                                f"{record.data_size}-byte data region in blocks of {record.checksum_block}")
    for chunk in manifest.rows_before({name: record.data_start for name, record in files.items()}):
        record = files[chunk.file]
        if chunk.byte_offset < record.data_start:
            raise ManifestError(f"{where}: row {chunk.key!r} of {chunk.fqn!r} starts at byte "
                                f"{chunk.byte_offset}, inside the header of {chunk.file} (data starts at "
                                f"{record.data_start})")


def read_header(store, name: str, data_start: int | None = None) -> tuple[dict, list[HeaderItem], int, bytes]:
    """A container's safetensors header, reading only the header bytes (bounded by
    ``MAX_HEADER`` and the real file size): ``(metadata, items, data_start, header_bytes)``."""
    size = store.size(name)
    if data_start is not None and 8 <= data_start <= size:
        prefix = bytearray(data_start)  # one read: the blocks table says where the header ends
        got = store.read_into(name, 0, memoryview(prefix))
        if got == data_start and 8 + header_length(prefix[:8], size, name) == data_start:
            metadata, items, start = parse_header(prefix, name)
            return metadata, items, start, bytes(prefix)
    first = bytearray(8)
    got = store.read_into(name, 0, memoryview(first))
    length = header_length(first[:got], size, name)
    prefix = bytearray(8 + length)
    got = store.read_into(name, 0, memoryview(prefix))
    metadata, items, start = parse_header(prefix[:got], name)
    return metadata, items, start, bytes(prefix[:got])


def check_container(store, record: FileRecord, manifest: Manifest, location: str, verify: bool = True) -> None:
    """Before a container's data is read: it is a regular file whose own safetensors header
    places, types and shapes every item as the index does, and (``verify``) matches its crc32c."""
    _, items, data_start, header = read_header(store, record.name, record.data_start)
    where = f"{location}: {record.name}"
    if data_start != record.data_start:
        raise ManifestError(f"{where}: its safetensors header puts the data at byte {data_start}, "
                            f"the blocks table at {record.data_start}; the checkpoint is damaged")
    if verify and crc32c.crc32c(header) != record.header_crc:
        raise ChecksumMismatchError(store.path(record.name), 0, data_start, record.header_crc,
                                    crc32c.crc32c(header), "the safetensors header")
    problems = header_mismatches(items, manifest.rows_of_file(record.name), data_start)
    if problems:
        raise ManifestError(f"{where} and the index disagree: {'; '.join(problems[:3])}; the "
                            "checkpoint is damaged or forged")


def header_mismatches(items: Sequence[HeaderItem], rows: Sequence[ChunkRecord], data_start: int) -> list[str]:
    """Where a container's safetensors header and the index rows of that file disagree (pure):
    every row must be the header item of its key, at the same bytes, with the dtype and shape
    it is stored under (``format.container.stored_as``; raw U8 bytes are accepted for any dtype)."""
    problems = []
    by_key = {i.key: i for i in items}
    keys = {r.key for r in rows}
    extra, missing = sorted(set(by_key) - keys), sorted(keys - set(by_key))
    if extra:
        problems.append(f"the safetensors header has item(s) the index lacks: {extra[:5]}")
    if missing:
        problems.append(f"the index has item(s) the safetensors header lacks: {missing[:5]}")
    for row in rows:
        item = by_key.get(row.key)
        if item is None:
            continue
        if (data_start + item.start, item.nbytes) != (row.byte_offset, row.length):
            problems.append(f"item {row.key!r}: the safetensors header says bytes "
                            f"[{data_start + item.start}, {data_start + item.end}), the index "
                            f"[{row.byte_offset}, {row.byte_offset + row.length})")
            continue
        raw: tuple[str, tuple[int, ...]] = (RAW_DTYPE, (row.length,))
        if row.kind == "bytes":
            expected = [raw]
        else:
            try:
                dtype_itemsize(row.dtype)  # a name that is no dtype is a problem of its own
                expected = [stored_as(row.dtype, row.sizes, row.length), raw]
            except ManifestError as exc:
                problems.append(f"item {row.key!r}: {exc}")
                continue
        if (item.st_dtype, item.shape) not in expected:
            want = expected[0]
            problems.append(f"item {row.key!r}: the safetensors header says {item.st_dtype} "
                            f"{list(item.shape)}, the index {row.dtype} {list(row.sizes)} (stored as "
                            f"{want[0]} {list(want[1])})")
    return problems
