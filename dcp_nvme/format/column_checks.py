"""``validation.check_chunks`` on the index as columns (``columns.ChunkColumns``).

Each check is a numpy screen over all rows that finds the rows, files or tensors that may be
wrong; only those go through the row-by-row checks of ``validation`` (``check_row``,
``check_file_rows``, ``tiling_problem``), which raise the error. So a good index costs array
passes and no Python object per row, and a bad one raises exactly what ``check_chunks`` would:
the screens may flag too much (the exact check then passes), never too little."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow.compute as pc

from ..errors import ManifestError
from .columns import ChunkColumns, as_numpy
from .container import MAX_NDIM, dtype_itemsize
from .names import check_name
from .validation import check_file_rows, check_row, tiling_problem

LIMIT = float(1 << 62)
"""Above this a product or sum in int64 may have wrapped: such rows take the exact check."""


def _per_row(flags: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Whether any flag is set in each row's slice ``[starts[r], starts[r + 1])``."""
    total = np.zeros(len(flags) + 1, dtype=np.int64)
    np.cumsum(flags, out=total[1:])
    return total[starts[1:]] > total[starts[:-1]]


class _Screen:
    """What the per-row screen finds besides suspects: each row's element count and itemsize."""

    def __init__(self, cols: ChunkColumns, doc: dict[str, Any]) -> None:
        self.cols = cols
        n = len(cols)
        self.suspect = np.zeros(n, dtype=bool)
        self.elements = np.zeros(n, dtype=np.int64)
        self.elements_f = np.zeros(n, dtype=np.float64)
        sizes = {f["name"]: f["size"] for f in doc["files"]}
        key = doc["save_key"]
        # names: each distinct value once
        for codes, names in ((cols.fqn, cols.fqns),):
            bad = [i for i, name in enumerate(names) if not name]
            if bad:
                self.suspect |= np.isin(codes, bad)
        empty_key = np.flatnonzero(as_numpy(pc.binary_length(cols.keys), np.int64) == 0)
        if len(empty_key):
            self.suspect |= np.isin(cols.key, empty_key)
        file_size = np.zeros(len(cols.files), dtype=np.int64)
        bad_files = []
        for i, name in enumerate(cols.files):
            try:
                check_name(name, "data", key, "")
            except ManifestError:
                bad_files.append(i)
                continue
            if name not in sizes:
                bad_files.append(i)
            else:
                file_size[i] = sizes[name]
        if bad_files:
            self.suspect |= np.isin(cols.file, bad_files)
        # kinds and dtypes
        tensor = np.array([k == "tensor" for k in cols.kinds], dtype=bool)[cols.kind] if n else np.zeros(0, bool)
        known = np.array([k in ("tensor", "bytes") for k in cols.kinds], dtype=bool)[cols.kind] if n else tensor
        self.suspect |= ~known
        itemsizes = []
        for name in cols.dtypes:
            try:
                itemsizes.append(dtype_itemsize(name))  # by name: no torch import
            except ManifestError:
                itemsizes.append(0)
        itemsize = np.array(itemsizes, dtype=np.int64)[cols.dtype] if n else np.zeros(0, np.int64)
        self.itemsize = itemsize
        no, ns, ng = cols.ndim
        nonbytes = (no != 0) | (ns != 0) | (ng != 0)
        u8 = np.array([d == "uint8" for d in cols.dtypes], dtype=bool)[cols.dtype] if n else tensor
        self.suspect |= ~tensor & known & (nonbytes | ~u8)
        self.suspect |= tensor & ((itemsize == 0) | (no != ns) | (ns != ng) | (no > MAX_NDIM))
        # bounds and lengths, on the tensor rows whose three lists agree
        ok = tensor & ~self.suspect
        self.elements[~tensor] = 0
        rows = np.flatnonzero(ok)
        for dims in np.unique(no[rows]).tolist() if len(rows) else []:
            group = rows[no[rows] == dims]
            off, size, shape = (cols.matrix(w, group, dims) for w in range(3))
            bad = ((off < 0) | (size < 0) | (size > shape) | (off > shape - size)).any(axis=1)
            count = np.prod(size, axis=1, dtype=np.int64) if dims else np.ones(len(group), np.int64)
            count_f = np.prod(size.astype(np.float64), axis=1) if dims else np.ones(len(group))
            nbytes_f = count_f * itemsize[group]
            bad |= (nbytes_f > LIMIT) | (count * itemsize[group] != cols.length[group])
            self.suspect[group] |= bad
            self.elements[group] = count
            self.elements_f[group] = count_f
        # inside its file, past the 8-byte length prefix
        limit = file_size[cols.file] if n else np.zeros(0, np.int64)
        self.suspect |= (cols.byte_offset < 8) | (cols.length < 0) | (cols.byte_offset > limit - cols.length)


def check_columns(cols: ChunkColumns, doc: dict[str, Any], where: str) -> None:
    """``validation.check_chunks`` on columns: raises the ManifestError it would raise."""
    n = len(cols)
    if not n:
        return
    screen = _Screen(cols, doc)
    if screen.suspect.any():
        sizes = {f["name"]: f["size"] for f in doc["files"]}
        for row in np.flatnonzero(screen.suspect).tolist():
            check_row(cols.record(row), sizes, doc["save_key"], where)
    _check_files(cols, where)
    _check_tilings(cols, screen, where)


