"""The on-disk schema: a JSON manifest (the commit marker) naming two Parquet tables.

    manifest.json          format version, world size, DCP planner data, config, timings, and
                           the name, size and crc32c of the two tables below. Written last:
                           the checkpoint exists once this file does.
    index.<key>.parquet    one row per stored chunk: fqn, chunk offsets/sizes, global shape,
                           dtype, file, byte offset, length.
    blocks.<key>.parquet   one row per container file: size, data start, crc32c per block.

``<key>`` is a random id per save, so an overwrite never touches the files of the checkpoint it
replaces until its own manifest is committed. Nothing here is pickled.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .checksums import check_table
from .errors import (
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ManifestError,
    TableError,
)
from .format import (  # noqa: F401  (names re-exported: the manifest is where callers look)
    DCP_METADATA,
    MANIFEST,
    MAX_HEADER,
    MAX_NDIM,
    RAW_DTYPE,
    HeaderItem,
    check_name,
    check_save_key,
    data_file_name,
    dtype_name,
    header_length,
    parse_dtype,
    parse_header,
    rank_of,
    save_key_of,
    stored_as,
    table_name,
)
from .store import fsync_dir

FORMAT = "dcp_nvme"
FORMAT_VERSION = 2
"""2: a container's data may be preceded by ``__pad__.N`` padding entries (zero-copy placement).
A reader before 2 would call such a file damaged; the bump makes it ask for an upgrade instead.
This reader loads 1 and 2 alike (padding is dropped by ``format.parse_header``)."""
OLDEST_FORMAT_VERSION = 1


def new_save_key() -> str:
    return secrets.token_hex(4)


_TEMP_RE = re.compile(r"^\.(manifest\.json|(?:index|blocks)\.[0-9a-f]+\.parquet)\.tmp-([0-9A-Za-z]+)$")


def temp_name(name: str, save_key: str) -> str:
    """Where ``name`` is written before it is renamed into place; it names the save."""
    return f".{name}.tmp-{save_key}"


def temp_of(name: str) -> tuple[str, str] | None:
    """(final name, save key or legacy pid) of one of our commit temp files, else None.

    Other hidden temp files of the directory (the drain journal's) are not ours."""
    match = _TEMP_RE.match(name)
    return (match.group(1), match.group(2)) if match else None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_commit_file(directory: str | os.PathLike, name: str, data: bytes, save_key: str) -> None:
    """Write ``directory/name`` all or nothing: temp file, write, fsync, rename, fsync of the dir.

    A failure removes the temp file and raises OSError naming the file and the step (the
    errno is kept: ENOSPC stays ENOSPC). Until the rename nothing under ``name`` changed."""
    directory = os.fspath(directory)
    temp = os.path.join(directory, temp_name(name, save_key))
    final = os.path.join(directory, name)
    step, subject = "create", temp
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            step = "write"
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            step = "fsync"
            os.fsync(fd)
        finally:
            os.close(fd)
        step, subject = "rename into place", final
        os.replace(temp, final)
    except OSError as exc:
        _unlink_quietly(temp)
        raise OSError(exc.errno, f"cannot {step} {subject} while saving: {exc.strerror or exc}") from exc
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise OSError(exc.errno, f"{final} was renamed into place but the fsync of {directory} "
                                 f"failed: {exc.strerror or exc}; it may not survive a power loss") from exc


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ChunkRecord:
    """Where one stored chunk (or non-tensor item) lives."""

    fqn: str
    kind: str  # "tensor" or "bytes"
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    file: str
    byte_offset: int
    length: int
    key: str

    @property
    def index(self) -> MetadataIndex:
        return MetadataIndex(self.fqn, self.offsets if self.kind == "tensor" else None)


@dataclass(frozen=True)
class FileRecord:
    """One container file and the crc32c of each of its data blocks."""

    name: str
    rank: int
    size: int
    data_start: int
    checksum_block: int
    header_crc: int
    crcs: tuple[int, ...]

    @property
    def data_size(self) -> int:
        return self.size - self.data_start


@dataclass(frozen=True)
class StoredItem:
    """A WriteResult's ``storage_data``: the chunk, plus its file on one result per file."""

    chunk: ChunkRecord
    file: FileRecord | None = None
    stats: dict[str, Any] | None = None


_CHUNK_SCHEMA = pa.schema([
    ("fqn", pa.string()),
    ("kind", pa.string()),
    ("chunk_offsets", pa.list_(pa.int64())),
    ("chunk_sizes", pa.list_(pa.int64())),
    ("global_shape", pa.list_(pa.int64())),
    ("dtype", pa.string()),
    ("file", pa.string()),
    ("byte_offset", pa.int64()),
    ("length", pa.int64()),
    ("key", pa.string()),
])

_FILE_SCHEMA = pa.schema([
    ("name", pa.string()),
    ("rank", pa.int32()),
    ("size", pa.int64()),
    ("data_start", pa.int64()),
    ("checksum", pa.string()),
    ("checksum_block", pa.int64()),
    ("header_crc", pa.int64()),
    ("crcs", pa.list_(pa.uint32())),
])


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def chunks_table(chunks: Sequence[ChunkRecord]) -> bytes:
    columns = {
        "fqn": [c.fqn for c in chunks],
        "kind": [c.kind for c in chunks],
        "chunk_offsets": [list(c.offsets) for c in chunks],
        "chunk_sizes": [list(c.sizes) for c in chunks],
        "global_shape": [list(c.global_shape) for c in chunks],
        "dtype": [c.dtype for c in chunks],
        "file": [c.file for c in chunks],
        "byte_offset": [c.byte_offset for c in chunks],
        "length": [c.length for c in chunks],
        "key": [c.key for c in chunks],
    }
    return _parquet_bytes(pa.table(columns, schema=_CHUNK_SCHEMA))


def files_table(files: Sequence[FileRecord]) -> bytes:
    columns = {
        "name": [f.name for f in files],
        "rank": [f.rank for f in files],
        "size": [f.size for f in files],
        "data_start": [f.data_start for f in files],
        "checksum": ["crc32c"] * len(files),
        "checksum_block": [f.checksum_block for f in files],
        "header_crc": [f.header_crc for f in files],
        "crcs": [list(f.crcs) for f in files],
    }
    return _parquet_bytes(pa.table(columns, schema=_FILE_SCHEMA))


# --------------------------------------------------------------------------- reading tables
#
# A table is input: its row count and value counts come from the Parquet footer and are checked
# against the manifest and against the checkpoint's real size before a row is materialised.

MAX_MANIFEST = 256 << 20
"""Largest manifest.json accepted (planner data included)."""
MAX_TABLE = 1 << 30
"""Largest index or blocks table accepted."""
FREE_ROWS = 4096
"""Index rows (and 64x that many checksums) accepted without looking at the data files' sizes."""
MIN_ITEM_HEADER = 40
"""Fewest bytes one item takes in a safetensors header: a row needs an item, an item its header."""
MIN_CHECKSUM_BLOCK = 512
MAX_CHECKSUM_BLOCK = 1 << 20
"""Checksum blocks are powers of two in [MIN, MAX] (the writer's are gcd(block_size, 256 KiB))."""
MAX_ROW_BYTES = 4096
"""Average decoded bytes per row allowed (names, shapes) before a table is refused as a bomb."""
MAX_WORLD = 1 << 20


def _footer(data: bytes, what: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{what} is not a readable Parquet file: {exc}") from None


def _column_values(meta: pq.FileMetaData, column: str) -> int:
    """Values the footer declares for a (list) column, over all row groups."""
    return sum(meta.row_group(g).column(c).num_values for g in range(meta.num_row_groups)
               for c in range(meta.num_columns)
               if meta.row_group(g).column(c).path_in_schema.split(".")[0] == column)


def _check_counts(parquet: pq.ParquetFile, what: str, max_rows: int,
                  long_column: str | None = None, max_long: int = 0) -> None:
    """Rows, values per column and decoded bytes the footer declares, against the bounds.

    Every column holds at most ``MAX_NDIM`` values a row, but ``long_column`` (the crcs) holds
    at most ``max_long`` in all."""
    meta = parquet.metadata
    rows = meta.num_rows
    if rows > max_rows:
        raise ManifestError(f"{what} declares {rows} rows, more than the {max_rows} this checkpoint can "
                            "hold; the table is damaged or forged")
    decoded, long_values = 0, 0
    for group in range(meta.num_row_groups):
        row_group = meta.row_group(group)
        for column in range(row_group.num_columns):
            chunk = row_group.column(column)
            decoded += max(chunk.total_uncompressed_size, 0)
            if chunk.path_in_schema.split(".")[0] == long_column:
                long_values += chunk.num_values
            elif chunk.num_values > rows * MAX_NDIM + 16:
                raise ManifestError(f"{what}: column {chunk.path_in_schema} declares {chunk.num_values} "
                                    f"values for {rows} rows; the table is damaged or forged")
    if long_values > max_long:
        raise ManifestError(f"{what}: column {long_column} declares {long_values} values, more than the "
                            f"{max_long} this checkpoint can hold; the table is damaged or forged")
    if decoded > rows * MAX_ROW_BYTES + 8 * long_values + (1 << 20):
        raise ManifestError(f"{what} decodes to {decoded} bytes for {rows} rows; the table is damaged "
                            "or forged")


def _read_table(data: bytes, schema: pa.Schema, what: str, max_rows: int,
                long_column: str | None = None, max_long: int = 0) -> dict[str, list]:
    parquet = _footer(data, what)
    missing = [n for n in schema.names if n not in parquet.schema_arrow.names]
    if missing:
        raise ManifestError(f"{what} lacks column(s) {missing}")
    _check_counts(parquet, what, max_rows, long_column, max_long)
    try:
        # no Arrow thread pool: its threads, once started, can abort the interpreter at exit
        # ("terminate called without an active exception", apache/arrow#34314; 1 in 100 CLI runs
        # under load here). A single-threaded read of a small index starts none.
        table = parquet.read(columns=schema.names, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{what} is not a readable Parquet file: {exc}") from None
    for name in schema.names:
        column = table.column(name)
        if column.type != schema.field(name).type:
            raise ManifestError(f"{what}: column {name} is {column.type}, expected {schema.field(name).type}")
        nulls = column.null_count
        if pa.types.is_list(column.type):
            nulls += pc.list_flatten(column).null_count
        if nulls:
            raise ManifestError(f"{what}: column {name} has {nulls} empty value(s)")
    return {name: table.column(name).to_pylist() for name in schema.names}


def parse_chunks(data: bytes, what: str = "index", max_rows: int = FREE_ROWS) -> list[ChunkRecord]:
    """The index rows, refused unread when the footer declares more than ``max_rows``."""
    cols = _read_table(data, _CHUNK_SCHEMA, what, max_rows)
    return [
        ChunkRecord(fqn, kind, tuple(off), tuple(sizes), tuple(shape), dtype, file, int(b), int(n), key)
        for fqn, kind, off, sizes, shape, dtype, file, b, n, key in zip(*cols.values())
    ]


def parse_files(data: bytes, what: str = "blocks", max_rows: int = FREE_ROWS,
                max_crcs: int = 64 * FREE_ROWS) -> dict[str, FileRecord]:
    cols = _read_table(data, _FILE_SCHEMA, what, max_rows, "crcs", max_crcs)
    files = {}
    for name, rank, size, start, checksum, block, hcrc, crcs in zip(*cols.values()):
        if checksum != "crc32c":
            raise ManifestError(f"{what}: file {name} uses unknown checksum {checksum!r}")
        if name in files:
            raise ManifestError(f"{what}: file {name} is listed twice")
        files[name] = FileRecord(name, rank, size, start, block, hcrc, tuple(crcs))
    return files


# --------------------------------------------------------------------------- planner data


def encode_json(value: Any, where: str = "planner_data") -> Any:
    """JSON with tuples kept as tuples; anything JSON cannot carry is an error, never a pickle."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode_json(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_json(v, where) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is a {type(k).__name__}, not a string")
            if k == "__tuple__":
                raise ValueError(f"{where}: the key '__tuple__' is reserved")
            out[k] = encode_json(v, f"{where}[{k!r}]")
        return out
    raise ValueError(
        f"{where} holds a {type(value).__module__}.{type(value).__name__}, which dcp_nvme cannot "
        "store without pickling; use a planner whose planner_data is JSON-like "
        "(dict/list/tuple/str/int/float/bool/None)"
    )


def decode_json(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode_json(v) for v in value["__tuple__"])
        return {k: decode_json(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- manifest


@dataclass
class Manifest:
    """A committed checkpoint as read back: the JSON document and the chunk index."""

    doc: dict[str, Any]
    chunks: list[ChunkRecord]
    _files: dict[str, FileRecord] | None = field(default=None, repr=False)
    _real_bytes: int | None = field(default=None, repr=False)
    _by_file: dict[str, list[ChunkRecord]] | None = field(default=None, repr=False)

    def rows_by_file(self) -> dict[str, list[ChunkRecord]]:
        """The index rows of each container file."""
        if self._by_file is None:
            self._by_file = {}
            for chunk in self.chunks:
                self._by_file.setdefault(chunk.file, []).append(chunk)
        return self._by_file

    @property
    def save_key(self) -> str:
        return self.doc["save_key"]

    @property
    def file_names(self) -> list[str]:
        return [f["name"] for f in self.doc["files"]]

    def to_metadata(self) -> Metadata:
        """DCP's Metadata, rebuilt from data."""
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, ChunkRecord] = {}
        for chunk in self.chunks:
            if chunk.kind == "bytes":
                state[chunk.fqn] = BytesStorageMetadata()
            else:
                entry = state.get(chunk.fqn)
                if entry is None:
                    entry = state[chunk.fqn] = TensorStorageMetadata(
                        TensorProperties(dtype=parse_dtype(chunk.dtype)),
                        torch.Size(chunk.global_shape),
                        [],
                    )
                entry.chunks.append(
                    ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes))
                )
            storage[chunk.index] = chunk
        meta = self.doc.get("storage_meta") or {}
        return Metadata(
            state_dict_metadata=state,
            planner_data=decode_json(self.doc.get("planner_data")),
            storage_data=storage,
            storage_meta=StorageMeta(
                checkpoint_id=meta.get("checkpoint_id"), save_id=meta.get("save_id"),
                modules=[m for m in _list_or_empty(meta.get("modules")) if isinstance(m, str)],
            ),
            version=self.doc.get("dcp_version"),
        )


