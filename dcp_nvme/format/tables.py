"""The two Parquet tables of a checkpoint: their rows as records (``ChunkRecord``,
``FileRecord``), their encoding, and their checked decoding (with the bounds it applies).

    index.<key>.parquet    one row per stored chunk: fqn, chunk offsets/sizes, global shape,
                           dtype, file, byte offset, length, and the item's key in its
                           container where it is not ``default_item_key`` (null where it is).
    blocks.<key>.parquet   one row per container file: size, data start, crc32c per block.

Decoding treats the bytes as hostile: footer, row counts and column values are bounded before
any row becomes a Python object."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dcp_nvme.errors import (
    ManifestError,
)
from dcp_nvme.format.container import (
    MAX_NDIM,
    default_item_key,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex


from collections.abc import Iterator
from contextlib import contextmanager


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
        from torch.distributed.checkpoint.metadata import MetadataIndex  # the tools run without torch

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
    """A WriteResult's ``storage_data``: the chunk, plus its file on one result per file, with
    the rank's figures and all of its index rows encoded (``rows_blob``)."""

    chunk: ChunkRecord
    file: FileRecord | None = None
    stats: dict[str, Any] | None = None
    rows: bytes | None = None
    copies: int = 0
    """On the first result: how many of the rank's results, at the end, are copies of items
    another directory's rank wrote (``save.copies``); their rows are ``copy_rows``, not ``rows``."""
    copy_rows: bytes | None = None


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


SMALL_TABLE = 64 << 10
"""Tables whose columns take less than this in memory are stored uncompressed: zstd would save
a few KiB and cost a coder set up on every write and read (half of a small table's write)."""


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    compression = "none" if table.nbytes < SMALL_TABLE else "zstd"
    pq.write_table(table, sink, compression=compression, write_statistics=False)  # our reader uses none
    return sink.getvalue().to_pybytes()


def _list_column(values: Sequence[Sequence[int]]) -> pa.Array:
    """A list<int64> column from per-row tuples, through one flat array (no list per row)."""
    lengths = np.fromiter((len(v) for v in values), dtype=np.int32, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def chunk_rows(chunks: Sequence[ChunkRecord], fqn_keys: bool = False) -> pa.Table:
    """Index rows as an Arrow table: each column made in one pass, GC paused (a commit at 16k
    ranks makes millions of short-lived objects, and the cyclic GC would walk them again and
    again). A key is null where it is the default (``default_item_key``; format 4 writes
    ``fqn_keys``)."""
    was = gc.isenabled()
    gc.disable()
    try:
        columns = [
            pa.array([c.fqn for c in chunks], pa.string()),
            pa.array([c.kind for c in chunks], pa.string()),
            _list_column([c.offsets for c in chunks]),
            _list_column([c.sizes for c in chunks]),
            _list_column([c.global_shape for c in chunks]),
            pa.array([c.dtype for c in chunks], pa.string()),
            pa.array([c.file for c in chunks], pa.string()),
            pa.array(np.fromiter((c.byte_offset for c in chunks), dtype=np.int64, count=len(chunks))),
            pa.array(np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))),
            pa.array([None if c.key == default_item_key(c.fqn, c.offsets, fqn_keys) else c.key for c in chunks],
                     pa.string()),
        ]
    finally:
        if was:
            gc.enable()
    return pa.Table.from_arrays(columns, schema=_CHUNK_SCHEMA)


def chunks_table(chunks: Sequence[ChunkRecord], fqn_keys: bool = False) -> bytes:
    """The index table's bytes (``fqn_keys``: of a format-4 checkpoint, see ``chunk_rows``)."""
    return index_table_bytes(chunk_rows(chunks, fqn_keys))


def index_table_bytes(rows: pa.Table) -> bytes:
    """The index table's bytes from its rows (``chunk_rows``, or ranks' rows concatenated)."""
    return _parquet_bytes(rows)


def rows_blob(chunks: Sequence[ChunkRecord], fqn_keys: bool = False) -> bytes:
    """A rank's index rows as an Arrow IPC stream: the rank encodes its own rows, so the
    coordinator of a 16k-rank save concatenates columns instead of making each row's."""
    sink = pa.BufferOutputStream()
    table = chunk_rows(chunks, fqn_keys)
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    return sink.getvalue().to_pybytes()


def rows_from_blobs(blobs: Sequence[bytes]) -> pa.Table:
    """The ranks' rows (``rows_blob``) as one table, in the order given. The blobs come from
    this save's own ranks (not from disk): a schema other than the index's is a bug."""
    tables = [pa.ipc.open_stream(pa.BufferReader(blob)).read_all() for blob in blobs]
    for table in tables:
        if table.schema != _CHUNK_SCHEMA:
            raise ValueError(f"a rank's index rows have schema {table.schema}, not the index's")
    return pa.concat_tables(tables) if tables else _CHUNK_SCHEMA.empty_table()


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


def parquet_footer(data: bytes, what: str, dictionary: Sequence[str] = ()) -> pq.ParquetFile:
    """The table's footer, parsed (once per read: the checks and the read share it);
    ``dictionary``: columns read as their dictionary codes (``CODED``)."""
    try:
        return pq.ParquetFile(pa.BufferReader(data), read_dictionary=list(dictionary) or None)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{what} is not a readable Parquet file: {exc}") from None


