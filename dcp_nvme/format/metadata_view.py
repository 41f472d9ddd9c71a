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

from .columns import ChunkColumns, gc_paused
from .tables import ChunkRecord


class ChunkIndex:
    """One tensor's saved chunks as arrays (``offsets``, ``sizes``: k x ndim), sorted by their
    start along ``dim`` with the running maximum of their ends there, so the chunks meeting a
    box are found by two binary searches and a filter of the few in between (pure)."""

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.offsets, self.sizes = offsets, sizes
        count, dims = offsets.shape
        self.dims = dims
        if dims:
            ends = offsets + sizes
            self.dim = _most_cut(offsets) if count else 0
            along = offsets[:, self.dim]
            if count < 2 or (along[1:] >= along[:-1]).all():  # saved in rank order: sorted already
                self.order = np.arange(count)
            else:
                self.order = np.argsort(along, kind="stable")
            self.starts = along[self.order]
            self.reach = np.maximum.accumulate(ends[self.order, self.dim]) if count else ends[:, 0]
        else:
            self.dim, self.order = 0, np.arange(count)

    @classmethod
    def from_chunks(cls, chunks: list[ChunkStorageMetadata], dims: int) -> ChunkIndex:
        if not chunks:
            empty = np.zeros((0, dims), dtype=np.int64)
            return cls(empty, empty)
        return cls(np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(len(chunks), dims),
                   np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(len(chunks), dims))

    def meeting(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
        """Positions (in the tensor's chunk list) of the saved chunks that overlap the box, in
        DCP's sense: on every dimension each starts before the other ends (so an empty saved
        chunk strictly inside the box counts, as it does for DefaultLoadPlanner)."""
        if not self.dims:
            return self.order
        lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        last = int(np.searchsorted(self.starts, hi, side="left"))  # saved start < hi
        first = int(np.searchsorted(self.reach[:last], lo, side="right"))  # some end > lo from here
        found = self.order[first:last]
        if not len(found):
            return found
        off, size = self.offsets[found], self.sizes[found]
        box_off = np.asarray(offsets, dtype=np.int64)
        box_end = box_off + np.asarray(sizes, dtype=np.int64)
        meets = ((box_off < off + size) & (off < box_end)).all(axis=1)
        return found[meets]

    def exact(self, offsets: tuple[int, ...]) -> int | None:
        """The position of the last chunk starting at ``offsets``, if any."""
        if not self.dims:
            return int(self.order[-1]) if len(self.order) else None
        lo = int(np.searchsorted(self.starts, offsets[self.dim], side="left"))
        hi = int(np.searchsorted(self.starts, offsets[self.dim], side="right"))
        found = self.order[lo:hi]
        if not len(found):
            return None
        same = (self.offsets[found] == np.asarray(offsets, dtype=np.int64)).all(axis=1)
        hits = found[same]
        return int(hits.max()) if len(hits) else None


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
                 rows: np.ndarray) -> None:
        self.properties = properties
        self.size = size
        self._columns = columns
        self._rows = rows
        self._chunks: list[ChunkStorageMetadata] | None = None
        self._index: ChunkIndex | None = None

    @property  # type: ignore[override]
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
                dims = len(self.size)
                self._index = ChunkIndex(self._columns.matrix(0, self._rows, dims),
                                         self._columns.matrix(1, self._rows, dims))
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
            index = entry.index()
            if tuple(index.offsets[hint].tolist()) == offsets:
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