def _list_or_empty(value: Any) -> list:
    return value if isinstance(value, list) else []


def table_entry(name: str, data: bytes) -> dict[str, Any]:
    rows = pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
    return {"name": name, "size": len(data), "crc32c": crc32c.crc32c(data), "rows": rows}


def build_manifest_doc(
    *,
    save_key: str,
    files: Iterable[FileRecord],
    index: dict[str, Any],
    blocks: dict[str, Any],
    world_size: int,
    planner_data: Any,
    dcp_version: str | None,
    storage_meta: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    files = list(files)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "save_key": save_key,
        "world_size": world_size,
        "dcp_version": dcp_version,
        "planner_data": encode_json(planner_data),
        "storage_meta": storage_meta,
        "index": index,
        "blocks": blocks,
        "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in files],
        "total_bytes": sum(f.size for f in files),
        **extra,
    }


def missing_manifest_error(store, location: str) -> CheckpointNotFoundError:
    """Why a directory without a committed manifest cannot be loaded: not committed (our files
    without a manifest), or not ours at all."""
    names = store.names()
    if DCP_METADATA in names:
        return CheckpointNotFoundError(
            f"{location} holds a checkpoint written by DCP's FileSystemWriter (.metadata), "
            "not by dcp_nvme; load it with torch.distributed.checkpoint.FileSystemReader, "
            f"or convert it: dcp-nvme convert {location} OUT --to nvme")
    ours = [n for n in names if save_key_of(n)]
    if ours:
        return CheckpointNotCommittedError(
            f"{location} has {len(ours)} dcp_nvme data file(s) but no committed {MANIFEST}: "
            "the save did not finish (it crashed or is still running), so it cannot be loaded")
    return CheckpointNotFoundError(f"{location} is not a dcp_nvme checkpoint (no {MANIFEST})")