def column_values(meta: pq.FileMetaData, column: str) -> int:
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
                long_column: str | None = None, max_long: int = 0, nullable: tuple = (),
                parquet: pq.ParquetFile | None = None) -> dict[str, list]:
    table = _read_arrow(data, schema, what, max_rows, long_column, max_long, nullable=nullable, parquet=parquet)
    return {name: table.column(name).to_pylist() for name in schema.names}


def read_chunk_table(data: bytes, what: str = "index", max_rows: int = FREE_ROWS,
                     parquet: pq.ParquetFile | None = None) -> pa.Table:
    """The index as an Arrow table, with the checks of ``parse_chunks`` (footer bounds, column
    types, no nulls but in ``key``) and no Python object per row. ``parquet``: its footer
    already parsed, by ``parquet_footer(data, what, CODED)``."""
    return _read_arrow(data, _CHUNK_SCHEMA, what, max_rows, dictionary=CODED, nullable=_NULLABLE, parquet=parquet)


_NULLABLE = ("key",)
"""A null key is the default one (``default_item_key``); format version 3 writes them."""


CODED = ("fqn", "kind", "dtype", "file")
"""Index columns of few distinct values, read as Parquet stores them (dictionary pages): no
string per row is made, and ``columns`` takes their codes as they are."""


def _read_arrow(data: bytes, schema: pa.Schema, what: str, max_rows: int,
                long_column: str | None = None, max_long: int = 0, dictionary: tuple = (),
                nullable: tuple = (), parquet: pq.ParquetFile | None = None) -> pa.Table:
    if parquet is None:
        parquet = parquet_footer(data, what, dictionary)
    present = set(parquet.schema_arrow.names)  # a property that builds the schema at each call
    missing = [n for n in schema.names if n not in present]
    if missing:
        raise ManifestError(f"{what} lacks column(s) {missing}")
    _check_counts(parquet, what, max_rows, long_column, max_long)
    try:
        # no Arrow thread pool: its threads, once started, can abort the interpreter at exit
        # ("terminate called without an active exception", apache/arrow#34314; seen in CLI runs
        # under load). A single-threaded read of a small index starts none.
        table = parquet.read(columns=schema.names, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{what} is not a readable Parquet file: {exc}") from None
    for name in schema.names:
        column = table.column(name)
        kind = column.type
        if name in dictionary and pa.types.is_dictionary(kind) and kind.value_type == pa.string():
            kind = kind.value_type
        if kind != schema.field(name).type:
            raise ManifestError(f"{what}: column {name} is {column.type}, expected {schema.field(name).type}")
        nulls = 0 if name in nullable else column.null_count
        if pa.types.is_list(column.type):
            nulls += pc.list_flatten(column).null_count
        if nulls:
            raise ManifestError(f"{what}: column {name} has {nulls} empty value(s)")
    return table.select(schema.names)


def parse_chunks(data: bytes, what: str = "index", max_rows: int = FREE_ROWS,
                 fqn_keys: bool = False, parquet: pq.ParquetFile | None = None) -> list[ChunkRecord]:
    """The index rows, refused unread when the footer declares more than ``max_rows``; a null
    key is the default one (``default_item_key``, format 4 ``fqn_keys``)."""
    cols = _read_table(data, _CHUNK_SCHEMA, what, max_rows, nullable=_NULLABLE, parquet=parquet)
    return [
        ChunkRecord(fqn, kind, tuple(off), tuple(sizes), tuple(shape), dtype, file, int(b), int(n),
                    default_item_key(fqn, tuple(off) if kind == "tensor" else None, fqn_keys) if key is None else key)
        for fqn, kind, off, sizes, shape, dtype, file, b, n, key in zip(*cols.values())
    ]


def parse_files(data: bytes, what: str = "blocks", max_rows: int = FREE_ROWS,
                max_crcs: int = 64 * FREE_ROWS, parquet: pq.ParquetFile | None = None) -> dict[str, FileRecord]:
    cols = _read_table(data, _FILE_SCHEMA, what, max_rows, "crcs", max_crcs, parquet=parquet)
    files = {}
    for name, rank, size, start, checksum, block, hcrc, crcs in zip(*cols.values()):
        if checksum != "crc32c":
            raise ManifestError(f"{what}: file {name} uses unknown checksum {checksum!r}")
        if name in files:
            raise ManifestError(f"{what}: file {name} is listed twice")
        files[name] = FileRecord(name, rank, size, start, block, hcrc, tuple(crcs))
    return files


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off around a loop that makes many objects and frees none (it would
    walk them all again and again); back on, as it was, afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def as_numpy(array: pa.Array | pa.ChunkedArray, dtype) -> np.ndarray:
    """A null-free numeric Arrow array as numpy, without the copy path (it imports pandas:
    300 modules, half a second of every first load)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not pa.types.is_signed_integer(array.type) or array.null_count:
        raise ValueError(f"not a null-free signed integer array: {array.type}")  # checked before: a bug
    if not len(array):
        return np.zeros(0, dtype=dtype)
    data = np.frombuffer(array.buffers()[1], dtype=np.dtype(f"int{array.type.bit_width}"))
    return data[array.offset:array.offset + len(array)].astype(dtype, copy=False)

