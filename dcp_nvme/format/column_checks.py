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

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.columns import ChunkColumns
from dcp_nvme.format.container import MAX_NDIM, check_name, dtype_itemsize
from dcp_nvme.format.tables import as_numpy
from dcp_nvme.format.validation import check_chunks, check_file_rows, check_row, tiling_problem

LIMIT = float(1 << 62)
"""Above this a product or sum in int64 may have wrapped: such rows take the exact check."""


class _Screen:
    """What the per-row screen finds besides suspects: each row's element count and itemsize."""

    def __init__(self, cols: ChunkColumns, doc: dict[str, Any]) -> None:
        self.cols = cols
        n = len(cols)
        self.suspect = np.zeros(n, dtype=bool)
        self.elements = np.zeros(n, dtype=np.int64)
        self.elements_f = np.zeros(n, dtype=np.float64)
        """Element counts as floats, to see an int64 sum wrap; left at zero when ``exact``."""
        self.exact = True
        """Whether no count or sum of counts can wrap (then ``elements_f`` is not made)."""
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
        # kinds and dtypes, judged once per (kind, dtype) pair: a row looks its pair up
        itemsizes = []
        for name in cols.dtypes:
            try:
                itemsizes.append(dtype_itemsize(name))  # by name: no torch import
            except ManifestError:
                itemsizes.append(0)
        pairs = len(cols.dtypes)
        wide = np.int64 if pairs * len(cols.kinds) >= 1 << 31 else np.int32  # only a forged table's are
        pair = cols.kind.astype(wide) * pairs + cols.dtype
        pair_tensor = np.repeat([k == "tensor" for k in cols.kinds], pairs)
        pair_size = np.tile(np.array(itemsizes, dtype=np.int8), len(cols.kinds))  # at most 16 bytes
        pair_bytes_ok = np.repeat([k == "bytes" for k in cols.kinds], pairs) & \
            np.tile([d == "uint8" for d in cols.dtypes], len(cols.kinds))
        tensor = pair_tensor[pair]
        itemsize = self.itemsize = pair_size[pair]
        no, ns, ng = cols.ndim
        bad_bytes = ~pair_bytes_ok[pair] | (no != 0) | (ns != 0) | (ng != 0)
        self.suspect |= np.where(tensor, (itemsize == 0) | (no != ns) | (ns != ng) | (no > MAX_NDIM), bad_bytes)
        # bounds and lengths, on the tensor rows whose three lists agree (padding passes both)
        ok = tensor & ~self.suspect
        whole = bool(ok.all())  # no gather: the grids are the rows
        rows = None if whole else np.flatnonzero(ok)
        if rows is None or len(rows):  # rows is None: whole
            off, size, shape = (g if whole else g[rows] for g in cols.grid)
            pick = (lambda a: a) if whole else (lambda a: a[rows])
            bad = ((off < 0) | (size < 0) | (size > shape) | (off > shape - size)).any(axis=1)
            count = np.prod(size, axis=1, dtype=np.int64)
            largest = int(size.max(initial=0))
            # no product nor sum of them can wrap when the largest possible one is far from it
            self.exact = largest ** cols.width * max(itemsizes + [1]) * max(n, 1) < LIMIT
            if self.exact:
                bad |= count * pick(itemsize) != pick(cols.length)
            else:
                count_f = np.prod(size.astype(np.float64), axis=1)
                bad |= (count_f * pick(itemsize) > LIMIT) | (count * pick(itemsize) != pick(cols.length))
                self.elements_f[rows] = count_f
            if whole:
                self.suspect |= bad
                self.elements = count
            else:
                self.suspect[rows] |= bad
                self.elements[rows] = count
        # inside its file, past the 8-byte length prefix
        limit = file_size[cols.file] if n else np.zeros(0, np.int64)
        self.suspect |= (cols.byte_offset < 8) | (cols.length < 0) | (cols.byte_offset > limit - cols.length)


SMALL_INDEX = 32
"""Up to this many rows the row checks themselves (``check_chunks``) cost less than setting up
the screens (a fixed half millisecond or so)."""


def check_columns(cols: ChunkColumns, doc: dict[str, Any], where: str) -> None:
    """``validation.check_chunks`` on columns: raises the ManifestError it would raise."""
    n = len(cols)
    if not n:
        return
    if n <= SMALL_INDEX:
        check_chunks(list(cols.records()), doc, where)
        return
    screen = _Screen(cols, doc)
    if screen.suspect.any():
        sizes = {f["name"]: f["size"] for f in doc["files"]}
        for row in np.flatnonzero(screen.suspect).tolist():
            check_row(cols.record(row), sizes, doc["save_key"], where)
    _check_files(cols, where, screen)
    _check_tilings(cols, screen, where)