SELF_CRC = "manifest_crc32c"


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != SELF_CRC}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes, carrying a crc32c of its own canonical form (any edit is caught)."""
    return json.dumps({**doc, SELF_CRC: crc32c.crc32c(_canonical(doc))}, indent=1).encode()


def read_manifest(store, location: str) -> Manifest:
    """Read and validate a committed checkpoint's manifest and chunk index.

    Every name and number is checked here before anything is opened or allocated from it:
    ``check_doc`` for the manifest, the Parquet footer for the index's size, ``check_chunks``
    for each row (see the "Trust model" section of docs/design.md)."""
    if not store.exists():
        raise CheckpointNotFoundError(f"checkpoint directory {location} does not exist")
    try:
        store.size(MANIFEST)  # a FIFO, device or link under this name is refused, never opened
    except FileNotFoundError:
        raise missing_manifest_error(store, location) from None
    try:
        doc = json.loads(store.read(MANIFEST, MAX_MANIFEST))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"{location}/{MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{location}/{MANIFEST} is not a dcp_nvme manifest")
    version = doc.get("format_version")
    if type(version) is not int or version < OLDEST_FORMAT_VERSION:
        raise ManifestError(f"{location}/{MANIFEST} has format version {version!r}, not a version "
                            f"number from {OLDEST_FORMAT_VERSION}: the manifest is damaged")
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{location} uses format version {version!r}; this dcp_nvme reads up to "
            f"{FORMAT_VERSION}: upgrade dcp_nvme"
        )
    if doc.get(SELF_CRC) != crc32c.crc32c(_canonical(doc)):
        raise ManifestError(f"{location}/{MANIFEST} fails its own checksum: the manifest is corrupt "
                            "or was edited after the save")
    check_doc(doc, f"{location}/{MANIFEST}")
    manifest = Manifest(doc, [])
    entry = doc["index"]
    what = f"{location}/{entry['name']}"
    data = _load_table(store, entry, location)
    rows = _footer(data, what).metadata.num_rows
    if "rows" in entry and rows != entry["rows"]:
        raise ManifestError(f"{what} has {rows} rows, {MANIFEST} says {entry['rows']}")
    manifest.chunks = parse_chunks(data, what, _row_limit(store, manifest, rows, MIN_ITEM_HEADER))
    check_chunks(manifest.chunks, doc, what)
    return manifest


def read_files(store, manifest: Manifest, location: str) -> dict[str, FileRecord]:
    """The per-file checksum table, read and checked once on first use."""
    if manifest._files is None:
        doc = manifest.doc
        entry = doc["blocks"]
        what = f"{location}/{entry['name']}"
        data = _load_table(store, entry, location)
        count = len(doc["files"])
        crcs = _column_values(_footer(data, what).metadata, "crcs")
        files = parse_files(data, what, count, _row_limit(store, manifest, crcs, MIN_CHECKSUM_BLOCK, 64) + count)
        check_files(files, manifest, what)
        manifest._files = files
    return manifest._files


def _row_limit(store, manifest: Manifest, wanted: int, bytes_each: int, free_factor: int = 1) -> int:
    """How many rows (or values) of ``bytes_each`` bytes the real data files can account for.

    Up to ``FREE_ROWS * free_factor`` need no look; beyond, the data files are stat-ed once:
    claims are bounded by what is really on disk, not by what the manifest says."""
    free = FREE_ROWS * free_factor
    if wanted <= free:
        return free
    if manifest._real_bytes is None:
        total = 0
        for entry in manifest.doc["files"]:
            try:
                total += store.size(entry["name"])
            except (OSError, ManifestError):
                pass  # missing or not a regular file: it holds nothing
        manifest._real_bytes = total
    return max(free, manifest._real_bytes // bytes_each)


def _load_table(store, entry: dict[str, Any], location: str) -> bytes:
    """A table's bytes: a regular file of the size the manifest records (checked before it is
    read, so a claim cannot make us allocate), then its crc32c."""
    name = entry["name"]
    try:
        size = store.size(name)
    except FileNotFoundError:
        raise TableError(name, f"{location}: {name} named by {MANIFEST} is missing") from None
    if size != entry["size"]:
        raise TableError(name, f"{location}: {name} does not match {MANIFEST} (size {size} vs "
                               f"{entry['size']}): the table is corrupt or was modified after the save")
    data = store.read(name, entry["size"])
    check_table(location, entry, data)
    return data


# --------------------------------------------------------------------------- validation (pure)


def _is_count(value: object, limit: int = 1 << 62) -> bool:
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
    for kind in ("index", "blocks"):
        entry = doc[kind]
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


def check_chunks(chunks: Sequence[ChunkRecord], doc: dict[str, Any], where: str) -> None:
    """Every index row against itself, the manifest's file sizes and the other rows: names of
    listed files; known kinds and dtypes; a chunk inside its tensor, of exactly numel x itemsize
    bytes, inside its file; no two rows sharing bytes; each tensor's chunks tiling it exactly."""
    sizes = {f["name"]: f["size"] for f in doc["files"]}
    key = doc["save_key"]
    per_file: dict[str, list[ChunkRecord]] = {}
    per_fqn: dict[str, list[ChunkRecord]] = {}
    for chunk in chunks:
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
        per_file.setdefault(chunk.file, []).append(chunk)
        per_fqn.setdefault(chunk.fqn, []).append(chunk)
    for name, rows in per_file.items():
        keys: set[str] = set()
        end, last = -1, None
        for chunk in sorted(rows, key=lambda c: (c.byte_offset, c.length)):
            if chunk.key in keys:
                raise ManifestError(f"{where}: item key {chunk.key!r} appears twice in {name}")
            keys.add(chunk.key)
            if chunk.byte_offset < end and chunk.length:
                raise ManifestError(f"{where}: rows {last.key!r} and {chunk.key!r} share bytes of {name}")
            if chunk.byte_offset + chunk.length > end:
                end, last = chunk.byte_offset + chunk.length, chunk
    for fqn, rows in per_fqn.items():
        message = tiling_problem(rows)
        if message:
            raise ManifestError(f"{where}: {fqn!r}: {message}")


