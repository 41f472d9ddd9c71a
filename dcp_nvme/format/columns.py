"""The chunk index as columns: numpy arrays decoded once from the Parquet table, no Python
object per row until a row is asked for (``record``).

A rank loading a 16,384-rank checkpoint needs a few thousand of its million rows: the checks
(``column_checks``), the tensors' shapes and the load planner's lookups all run on these arrays,
and ``ChunkRecord``s are made only for the rows a caller touches."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .tables import ChunkRecord


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


def _encoded(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """A string column as int32 codes into its distinct values (in order of first use)."""
    if pa.types.is_dictionary(column.type):  # read as stored: unify the row groups' dictionaries
        encoded = column.unify_dictionaries().combine_chunks() if column.num_chunks else \
            pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
    else:
        encoded = pc.dictionary_encode(column).combine_chunks()
    return as_numpy(encoded.indices, np.int32), encoded.dictionary.to_pylist()


def _lists(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list<int64> column as (row lengths, flat values)."""
    array = column.combine_chunks()
    lengths = as_numpy(pc.list_value_length(array), np.int64)
    values = as_numpy(pc.list_flatten(array), np.int64)
    return lengths, values


def _starts(lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return starts


@dataclass
class ChunkColumns:
    """The index rows of one checkpoint, by column. String columns are codes into their
    distinct values; list columns are lengths and flat values (``starts`` index the flat
    arrays of each list column by row)."""

    fqn: np.ndarray
    fqns: list[str]
    kind: np.ndarray
    kinds: list[str]
    dtype: np.ndarray
    dtypes: list[str]
    file: np.ndarray
    files: list[str]
    key: np.ndarray
    keys: pa.Array
    """The distinct item keys (``key`` codes index it); turned into strings one at a time."""
    ndim: tuple[np.ndarray, np.ndarray, np.ndarray]
    """Lengths of chunk_offsets, chunk_sizes, global_shape per row (equal once checked)."""
    values: tuple[np.ndarray, np.ndarray, np.ndarray]
    """Flat values of chunk_offsets, chunk_sizes, global_shape."""
    starts: tuple[np.ndarray, np.ndarray, np.ndarray]
    byte_offset: np.ndarray
    length: np.ndarray
    _cache: dict[int, ChunkRecord] = field(default_factory=dict, repr=False)

    @classmethod
    def from_table(cls, table: pa.Table) -> ChunkColumns:
        fqn, fqns = _encoded(table.column("fqn"))
        kind, kinds = _encoded(table.column("kind"))
        dtype, dtypes = _encoded(table.column("dtype"))
        file, files = _encoded(table.column("file"))
        encoded = pc.dictionary_encode(table.column("key")).combine_chunks()
        key = as_numpy(encoded.indices, np.int64)
        lists = [_lists(table.column(name)) for name in ("chunk_offsets", "chunk_sizes", "global_shape")]
        ndim = tuple(n for n, _ in lists)
        return cls(
            fqn, fqns, kind, kinds, dtype, dtypes, file, files, key, encoded.dictionary,
            ndim, tuple(v for _, v in lists), tuple(_starts(n) for n in ndim),
            as_numpy(table.column("byte_offset"), np.int64), as_numpy(table.column("length"), np.int64),
        )

    def __len__(self) -> int:
        return len(self.fqn)

    def list_of(self, which: int, row: int) -> tuple[int, ...]:
        start = self.starts[which][row]
        return tuple(self.values[which][start:start + self.ndim[which][row]].tolist())

    def record(self, row: int) -> ChunkRecord:
        """Row ``row`` as a ChunkRecord (made once, then cached)."""
        got = self._cache.get(row)
        if got is None:
            got = self._cache[row] = ChunkRecord(
                self.fqns[self.fqn[row]], self.kinds[self.kind[row]], self.list_of(0, row),
                self.list_of(1, row), self.list_of(2, row), self.dtypes[self.dtype[row]],
                self.files[self.file[row]], int(self.byte_offset[row]), int(self.length[row]),
                self.keys[int(self.key[row])].as_py())
        return got

    def records(self, rows=None) -> list[ChunkRecord]:
        with gc_paused():
            return [self.record(int(r)) for r in (range(len(self)) if rows is None else rows)]

    def matrix(self, which: int, rows: np.ndarray, dims: int) -> np.ndarray:
        """The list values of ``rows`` (all of ``dims`` values) as a rows x dims array."""
        if dims == 0:
            return np.zeros((len(rows), 0), dtype=np.int64)
        index = self.starts[which][rows][:, None] + np.arange(dims, dtype=np.int64)[None, :]
        return self.values[which][index]

    def groups(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ordered by ``codes`` (stable: row order within a code), and for each code
        present its first position in that order and its rows' count."""
        order = np.argsort(codes, kind="stable")
        sorted_codes = codes[order]
        edges = np.flatnonzero(np.diff(sorted_codes)) + 1
        first = np.concatenate(([0], edges)).astype(np.int64)
        counts = np.diff(np.concatenate((first, [len(codes)])))
        return order, first, counts

    def by_file(self) -> dict[str, np.ndarray]:
        """Row numbers of each file's rows, in row order."""
        if not len(self):
            return {}
        order, first, counts = self.groups(self.file)
        return {self.files[self.file[order[f]]]: order[f:f + c] for f, c in zip(first.tolist(), counts.tolist())}