def _first_use_order(codes: np.ndarray, suspects: list[int]) -> list[int]:
    """``suspects`` (codes) in the order their first row appears."""
    _, first = np.unique(codes, return_index=True)
    position = dict(zip(np.unique(codes).tolist(), first.tolist()))
    return sorted(suspects, key=lambda c: position[c])


def _check_files(cols: ChunkColumns, where: str, screen: _Screen | None = None) -> None:
    """Per file: keys once, no shared bytes (``check_file_rows`` on the files the screen flags).

    With default keys and a ``screen``, keys are compared only among the rows of tensors with
    an empty chunk: two non-empty chunks with one key have the same offsets, so they overlap,
    and ``_check_tilings`` flags their tensor; it then calls this again without a screen before
    it raises, so the error is the one the row checks give first."""
    suspects: set[int] = set()
    if cols.derived_keys:
        # format 4: two chunks of one fqn in a file share its key, whatever their offsets
        near = None if screen is None or cols.fqn_keys else _rows_near_empty(cols, screen)
        suspects.update(_derived_key_suspects(cols, near))
    else:
        pair = cols.file.astype(np.int64) * max(len(cols.keys), 1) + cols.key
        ordered = np.sort(pair)
        dup = np.flatnonzero(ordered[1:] == ordered[:-1])
        if len(dup):
            suspects.update((ordered[dup] // max(len(cols.keys), 1)).tolist())
    live = np.flatnonzero(cols.length > 0)
    file, start, length = cols.file[live], cols.byte_offset[live], cols.length[live]
    sorted_already = ((file[1:] > file[:-1]) | ((file[1:] == file[:-1]) & (
        (start[1:] > start[:-1]) | ((start[1:] == start[:-1]) & (length[1:] >= length[:-1]))))).all()
    order = live if sorted_already else live[np.lexsort((length, start, file))]  # rank order often is
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


def _rows_near_empty(cols: ChunkColumns, screen: _Screen) -> np.ndarray:
    """The rows of every tensor (or bytes item) that has an empty chunk."""
    marked = np.zeros(len(cols.fqns), dtype=bool)
    marked[cols.fqn[screen.elements == 0]] = True
    return np.flatnonzero(marked[cols.fqn])


def _derived_key_suspects(cols: ChunkColumns, rows: np.ndarray | None = None) -> list[int]:
    """Files where two rows may have the same default key. The key is the fqn, plus the offsets
    when one is non-zero: rows hash by file, fqn and (then) their offsets; equal hashes flag their
    file (a collision only costs an exact check). An fqn with an ``@`` could spell another row's
    key ("a@1" and "a" at offset 1): the files of such names are flagged outright. Format 4
    (``fqn_keys``): the key is the fqn, rows hash by file and fqn alone."""
    every = rows is None
    pick = (lambda a: a) if every else (lambda a: a[rows])
    offsets = pick(cols.grid[0]).astype(np.uint64)  # padded with zeros: they add nothing
    weights = np.array([pow(0x9E3779B97F4A7C15, k + 1, 1 << 64) for k in range(cols.width)], dtype=np.uint64)
    with np.errstate(over="ignore"):
        # each row's offsets folded into one number, sum of value * weight(position), mod 2^64
        folded = (offsets * weights).sum(axis=1, dtype=np.uint64)
        tensor = np.array([k == "tensor" for k in cols.kinds], dtype=bool)[pick(cols.kind)]
        with_offsets = (offsets != 0).any(axis=1) & tensor & (not cols.fqn_keys)
        file = pick(cols.file)
        ident = (file.astype(np.uint64) << np.uint64(32)) ^ pick(cols.fqn).astype(np.uint64)
        ident = ident * np.uint64(0xBF58476D1CE4E5B9) + np.where(
            with_offsets, folded + pick(cols.ndim[0]).astype(np.uint64) + np.uint64(1), np.uint64(0))
    flagged: set[int] = set()
    if cols.longer[0]:  # rows past the grid (a damaged table's): their files are checked outright
        flagged.update(int(cols.file[row]) for row in cols.longer[0])
    ordered = np.sort(ident)
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(dup):
        flagged.update(np.unique(file[np.isin(ident, ordered[dup])]).tolist())
    spelled = [] if cols.fqn_keys else [i for i, name in enumerate(cols.fqns) if "@" in name]
    if spelled:
        flagged.update(np.unique(cols.file[np.isin(cols.fqn, spelled)]).tolist())
    return sorted(flagged)


def _check_tilings(cols: ChunkColumns, screen: _Screen, where: str) -> None:
    """Per tensor: rows agree, their elements add up to the shape's, none overlap
    (``tiling_problem`` on the tensors the screen flags)."""
    order, first, counts = cols.groups(cols.fqn)
    codes = cols.fqn[order[first]]
    suspects = np.zeros(len(first), dtype=bool)
    group_of = np.repeat(np.arange(len(first), dtype=np.int32), counts)  # position in ``order`` -> group
    # kind, dtype, dimensions and shape: every row as its tensor's first (a gather from a small
    # table per column, no pass in ``order``; padding is equal)
    first_row = order[first]
    group = np.zeros(len(cols.fqns), dtype=np.int32)
    group[codes] = np.arange(len(first))
    of_row = group[cols.fqn]
    differ = np.zeros(len(cols), dtype=bool)
    for column in (cols.kind, cols.dtype, *cols.ndim):
        differ |= column != column[first_row][of_row]
    if cols.width:
        differ |= (cols.grid[2] != cols.grid[2][first_row][of_row]).any(axis=1)
    suspects[of_row[differ]] = True
    kinds = np.array([k == "bytes" for k in cols.kinds], dtype=bool)
    is_bytes = kinds[cols.kind[first_row]]
    suspects |= is_bytes & (counts > 1)
    # elements: the chunks' sum against the shape's product (a Python int per tensor)
    elements = np.add.reduceat(screen.elements[order], first)
    elements_f = np.zeros(len(first)) if screen.exact else np.add.reduceat(screen.elements_f[order], first)
    for g in np.flatnonzero(~is_bytes & ~suspects).tolist():
        row = int(order[first[g]])
        expected = math.prod(cols.list_of(2, row))
        if elements_f[g] > LIMIT or int(elements[g]) != expected:
            suspects[g] = True
    _screen_overlaps(cols, screen, order, first, counts, group_of, suspects, is_bytes)
    flagged = np.flatnonzero(suspects)
    if len(flagged):
        if cols.derived_keys:  # a key twice in a file may be behind it: that error comes first
            _check_files(cols, where)
        for code in _first_use_order(cols.fqn, codes[flagged].tolist()):
            g = int(np.searchsorted(codes, code))  # codes ascend: ``order`` sorts by them
            message = tiling_problem(cols.records(order[first[g]:first[g] + counts[g]]))
            if message:
                raise ManifestError(f"{where}: {cols.fqns[code]!r}: {message}")


def _screen_overlaps(cols, screen, order, first, counts, group_of, suspects, is_bytes) -> None:
    """A tensor with more than one non-empty chunk is clear when, along some dimension, its
    chunks sorted by start each begin at or after the previous one's end (then no two meet);
    else it is flagged for the exact sweep. One dimension's starts and sizes are gathered at a
    time (FSDP's tensors all clear along the first)."""
    live = (screen.elements > 0)[order]
    groups_live = np.add.reduceat(live, first, dtype=np.int64) if len(first) else np.zeros(0, np.int64)
    multi = (groups_live > 1) & ~suspects & ~is_bytes
    if not multi.any():
        return
    keep = live & multi[group_of]
    pos = None if keep.all() else np.flatnonzero(keep)  # positions in ``order`` of the rows swept
    rows = order if pos is None else order[pos]
    groups = group_of if pos is None else group_of[pos]
    del live, keep, pos
    present = np.zeros(len(first), dtype=bool)
    present[groups] = True
    clear = np.zeros(len(first), dtype=bool)
    step = groups[1:] == groups[:-1]
    for d in range(cols.width):  # a padded dimension (offset 0, size 1) never clears a tensor
        g, start, size = groups, cols.grid[0][rows, d], cols.grid[1][rows, d]
        same = step
        if not (~same | (start[1:] >= start[:-1])).all():  # rank order is often sorted already
            sort = np.lexsort((start, g))
            g, start, size = g[sort], start[sort], size[sort]
            same = g[1:] == g[:-1]
        end = start + size
        meet = same & (start[1:] < end[:-1])
        touched = np.zeros(len(first), dtype=bool)
        touched[g[1:][meet]] = True
        clear |= ~touched
        if clear[present].all():
            break
    suspects |= present & ~clear
