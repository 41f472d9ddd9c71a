"""Block checksums, one home: which checksum blocks a byte range holds, their crc32c computed on
the host or on the device, checking them, naming the items a bad range hits, and the size and
crc32c check of the manifest's tables.

A container's header has one crc32c; its data region is cut into ``checksum_block`` bytes (the
last shorter), each with its crc32c in the blocks table. A *check* is ``(offset, length,
expected crc32c)`` with ``offset`` relative to the start of the bytes at hand (a read request, a
drained piece, a verify span), so errors can name file offsets. Engines, the reader, ``verify``
and the drain all check through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import crc32c

from dcp_nvme.errors import ChecksumMismatchError, TableError

if TYPE_CHECKING:
    pass

Check = tuple[int, int, int]
"""``(offset, length, expected_crc32c)``, offset relative to the bytes being checked."""


# --------------------------------------------------------------------------- which blocks


def checks_within(record: Any, start: int, end: int) -> list[Check]:
    """The checks of ``record`` (a ``FileRecord``) that lie wholly inside file bytes
    ``[start, end)``: the header when the range holds all of it, then every whole data block."""
    checks: list[Check] = []
    if start == 0 and end >= record.data_start:
        checks.append((0, record.data_start, record.header_crc))
    block = record.checksum_block
    first = max(0, -(-(start - record.data_start) // block))
    for index in range(first, len(record.crcs)):
        lo = record.data_start + index * block
        hi = min(lo + block, record.size)
        if hi > end:
            break
        checks.append((lo - start, hi - lo, record.crcs[index]))
    return checks


# --------------------------------------------------------------------------- host crc32c


def host_crcs(views: Sequence[memoryview], checks: Sequence[Check]) -> list[int]:
    """The crc32c of each check's range of ``views`` taken back to back (checks in order)."""
    actual = []
    position, index = 0, 0  # start offset of views[index] within the concatenation
    for rel, length, _ in checks:
        while position + len(views[index]) <= rel:
            position += len(views[index])
            index += 1
        crc, cursor, i, pos = 0, rel, index, position
        while cursor < rel + length:
            view = views[i]
            take = view[cursor - pos : min(len(view), rel + length - pos)]
            crc = crc32c.crc32c(take, crc)
            cursor += len(take)
            pos += len(view)
            i += 1
        actual.append(crc)
    return actual


# --------------------------------------------------------------------------- checking


def mismatches(checks: Sequence[Check], actual: Sequence[int]) -> list[tuple[Check, int]]:
    """Each check whose computed crc differs, with that crc."""
    return [(check, crc) for check, crc in zip(checks, actual) if crc != check[2]]


def raise_on_mismatch(path: str, base: int, checks: Sequence[Check], actual: Sequence[int]) -> None:
    """Raise ChecksumMismatchError for the first bad check, naming ``path`` and file offsets
    (``base`` is the file offset of the checked bytes)."""
    for (rel, length, expected), crc in mismatches(checks, actual)[:1]:
        raise ChecksumMismatchError(path, base + rel, base + rel + length, expected, crc)


def check_host(path: str, base: int, checks: Sequence[Check], views: Sequence[memoryview]) -> None:
    """Check host bytes (``views`` back to back, at file offset ``base``)."""
    if checks:
        raise_on_mismatch(path, base, checks, host_crcs(views, checks))


def items_in(spans: Iterable[tuple[int, int, str]], start: int, end: int) -> tuple[str, ...]:
    """The names of the ``(start, end, name)`` spans that overlap ``[start, end)``, each once,
    in file order."""
    hits = sorted((lo, name) for lo, hi, name in spans if lo < end and start < hi)
    return tuple(dict.fromkeys(name for _, name in hits))


def check_table(location: str, entry: dict[str, Any], data: bytes) -> None:
    """A manifest table's bytes must have the size and crc32c ``manifest.json`` recorded."""
    actual = crc32c.crc32c(data)
    if len(data) != entry["size"] or actual != entry["crc32c"]:
        raise TableError(
            entry["name"],
            f"{location}: {entry['name']} does not match manifest.json (size {len(data)} vs "
            f"{entry['size']}, crc32c {actual:#010x} vs {entry['crc32c']:#010x}): the table is "
            "corrupt or was modified after the save",
        )


# --------------------------------------------------------------------------- crc32c of a span


_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli
_shift_ops: dict[int, list[int]] = {}


def _times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _shift_op(length: int) -> list[int]:
    """The GF(2) operator that appends ``length`` zero bytes to a crc32c (zlib's crc32_combine),
    cached per length: a file's blocks share one or two lengths."""
    found = _shift_ops.get(length)
    if found is not None:
        return found
    op = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
    result = [1 << n for n in range(32)]  # identity
    bits = length * 8
    while bits:
        if bits & 1:
            result = [_times(op, column) for column in result]
        op = [_times(op, column) for column in op]
        bits >>= 1
    _shift_ops[length] = result
    return result


def crc32c_combine(crc1: int, crc2: int, length2: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    return _times(_shift_op(length2), crc1) ^ crc2 if length2 else crc1


def span_crc(checks: Sequence[Check], length: int) -> int | None:
    """The crc32c of ``length`` bytes from the expected crcs of checks that tile them exactly
    (checked bytes: no byte is hashed again), or None when the checks leave a gap."""
    crc, covered = 0, 0
    for rel, size, expected in checks:
        if rel != covered:
            return None
        crc = crc32c_combine(crc, expected, size)
        covered += size
    return crc if covered == length else None