def chunk_problem(chunk: ChunkRecord) -> str:
    """What is wrong with one index row on its own, or ""."""
    if chunk.kind == "bytes":
        if chunk.offsets or chunk.sizes or chunk.global_shape or chunk.dtype != "uint8":
            return "a non-tensor item with a shape or dtype"
        return ""
    if chunk.kind != "tensor":
        return f"unknown kind {chunk.kind!r}"
    try:
        itemsize = parse_dtype(chunk.dtype).itemsize
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
        live = [r for r in rows if math.prod(r.sizes)]
        live.sort(key=lambda r: r.offsets[dim])
        for i, a in enumerate(live):
            for b in live[i + 1:]:
                if b.offsets[dim] >= a.offsets[dim] + a.sizes[dim]:
                    break
                if all(b.offsets[d] < a.offsets[d] + a.sizes[d] and a.offsets[d] < b.offsets[d] + b.sizes[d]
                       for d in range(len(a.offsets))):
                    return f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap"
    return ""


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
    for chunk in manifest.chunks:
        record = files[chunk.file]
        if chunk.byte_offset < record.data_start:
            raise ManifestError(f"{where}: row {chunk.key!r} of {chunk.fqn!r} starts at byte "
                                f"{chunk.byte_offset}, inside the header of {chunk.file} (data starts at "
                                f"{record.data_start})")


