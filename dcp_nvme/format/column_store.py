"""Checked index columns as one flat file, mapped by the other ranks of a node (pure).

The first rank of a node that reads a checkpoint decodes and checks its index
(``columns.ChunkColumns``); the node's other ranks map this file instead of decoding the
index again, so a node holds one copy of the arrays, not one per rank. Layout: the arrays,
each at a 64-byte boundary, then a JSON footer (names, dtypes, shapes, offsets, the distinct
strings, the crc32c of the arrays), its length (8 bytes, little-endian) and ``MAGIC``.

Only columns of default keys and no over-long rows are stored (``storable``): what a checked
index written by this dcp_nvme holds."""

from __future__ import annotations

import json
import struct
from typing import Any, TypeGuard

import crc32c
import numpy as np
import pyarrow as pa

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.columns import ChunkColumns, no_keys

MAGIC = b"DCPNVME-COLUMNS-1"
ALIGN = 64
_TAIL = struct.Struct("<Q")

_ARRAYS = ("fqn", "kind", "dtype", "file", "ndim0", "ndim1", "ndim2", "grid0", "grid1", "grid2",
           "byte_offset", "length")
_DTYPES = {"fqn": "<i4", "kind": "<i4", "dtype": "<i4", "file": "<i4", "ndim0": "|i1", "ndim1": "|i1", "ndim2": "|i1"}
_NAMES = ("fqns", "kinds", "dtypes", "files")
MAX_FOOTER = 1 << 30


def _is_count(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0


def storable(cols: ChunkColumns) -> bool:
    return cols.derived_keys and not any(cols.longer)


def _arrays(cols: ChunkColumns) -> dict[str, np.ndarray]:
    out = {"fqn": cols.fqn, "kind": cols.kind, "dtype": cols.dtype, "file": cols.file,
           "byte_offset": cols.byte_offset, "length": cols.length}
    for i in range(3):
        out[f"ndim{i}"], out[f"grid{i}"] = cols.ndim[i], cols.grid[i]
    return {name: np.ascontiguousarray(out[name], dtype=_DTYPES.get(name, "<i8")) for name in _ARRAYS}


def encode(cols: ChunkColumns, source: dict[str, Any]) -> list[bytes | memoryview]:
    """The file's pieces, to be written in order. ``source`` names the index the columns come
    from (kept in the footer; the reader compares it)."""
    pieces: list[bytes | memoryview] = []
    entries, offset, crc = {}, 0, 0
    for name, array in _arrays(cols).items():
        pad = -offset % ALIGN
        if pad:
            pieces.append(b"\0" * pad)
            crc = crc32c.crc32c(b"\0" * pad, crc)
            offset += pad
        raw = memoryview(array).cast("B")  # type: ignore[arg-type]  # numpy stubs: ndarray a Buffer on 3.12+ only
        pieces.append(raw)
        crc = crc32c.crc32c(raw, crc)
        entries[name] = [offset, array.dtype.str, list(array.shape)]
        offset += raw.nbytes
    footer = json.dumps({"rows": len(cols), "width": cols.width, "arrays": entries, "body_bytes": offset,
                         "body_crc32c": crc, "source": source,
                         **{name: getattr(cols, name) for name in _NAMES}}).encode()
    return pieces + [footer, _TAIL.pack(len(footer)), MAGIC]


def decode(buffer: memoryview, source: dict[str, Any], what: str) -> ChunkColumns:
    """Columns over ``buffer`` (no copy: the arrays are views of it, read-only). Everything the
    footer says is checked against the buffer before an array is made; any mismatch raises
    ManifestError, and the caller decodes the index itself instead."""
    size = len(buffer)
    tail = len(MAGIC) + _TAIL.size
    if size < tail or bytes(buffer[size - len(MAGIC):]) != MAGIC:
        raise ManifestError(f"{what}: not a column file")
    (length,) = _TAIL.unpack(buffer[size - tail:size - len(MAGIC)])
    if length > min(MAX_FOOTER, size - tail):
        raise ManifestError(f"{what}: footer length {length} is out of range")
    try:
        footer = json.loads(bytes(buffer[size - tail - length:size - tail]))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"{what}: footer is not JSON: {exc}") from None
    if not isinstance(footer, dict) or footer.get("source") != source:
        raise ManifestError(f"{what}: made from another index")
    rows, width, body = footer.get("rows"), footer.get("width"), footer.get("body_bytes")
    if not (_is_count(rows) and _is_count(width) and _is_count(body)) or body > size - tail - length:
        raise ManifestError(f"{what}: rows, width or body size out of range")
    if crc32c.crc32c(buffer[:body]) != footer.get("body_crc32c"):
        raise ManifestError(f"{what}: the arrays fail their checksum")
    arrays: dict[str, np.ndarray] = {}
    entries = footer.get("arrays")
    if not isinstance(entries, dict) or sorted(entries) != sorted(_ARRAYS):
        raise ManifestError(f"{what}: wrong array list")
    for name in _ARRAYS:
        offset, dtype, shape = entries[name]
        want = [rows, width] if name.startswith("grid") else [rows]
        if dtype != _DTYPES.get(name, "<i8") or shape != want or type(offset) is not int or offset % ALIGN:
            raise ManifestError(f"{what}: array {name} is not as written")
        count = rows * (width if name.startswith("grid") else 1)
        nbytes = count * np.dtype(dtype).itemsize
        if offset < 0 or offset + nbytes > body:
            raise ManifestError(f"{what}: array {name} lies outside the body")
        arrays[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(want)
    names: list[Any] = [footer.get(name) for name in _NAMES]  # checked to be lists of str just below
    if not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in names):
        raise ManifestError(f"{what}: the distinct names are not lists of strings")
    for name, distinct in zip(("fqn", "kind", "dtype", "file"), names):
        codes = arrays[name]
        if len(codes) and (int(codes.min()) < 0 or int(codes.max()) >= len(distinct)):
            raise ManifestError(f"{what}: array {name} holds codes outside its names")
    # keys: the default ones only (``storable``)
    return ChunkColumns(
        arrays["fqn"], names[0], arrays["kind"], names[1], arrays["dtype"], names[2], arrays["file"], names[3],
        no_keys(rows), pa.nulls(0, pa.string()),
        (arrays["ndim0"], arrays["ndim1"], arrays["ndim2"]),
        (arrays["grid0"], arrays["grid1"], arrays["grid2"]), ({}, {}, {}), arrays["byte_offset"], arrays["length"])
