"""DCP's ``Metadata`` over the index columns, built lazily.

``state_dict_metadata`` holds one entry per tensor; a tensor's ``chunks`` list (DCP's
ChunkStorageMetadata objects, what DefaultLoadPlanner scans) is made on first use, and
``storage_data`` finds a chunk's row when a read asks for it. A rank that plans with
``NVMeLoadPlanner`` never makes either for the rows it does not load: it asks each tensor's
interval index (``ChunkIndex``) which saved chunks meet its own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_nvme.format.columns import ChunkColumns
from dcp_nvme.format.tables import ChunkRecord, gc_paused


class ChunkIndex:
    """One tensor's saved chunks, sorted by their start along ``dim`` with the running maximum
    of their ends there, so the chunks meeting a box are found by two binary searches and a
    filter of the few in between (pure). The chunks' boxes are rows ``rows`` of two grids
    (offsets, sizes: n x at least ``dims``), gathered only for the chunks a search finds: a rank
    that loads one shard of each tensor copies a few numbers per tensor, not every chunk's."""

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray, rows: np.ndarray | None = None,
                 dims: int | None = None, sweep: tuple[int, np.ndarray, np.ndarray] | None = None) -> None:
        self._grids, self._rows = (offsets, sizes), rows
        self.count = len(offsets) if rows is None else len(rows)
        self.dims = offsets.shape[1] if dims is None else dims
        self._boxes: tuple[np.ndarray, np.ndarray] | None = None
        self.order: np.ndarray | None = None
        """Positions in start order; None when the chunk list is in start order already."""
        if not self.dims:
            self.dim = 0
        elif sweep is not None:  # found for every tensor at once (``TensorSweeps``)
            self.dim, self.starts, self.reach = sweep
        else:
            offsets, sizes = self.box(None)
            self.dim = _most_cut(offsets) if self.count else 0
            along = offsets[:, self.dim]
            if not (self.count < 2 or (along[1:] >= along[:-1]).all()):  # rank order often is sorted
                self.order = np.argsort(along, kind="stable")
                along = along[self.order]
            ends = offsets[:, self.dim] + sizes[:, self.dim]
            self.starts = along
            self.reach = np.maximum.accumulate(ends if self.order is None else ends[self.order]) \
                if self.count else ends

    @classmethod
    def from_chunks(cls, chunks: list[ChunkStorageMetadata], dims: int) -> ChunkIndex:
        if not chunks:
            empty = np.zeros((0, dims), dtype=np.int64)
            return cls(empty, empty)
        return cls(np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(len(chunks), dims),
                   np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(len(chunks), dims))

    def box(self, positions: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The offsets and sizes (len x dims) of the chunks at ``positions`` (None: all)."""
        offsets, sizes = self._grids
        if self._rows is None:
            if positions is None:
                return offsets[:, :self.dims], sizes[:, :self.dims]
            return offsets[positions, :self.dims], sizes[positions, :self.dims]
        rows = self._rows if positions is None else self._rows[positions]
        return offsets[rows, :self.dims], sizes[rows, :self.dims]

    @property
    def offsets(self) -> np.ndarray:
        """Every chunk's offsets (count x dims)."""
        return self._all()[0]

    @property
    def sizes(self) -> np.ndarray:
        return self._all()[1]

    def _all(self) -> tuple[np.ndarray, np.ndarray]:
        if self._boxes is None:
            self._boxes = self.box(None)
        return self._boxes

    def offsets_of(self, position: int) -> tuple[int, ...]:
        return tuple(self.box(np.array([position]))[0][0].tolist()) if self.dims else ()

    def _positions(self, lo: int, hi: int) -> np.ndarray:
        return np.arange(lo, hi) if self.order is None else self.order[lo:hi]

    def meeting(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
        """Positions (in the tensor's chunk list) of the saved chunks that overlap the box, in
        DCP's sense: on every dimension each starts before the other ends (so an empty saved
        chunk strictly inside the box counts, as it does for DefaultLoadPlanner)."""
        if not self.dims:
            return self._positions(0, self.count)
        lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        last = int(np.searchsorted(self.starts, hi, side="left"))  # saved start < hi
        first = int(np.searchsorted(self.reach[:last], lo, side="right"))  # some end > lo from here
        found = self._positions(first, last)
        if not len(found):
            return found
        off, size = self.box(found)
        box_off = np.asarray(offsets, dtype=np.int64)
        box_end = box_off + np.asarray(sizes, dtype=np.int64)
        meets = ((box_off < off + size) & (off < box_end)).all(axis=1)
        return found[meets]

    def exact(self, offsets: tuple[int, ...]) -> int | None:
        """The position of the last chunk starting at ``offsets``, if any."""
        if not self.dims:
            return self.count - 1 if self.count else None
        lo = int(np.searchsorted(self.starts, offsets[self.dim], side="left"))
        hi = int(np.searchsorted(self.starts, offsets[self.dim], side="right"))
        found = self._positions(lo, hi)
        if not len(found):
            return None
        same = (self.box(found)[0] == np.asarray(offsets, dtype=np.int64)).all(axis=1)
        hits = found[same]
        return int(hits.max()) if len(hits) else None


class TensorSweeps:
    """Every tensor's sweep (its cut dimension, starts and running ends there), found in a few
    passes over the index columns the first time a tensor's index is asked for, instead of a
    gather of every chunk's box per tensor. Given for a tensor cut along one dimension whose
    rows are in start order with ends not falling (FSDP's, and row- or column-wise TP's); any
    other tensor's ``ChunkIndex`` sorts its own."""

    def __init__(self, cols: ChunkColumns, order: np.ndarray, first: np.ndarray, counts: np.ndarray) -> None:
        self._cols, self._order, self._first, self._counts = cols, order, first, counts
        self._found: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def of(self, group: int) -> tuple[int, np.ndarray, np.ndarray] | None:
        """(dim, starts, reach) of the tensor whose rows are ``order[first[group]:][:counts[group]]``."""
        if self._found is None:
            self._found = self._sweep()
        dims, usable, starts, ends = self._found
        if not usable[group]:
            return None
        at = slice(int(self._first[group]), int(self._first[group] + self._counts[group]))
        return int(dims[group]), starts[at], ends[at]

    def _sweep(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        cols, order, first = self._cols, self._order, self._first
        groups = len(first)
        dims = np.zeros(groups, dtype=np.int64)
        if not cols.width or not len(order):
            return dims, np.zeros(groups, dtype=bool), np.zeros(0, np.int64), np.zeros(0, np.int64)
        offsets, sizes = cols.grid[0], cols.grid[1]
        cut = np.zeros(groups, dtype=np.int64)  # dimensions along which a tensor's starts differ
        for d in range(cols.width):  # a padded dimension (offset 0) is never cut
            along = offsets[order, d]
            varies = np.maximum.reduceat(along, first) != np.minimum.reduceat(along, first)
            dims[varies & (cut == 0)] = d
            cut += varies
        group_of = np.repeat(np.arange(groups), self._counts)
        dim_of = dims[group_of]
        starts = offsets[order, dim_of]
        ends = starts + sizes[order, dim_of]
        usable = cut <= 1
        same = group_of[1:] == group_of[:-1]
        usable[group_of[1:][same & ((starts[1:] < starts[:-1]) | (ends[1:] < ends[:-1]))]] = False
        return dims, usable, starts, ends


def _most_cut(offsets: np.ndarray) -> int:
    """The dimension with the most distinct chunk starts (the sweep's: there the fewest chunks
    share a start); the only one that is cut at all, when one is (FSDP's case), without a sort."""
    cut = [d for d in range(offsets.shape[1]) if (offsets[:, d] != offsets[0, d]).any()]
    if len(cut) <= 1:
        return cut[0] if cut else 0
    return max(cut, key=lambda d: len(np.unique(offsets[:, d])))


class IndexedTensorMetadata(TensorStorageMetadata):
    """A TensorStorageMetadata whose ``chunks`` are made from the index columns on first use."""

    def __init__(self, properties: TensorProperties, size: torch.Size, columns: ChunkColumns,
                 rows: np.ndarray, sweeps: TensorSweeps | None = None, group: int = 0) -> None:
        self.properties = properties
        self.size = size
        self._columns = columns
        self._rows = rows
        self._sweeps, self._group = sweeps, group
        self._chunks: list[ChunkStorageMetadata] | None = None
        self._index: ChunkIndex | None = None

    @property
    def chunks(self) -> list[ChunkStorageMetadata]:
        if self._chunks is None:
            dims = len(self.size)
            off, size = self.index().offsets.tolist(), self.index().sizes.tolist()
            with gc_paused():
                self._chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in zip(off, size)] \
                    if dims else [ChunkStorageMetadata(torch.Size(()), torch.Size(())) for _ in self._rows]
        return self._chunks

    @chunks.setter
    def chunks(self, value: list[ChunkStorageMetadata]) -> None:
        self._chunks, self._index = value, None

    def index(self) -> ChunkIndex:
        if self._index is None:
            if self._chunks is not None:
                self._index = ChunkIndex.from_chunks(self._chunks, len(self.size))
            else:
                sweep = self._sweeps.of(self._group) if self._sweeps is not None else None
                self._index = ChunkIndex(*self._columns.grid[:2], self._rows, len(self.size), sweep)
        return self._index

    def row(self, position: int) -> int:
        """The index row of the chunk at ``position`` in ``chunks``."""
        return int(self._rows[position])

    def __reduce__(self):  # a plain TensorStorageMetadata travels, not the columns
        return TensorStorageMetadata, (self.properties, self.size, self.chunks)


class StorageView(Mapping):
    """``Metadata.storage_data``: MetadataIndex -> ChunkRecord, found through the tensor's
    index (or the hint DCP carries in ``MetadataIndex.index``) when a read asks for it."""

    def __init__(self, columns: ChunkColumns, tensors: dict[str, Any], bytes_rows: dict[str, int]) -> None:
        self._columns = columns
        self._tensors = tensors
        self._bytes = bytes_rows
        self._all: dict[MetadataIndex, ChunkRecord] | None = None

    def _row(self, key: MetadataIndex) -> int | None:
        if not isinstance(key, MetadataIndex):
            return None
        if key.offset is None:
            return self._bytes.get(key.fqn)
        entry = self._tensors.get(key.fqn)
        if not isinstance(entry, IndexedTensorMetadata):
            return None
        offsets = tuple(key.offset)
        hint = key.index
        if isinstance(hint, int) and 0 <= hint < len(entry._rows):
            if entry.index().offsets_of(hint) == offsets:
                return entry.row(hint)
        if len(offsets) != len(entry.size):
            return None
        position = entry.index().exact(offsets)
        return None if position is None else entry.row(position)

    def __getitem__(self, key: MetadataIndex) -> ChunkRecord:
        row = self._row(key)
        if row is None:
            raise KeyError(key)
        return self._columns.record(row)

    def __contains__(self, key: object) -> bool:
        return self._row(key) is not None  # type: ignore[arg-type]

    def _full(self) -> dict[MetadataIndex, ChunkRecord]:
        """Every row by its index (the last of equal ones, as a dict built row by row keeps)."""
        if self._all is None:
            with gc_paused():
                self._all = {r.index: r for r in self._columns.records()}
        return self._all

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._full())

    def __len__(self) -> int:
        return len(self._full())

    def __reduce__(self):  # a plain dict travels
        return dict, (self._full(),)