# --------------------------------------------------------------------------- container headers


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
    problems = header_mismatches(items, manifest.rows_by_file().get(record.name, []), data_start)
    if problems:
        raise ManifestError(f"{where} and the index disagree: {'; '.join(problems[:3])}; the "
                            "checkpoint is damaged or forged")


def header_mismatches(items: Sequence[HeaderItem], rows: Sequence[ChunkRecord], data_start: int) -> list[str]:
    """Where a container's safetensors header and the index rows of that file disagree (pure):
    every row must be the header item of its key, at the same bytes, with the dtype and shape
    it is stored under (``format.stored_as``; raw U8 bytes are accepted for any dtype)."""
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
        raw = (RAW_DTYPE, (row.length,))
        if row.kind == "bytes":
            expected = [raw]
        else:
            try:
                expected = [stored_as(parse_dtype(row.dtype), row.sizes, row.length), raw]
            except ManifestError as exc:
                problems.append(f"item {row.key!r}: {exc}")
                continue
        if (item.st_dtype, item.shape) not in expected:
            want = expected[0]
            problems.append(f"item {row.key!r}: the safetensors header says {item.st_dtype} "
                            f"{list(item.shape)}, the index {row.dtype} {list(row.sizes)} (stored as "
                            f"{want[0]} {list(want[1])})")
    return problems
