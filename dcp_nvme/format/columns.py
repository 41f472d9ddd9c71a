"""The chunk index as columns: numpy arrays decoded once from the Parquet table, no Python
object per row until a row is asked for (``record``).

A rank loading a 16,384-rank checkpoint needs a few thousand of its million rows: the checks
(``column_checks``), the tensors' shapes and the load planner's lookups all run on these arrays,
and ``ChunkRecord``s are made only for the rows a caller touches."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcp_nvme.format.container import MAX_NDIM, default_item_key
from dcp_nvme.format.tables import ChunkRecord, as_numpy, gc_paused


def _encoded(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """A string column as int32 codes into its distinct values (in order of first use)."""
    if pa.types.is_dictionary(column.type):  # read as stored: unify the row groups' dictionaries
        encoded = column.unify_dictionaries().combine_chunks() if column.num_chunks else \
            pa.DictionaryArray.from_arrays(pa.nulls(0, pa.int32()), pa.nulls(0, pa.string()))
    else:
        encoded = pc.dictionary_encode(column).combine_chunks()
    return as_numpy(encoded.indices, np.int32), encoded.dictionary.to_pylist()


def no_keys(rows: int) -> np.ndarray:
    """The ``key`` codes of rows that all have their default key: -1 each, in no memory (a
    read-only view of one number)."""
    return np.broadcast_to(np.int64(-1), (rows,))


PAD = (0, 1, 1)
"""What fills ``ChunkColumns.grid`` past a row's own values: offset 0, size 1, shape 1, so the
checks' products, bounds and overlap sweeps run on whole rows whatever their dimensions."""


def _lists(column: pa.ChunkedArray, pad: int, width: int) -> tuple[np.ndarray, np.ndarray, dict[int, tuple]]:
    """A list<int64> column as (row lengths, an n x ``width`` grid of the values padded with
    ``pad``, the values of rows longer than ``width``: only a damaged table has any). Each row
    group's chunk fills its rows of the grid: no combined copy of the column is made."""
    n = len(column)
    lengths = np.zeros(n, dtype=np.int8)  # clamped to MAX_NDIM + 1 (65): past it a row's values are in ``longer``
    grid = np.full((n, width), pad, dtype=np.int64)
    longer: dict[int, tuple] = {}
    row0 = 0
    for array in column.chunks:
        size = len(array)
        bounds = as_numpy(array.offsets, np.int64)
        counts = np.diff(bounds)
        lengths[row0:row0 + size] = np.minimum(counts, MAX_NDIM + 1)
        values = as_numpy(array.flatten(), np.int64)
        part = grid[row0:row0 + size]
        if len(values):
            if width and (counts == width).all():
                part[:] = values.reshape(size, width)
            elif width and counts.max() <= width:  # the grid's row-major cells a row fills are its values
                part[np.arange(width) < counts[:, None]] = values
            else:  # a column at a time: the rows that reach it (and the longer ones kept aside)
                starts = bounds[:-1] - bounds[0]
                for j in range(width):
                    reach = np.flatnonzero(counts > j)
                    part[reach, j] = values[starts[reach] + j]
                for r in np.flatnonzero(counts > width).tolist():
                    longer[row0 + r] = tuple(values[starts[r]:starts[r] + counts[r]].tolist())
        row0 += size
    return lengths, grid, longer


def _longest(column: pa.ChunkedArray) -> int:
    return max((int(np.diff(as_numpy(a.offsets, np.int64)).max()) for a in column.chunks if len(a)), default=0)