def _first_use_order(codes: np.ndarray, suspects: list[int]) -> list[int]:
    """``suspects`` (codes) in the order their first row appears."""
    _, first = np.unique(codes, return_index=True)
    position = dict(zip(np.unique(codes).tolist(), first.tolist()))
    return sorted(suspects, key=lambda c: position[c])


def _check_files(cols: ChunkColumns, where: str) -> None:
    """Per file: keys once, no shared bytes (``check_file_rows`` on the files the screen flags)."""
    suspects: set[int] = set()
    pair = cols.file.astype(np.int64) * max(len(cols.keys), 1) + cols.key
    ordered = np.sort(pair)
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(dup):
        suspects.update((ordered[dup] // max(len(cols.keys), 1)).tolist())
    live = np.flatnonzero(cols.length > 0)
    order = live[np.lexsort((cols.length[live], cols.byte_offset[live], cols.file[live]))]
    same = cols.file[order[1:]] == cols.file[order[:-1]]
    ends = cols.byte_offset[order[:-1]] + cols.length[order[:-1]]
    shared = np.flatnonzero(same & (cols.byte_offset[order[1:]] < ends))
    if len(shared):
        suspects.update(cols.file[order[shared]].tolist())
    if suspects:
        by_file = cols.by_file()
        for code in _first_use_order(cols.file, sorted(suspects)):
            name = cols.files[code]
            check_file_rows(name, cols.records(by_file[name]), where)


def _check_tilings(cols: ChunkColumns, screen: _Screen, where: str) -> None:
    """Per tensor: rows agree, their elements add up to the shape's, none overlap
    (``tiling_problem`` on the tensors the screen flags)."""
    order, first, counts = cols.groups(cols.fqn)
    codes = cols.fqn[order[first]]
    suspects = np.zeros(len(first), dtype=bool)
    group_of = np.repeat(np.arange(len(first)), counts)  # position in ``order`` -> group
    same = np.diff(group_of) == 0 if len(order) > 1 else np.zeros(0, bool)
    a, b = order[:-1], order[1:]
    differ = (cols.kind[a] != cols.kind[b]) | (cols.dtype[a] != cols.dtype[b])
    for w in range(3):
        differ |= cols.ndim[w][a] != cols.ndim[w][b]
    suspects[group_of[1:][same & differ]] = True
    kinds = np.array([k == "bytes" for k in cols.kinds], dtype=bool)
    is_bytes = kinds[cols.kind[order[first]]]
    suspects |= is_bytes & (counts > 1)
    # shapes per ndim, compared with the row before in the same tensor
    ndim = cols.ndim[2]
    for dims in np.unique(ndim).tolist():
        positions = np.flatnonzero(ndim[order] == dims)
        if len(positions) < 2 or not dims:
            continue
        shape = cols.matrix(2, order[positions], dims)
        neighbour = (group_of[positions[1:]] == group_of[positions[:-1]]) & \
            (shape[1:] != shape[:-1]).any(axis=1)
        suspects[group_of[positions[1:]][neighbour]] = True
    # elements: the chunks' sum against the shape's product (a Python int per tensor)
    elements = np.add.reduceat(screen.elements[order], first)
    elements_f = np.add.reduceat(screen.elements_f[order], first)
    for g in np.flatnonzero(~is_bytes & ~suspects).tolist():
        row = int(order[first[g]])
        expected = math.prod(cols.list_of(2, row))
        if elements_f[g] > LIMIT or int(elements[g]) != expected:
            suspects[g] = True
    _screen_overlaps(cols, screen, order, first, counts, group_of, suspects, is_bytes)
    flagged = np.flatnonzero(suspects)
    if len(flagged):
        for code in _first_use_order(cols.fqn, codes[flagged].tolist()):
            g = int(np.searchsorted(codes, code))  # codes ascend: ``order`` sorts by them
            message = tiling_problem(cols.records(order[first[g]:first[g] + counts[g]]))
            if message:
                raise ManifestError(f"{where}: {cols.fqns[code]!r}: {message}")


def _screen_overlaps(cols, screen, order, first, counts, group_of, suspects, is_bytes) -> None:
    """A tensor with more than one non-empty chunk is clear when, along some dimension, its
    chunks sorted by start each begin at or after the previous one's end (then no two meet);
    else it is flagged for the exact sweep."""
    live_pos = np.flatnonzero(screen.elements[order] > 0)
    groups_live = np.bincount(group_of[live_pos], minlength=len(first))
    multi = (groups_live > 1) & ~suspects & ~is_bytes
    if not multi.any():
        return
    pos = live_pos[multi[group_of[live_pos]]]
    ndim = cols.ndim[0][order[pos]]
    for dims in np.unique(ndim).tolist():
        these = pos[ndim == dims]
        rows = order[these]
        groups = group_of[these]
        off = cols.matrix(0, rows, dims)
        size = cols.matrix(1, rows, dims)
        clear = np.zeros(len(first), dtype=bool)
        for d in range(dims):
            sort = np.lexsort((off[:, d], groups))
            g, start = groups[sort], off[sort, d]
            end = start + size[sort, d]
            meet = (g[1:] == g[:-1]) & (start[1:] < end[:-1])
            touched = np.zeros(len(first), dtype=bool)
            touched[g[1:][meet]] = True
            clear |= ~touched
        present = np.zeros(len(first), dtype=bool)
        present[groups] = True
        suspects |= present & ~clear