@dataclass
class ChunkColumns:
    """The index rows of one checkpoint, by column. String columns are codes into their
    distinct values; list columns are lengths and an n x width grid (``PAD`` past a row's own
    values; width: the longest row's, at most ``MAX_NDIM``)."""

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
    """The distinct stored item keys (``key`` codes index it); turned into strings one at a time.
    A code of -1 is a row whose key is the default one (``default_item_key``): a table has
    either every key stored (format 1 and 2) or none (``from_table`` fills a mixed one in)."""
    ndim: tuple[np.ndarray, np.ndarray, np.ndarray]
    """Lengths of chunk_offsets, chunk_sizes, global_shape per row (equal once checked), int8:
    a length past ``MAX_NDIM`` reads as MAX_NDIM + 1 (the row is refused; ``longer`` has it)."""
    grid: tuple[np.ndarray, np.ndarray, np.ndarray]
    """chunk_offsets, chunk_sizes, global_shape as n x width arrays."""
    longer: tuple[dict[int, tuple], dict[int, tuple], dict[int, tuple]]
    """The values of rows longer than the width (a damaged table's), by row."""
    byte_offset: np.ndarray
    length: np.ndarray
    fqn_keys: bool = False
    """Format 4: a row's default key is its fqn (``container.default_item_key``)."""
    _cache: dict[int, ChunkRecord] = field(default_factory=dict, repr=False)
    _groups: dict[int, tuple] = field(default_factory=dict, repr=False)

    @classmethod
    def from_table(cls, table: pa.Table, fqn_keys: bool = False) -> ChunkColumns:
        fqn, fqns = _encoded(table.column("fqn"))
        kind, kinds = _encoded(table.column("kind"))
        dtype, dtypes = _encoded(table.column("dtype"))
        file, files = _encoded(table.column("file"))
        arrays = [table.column(name) for name in ("chunk_offsets", "chunk_sizes", "global_shape")]
        width = min(max(_longest(a) for a in arrays), MAX_NDIM)
        offsets, sizes, shape = [_lists(a, pad, width) for a, pad in zip(arrays, PAD)]
        columns = cls(
            fqn, fqns, kind, kinds, dtype, dtypes, file, files, no_keys(len(fqn)),
            pa.nulls(0, pa.string()),  # (pa.array([]) imports pandas)
            (offsets[0], sizes[0], shape[0]), (offsets[1], sizes[1], shape[1]), (offsets[2], sizes[2], shape[2]),
            as_numpy(table.column("byte_offset"), np.int64), as_numpy(table.column("length"), np.int64),
            fqn_keys,
        )
        stored = table.column("key")
        if stored.null_count < len(stored):  # keys stored (before format 3, or forged): encode them all
            if stored.null_count:
                stored = pa.array([columns.default_key(r) if k is None else k
                                   for r, k in enumerate(stored.to_pylist())], pa.string())
            encoded = pc.dictionary_encode(stored)
            if isinstance(encoded, pa.ChunkedArray):
                encoded = encoded.combine_chunks()
            columns.key, columns.keys = as_numpy(encoded.indices, np.int64), encoded.dictionary
        return columns

    @property
    def derived_keys(self) -> bool:
        """Whether every row's key is its default one (none stored)."""
        return not len(self.keys) and len(self) > 0

    def default_key(self, row: int) -> str:
        tensor = self.kinds[self.kind[row]] == "tensor"
        return default_item_key(self.fqns[self.fqn[row]], self.list_of(0, row) if tensor else None, self.fqn_keys)

    def __len__(self) -> int:
        return len(self.fqn)

    @property
    def width(self) -> int:
        return self.grid[0].shape[1]

    def list_of(self, which: int, row: int) -> tuple[int, ...]:
        longer = self.longer[which].get(row)
        if longer is not None:
            return longer
        return tuple(self.grid[which][row, :self.ndim[which][row]].tolist())

    def record(self, row: int) -> ChunkRecord:
        """Row ``row`` as a ChunkRecord (made once, then cached)."""
        got = self._cache.get(row)
        if got is None:
            got = self._cache[row] = ChunkRecord(
                self.fqns[self.fqn[row]], self.kinds[self.kind[row]], self.list_of(0, row),
                self.list_of(1, row), self.list_of(2, row), self.dtypes[self.dtype[row]],
                self.files[self.file[row]], int(self.byte_offset[row]), int(self.length[row]),
                self.keys[int(self.key[row])].as_py() if self.key[row] >= 0 else self.default_key(row))
        return got

    def records(self, rows=None) -> list[ChunkRecord]:
        with gc_paused():
            return [self.record(int(r)) for r in (range(len(self)) if rows is None else rows)]

    def groups(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ordered by ``codes`` (stable: row order within a code), and for each code
        present its first position in that order and its rows' count. Made once per column
        (the checks and the metadata both group by tensor)."""
        cached = self._groups.get(id(codes))
        if cached is not None and cached[0] is codes:
            return cached[1]
        got = self._groups_of(codes)
        self._groups[id(codes)] = (codes, got)
        return got

    @staticmethod
    def _groups_of(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
