"""Lossless byte-grouped coding of tensor bytes (pure: bytes in, bytes out, no I/O).

A float's bytes are not alike: the byte holding the sign and exponent repeats a few values,
the low mantissa bytes are close to random. Coding them apart ("byte planes": bf16/fp16 -> 2,
fp32 -> 4; one plane for anything else) lets zstd find the exponent's redundancy, and a plane
that zstd cannot shrink is stored raw instead of paying the coder for nothing.

Data is coded in independent chunks (default 2 MiB of decoded bytes, cut on element
boundaries), so chunks are encoded and decoded in parallel (zstd releases the GIL) and a
ranged read decodes only the chunks it overlaps. Every chunk carries the crc32c of its decoded
bytes, checked on decode. With a ``base`` of the same length (an earlier checkpoint's bytes)
a chunk codes the XOR with it instead (delta mode); XOR of bytes is XOR of their planes. A
delta chunk names where its base bytes lie in the base file (``base_offset``): the same tensor
may sit at another offset there (the container's placement follows memory addresses).

Container (``.dcz``), all integers little-endian; see docs/format.md:

    header  magic "DCPNVZC1", u16 version (2; 1 is read), u16 flags, u32 chunk count,
            u64 decoded size, u32 crc32c of the chunk table
    table   per chunk: u64 decoded offset, u32 decoded length, u64 stored offset,
            u32 stored length, u32 crc32c of the decoded bytes, u8 planes, u8 flags,
            (version 2) u64 base offset (a delta chunk's bytes in its base file; version 1: its own)
    chunks  per chunk: per plane u8 mode (0 raw, 1 zstd) + u32 stored length, then the planes
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import numpy as np
import zstandard

from dcp_nvme.errors import CodecError

CODEC = "bytegroup"
CODEC_VERSION = 2
"""Version 2 adds each chunk's base offset (deltas per tensor); version 1 containers are read."""
READABLE_VERSIONS = (1, 2)
MAGIC = b"DCPNVZC1"
DEFAULT_LEVEL = 1
"""zstd level by measurement (`dcp-nvme bench --compress --levels 1,3` on a trained state):
byte-grouped planes are mostly entropy-coded, so a higher level's longer match search finds
little; level 1 codes about as small as 3 and faster (figures: docs/benchmarks.md, Compression)."""
DEFAULT_CHUNK = 2 << 20
MAX_CHUNK = 64 << 20
"""Bound on one chunk's decoded length read from a container (an allocation)."""

RAW, ZSTD = 0, 1
DELTA = 1
"""Chunk flag: the chunk codes the XOR with the same bytes of a base checkpoint."""

_HEADER = struct.Struct("<8sHHIQI")
_ENTRY_V1 = struct.Struct("<QIQIIBB")
_ENTRY = struct.Struct("<QIQIIBBQ")
_PLANE = struct.Struct("<BI")
_SAMPLE = 64 << 10
_MIN_GAIN = 0.97
"""A plane is coded only when a sample of it shrinks below this fraction; else it goes raw."""

HEADER_SIZE = _HEADER.size
ENTRY_SIZE = _ENTRY.size
"""A chunk table row of the version written (``entry_size`` for another)."""


def entry_size(version: int = CODEC_VERSION) -> int:
    """Bytes per chunk table row in a container of ``version``."""
    return _ENTRY_V1.size if version == 1 else _ENTRY.size

_PLANES = {"bfloat16": 2, "float16": 2, "float32": 4}


def planes_for(dtype: str | None) -> int:
    """Byte planes for a dtype name (``bfloat16``, ``float32``...): 2, 4, or 1 (plain)."""
    return _PLANES.get(dtype or "", 1)


@dataclass(frozen=True)
class Chunk:
    """A range of decoded bytes coded on its own, split into ``planes`` byte planes."""

    offset: int
    length: int
    planes: int = 1
    base: int | None = None
    """A delta chunk: where its base bytes start in the base file (None: coded full)."""


@dataclass(frozen=True)
class Entry:
    """One row of a container's chunk table."""

    offset: int
    length: int
    stored_offset: int
    stored_length: int
    crc: int
    planes: int
    flags: int = 0
    base_offset: int = 0
    """A delta chunk's first byte in its base file (0 for a chunk coded full)."""

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def base_end(self) -> int:
        return self.base_offset + self.length


def plan_chunks(size: int, regions: Sequence[tuple[int, int, str | None]],
                chunk_size: int = DEFAULT_CHUNK) -> list[Chunk]:
    """Cut ``[0, size)`` into chunks: each region ``(offset, length, dtype)`` (a tensor) into
    pieces of at most ``chunk_size`` with its dtype's planes; gaps (headers, padding) plain."""
    if chunk_size < 8:
        raise ValueError(f"chunk_size must be >= 8, got {chunk_size}")
    chunk_size -= chunk_size % 8  # whole elements of every planed dtype
    chunks: list[Chunk] = []

    def cut(start: int, end: int, planes: int) -> None:
        for lo in range(start, end, chunk_size):
            hi = min(end, lo + chunk_size)
            chunks.append(Chunk(lo, hi - lo, planes if (hi - lo) % planes == 0 else 1))

    position = 0
    for offset, length, dtype in sorted(regions):
        if length <= 0:
            continue
        if offset < position or offset + length > size:
            raise ValueError(f"region {offset}+{length} overlaps another or passes the end ({size})")
        cut(position, offset, 1)
        cut(offset, offset + length, planes_for(dtype))
        position = offset + length
    cut(position, size, 1)
    return chunks


def _split(data: memoryview, planes: int) -> list[memoryview]:
    if planes == 1:
        return [data]
    grid = np.frombuffer(data, dtype=np.uint8).reshape(-1, planes)
    return [np.ascontiguousarray(grid[:, i]).data for i in range(planes)]


def _code_plane(plane: memoryview, level: int) -> tuple[int, bytes | memoryview]:
    if len(plane) == 0:
        return RAW, plane
    compressor = zstandard.ZstdCompressor(level=level)
    if len(plane) > 2 * _SAMPLE:  # near-random mantissa bytes: skip the coder after a sample
        sample = plane[len(plane) // 2: len(plane) // 2 + _SAMPLE]
        if len(compressor.compress(sample)) >= _MIN_GAIN * len(sample):
            return RAW, plane
    coded = compressor.compress(plane)
    return (ZSTD, coded) if len(coded) < len(plane) else (RAW, plane)


def encode_chunk(data: bytes | memoryview, planes: int = 1, level: int = DEFAULT_LEVEL,
                 base: bytes | memoryview | None = None) -> bytes:
    """One chunk's stored bytes: each plane with its mode and length, then the planes."""
    view = memoryview(data).cast("B")
    if planes < 1 or len(view) % planes:
        raise ValueError(f"{len(view)} bytes do not split into {planes} planes")
    if base is not None:
        view = memoryview(_xor(view, base))
    parts: list[bytes | memoryview] = []
    heads: list[bytes | memoryview] = []
    for plane in _split(view, planes):
        mode, stored = _code_plane(plane, level)
        heads.append(_PLANE.pack(mode, len(stored)))
        parts.append(stored)
    return b"".join(heads + parts)


def decode_chunk(entry: Entry, stored: bytes | memoryview,
                 base: bytes | memoryview | None = None) -> bytes | bytearray:
    """The decoded bytes of one chunk, checked against its crc32c (CodecError if not)."""
    view = memoryview(stored).cast("B")
    at = f"chunk at bytes {entry.offset}-{entry.end}"
    if len(view) != entry.stored_length or entry.planes < 1 or entry.length % entry.planes:
        raise CodecError(f"{at}: {len(view)} stored bytes for an entry of "
                         f"{entry.stored_length}, {entry.planes} planes")
    per_plane = entry.length // entry.planes
    position = _PLANE.size * entry.planes
    data: bytes | bytearray = b""
    if entry.planes > 1:  # planes are written straight into their columns: one copy, no stack
        data = bytearray(entry.length)
        grid = np.frombuffer(data, dtype=np.uint8).reshape(per_plane, entry.planes)
    try:
        for i in range(entry.planes):
            mode, length = _PLANE.unpack_from(view, i * _PLANE.size)
            body = view[position: position + length]
            position += length
            if mode == RAW:
                plane: bytes | memoryview = body
            elif mode == ZSTD:
                plane = zstandard.ZstdDecompressor().decompress(body, max_output_size=per_plane)
            else:
                raise CodecError(f"{at}: unknown plane mode {mode}")
            if len(plane) != per_plane:
                raise CodecError(f"{at}: plane {i} decodes to {len(plane)} bytes, "
                                 f"expected {per_plane}")
            if entry.planes == 1:
                data = bytes(plane)  # a no-op for zstd's output, one copy of a raw plane
            else:
                grid[:, i] = np.frombuffer(plane, dtype=np.uint8)
    except (struct.error, zstandard.ZstdError) as exc:
        raise CodecError(f"{at}: {exc}") from None
    if position != len(view):
        raise CodecError(f"{at}: {len(view) - position} stray stored bytes")
    if entry.flags & DELTA:
        if base is None:
            raise CodecError(f"{at} is a delta; its base bytes are needed")
        if len(base) != len(data):
            raise CodecError(f"{at} is a delta against base bytes {entry.base_offset}-{entry.base_end}, "
                             f"but the base has {len(base)} of them")
        data = _xor(memoryview(data), base)
    actual = crc32c.crc32c(data)
    if actual != entry.crc:
        raise CodecError(f"{at}: crc32c {actual:#010x} of the "
                         f"decoded bytes, expected {entry.crc:#010x}")
    return data


def _xor(data: memoryview, base: bytes | memoryview) -> bytes:
    if len(base) != len(data):
        raise ValueError(f"delta base has {len(base)} bytes, data {len(data)}")
    return np.bitwise_xor(np.frombuffer(data, np.uint8), np.frombuffer(base, np.uint8)).tobytes()


def encode_chunks(data: bytes | memoryview, chunks: Sequence[Chunk], *, level: int = DEFAULT_LEVEL,
                  threads: int = 2, origin: int = 0, base: bytes | memoryview | None = None,
                  pool: ThreadPoolExecutor | None = None) -> list[tuple[bytes, int]]:
    """(stored bytes, crc32c of decoded bytes) of each chunk, ``threads`` at a time.

    ``data`` holds the decoded bytes from ``origin`` on (a window of a larger file); ``base``,
    when given, the base checkpoint's bytes of the same window."""
    view = memoryview(data).cast("B")
    base_view = memoryview(base).cast("B") if base is not None else None

    def one(chunk: Chunk) -> tuple[bytes, int]:
        lo, hi = chunk.offset - origin, chunk.offset - origin + chunk.length
        if lo < 0 or hi > len(view):
            raise ValueError(f"chunk {chunk.offset}+{chunk.length} is outside the window at {origin}")
        piece = view[lo:hi]
        basis = base_view[lo:hi] if base_view is not None else None
        return encode_chunk(piece, chunk.planes, level, basis), crc32c.crc32c(piece)

    if pool is not None:
        return list(pool.map(one, chunks))
    if threads <= 1 or len(chunks) <= 1:
        return [one(c) for c in chunks]
    with ThreadPoolExecutor(min(threads, len(chunks)), thread_name_prefix="dcp-nvme-codec") as own:
        return list(own.map(one, chunks))


def table_entries(chunks: Sequence[Chunk], coded: Sequence[tuple[int, int]], *,
                  delta: bool = False, version: int = CODEC_VERSION) -> list[Entry]:
    """The chunk table for chunks stored back to back after the header and table (of
    ``version``); ``coded``: (stored length, crc32c of the decoded bytes) of each chunk. A chunk
    with a ``base`` offset is a delta against those base bytes; ``delta=True`` makes every chunk
    a delta against the base's bytes at its own offset (a whole base of the same layout)."""
    position = HEADER_SIZE + entry_size(version) * len(chunks)
    entries = []
    for chunk, (stored, crc) in zip(chunks, coded, strict=True):
        base = chunk.offset if delta and chunk.base is None else chunk.base
        entries.append(Entry(chunk.offset, chunk.length, position, stored, crc, chunk.planes,
                             DELTA if base is not None else 0, base or 0))
        position += stored
    return entries


def pack_header(entries: Sequence[Entry], decoded_size: int, flags: int = 0,
                version: int = CODEC_VERSION) -> bytes:
    """Header plus chunk table: the first bytes of a container (``version`` 1: old readers'
    table, which can only hold deltas at their own offsets)."""
    if version == 1:
        if any(e.flags & DELTA and e.base_offset != e.offset for e in entries):
            raise ValueError("a version 1 table cannot hold a delta at another base offset")
        rows = [_ENTRY_V1.pack(e.offset, e.length, e.stored_offset, e.stored_length, e.crc, e.planes, e.flags)
                for e in entries]
    else:
        rows = [_ENTRY.pack(e.offset, e.length, e.stored_offset, e.stored_length, e.crc, e.planes, e.flags,
                            e.base_offset) for e in entries]
    table = b"".join(rows)
    return _HEADER.pack(MAGIC, version, flags, len(entries), decoded_size, crc32c.crc32c(table)) + table


@dataclass(frozen=True)
class Header:
    """A container's header, checked."""

    version: int
    flags: int
    count: int
    size: int
    table_crc: int

    @property
    def table_size(self) -> int:
        return self.count * entry_size(self.version)


def read_header(data: bytes | memoryview, where: str = "container") -> Header:
    """A container's header from its first HEADER_SIZE bytes (CodecError when it is not one)."""
    if len(data) < HEADER_SIZE:
        raise CodecError(f"{where}: {len(data)} bytes, shorter than a compressed container header")
    magic, version, flags, count, size, table_crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CodecError(f"{where} is not a dcp_nvme compressed container (magic {magic!r})")
    if version not in READABLE_VERSIONS:
        raise CodecError(f"{where}: container version {version}, this dcp_nvme reads "
                         f"{', '.join(map(str, READABLE_VERSIONS))}; upgrade dcp_nvme")
    if count > size or (size and not count):  # every chunk holds at least one byte
        raise CodecError(f"{where}: {count} chunks for {size} decoded bytes")
    return Header(version, flags, count, size, table_crc)


def parse_header(data: bytes | memoryview, where: str = "container") -> tuple[int, int, int, int]:
    """(flags, chunk count, decoded size, table crc) from a container's first HEADER_SIZE bytes."""
    header = read_header(data, where)
    return header.flags, header.count, header.size, header.table_crc


def parse_table(data: bytes | memoryview, count: int, size: int, table_crc: int, stored_size: int,
                where: str = "container", version: int = CODEC_VERSION) -> list[Entry]:
    """The chunk table, checked: its crc, chunks covering ``[0, size)`` in order, stored
    ranges back to back inside a file of ``stored_size`` bytes; a version 1 table's deltas
    take their base bytes at their own offsets."""
    row = _ENTRY_V1 if version == 1 else _ENTRY
    if len(data) != count * row.size or crc32c.crc32c(data) != table_crc:
        raise CodecError(f"{where}: the chunk table is damaged (length or crc32c)")
    entries, position, stored = [], 0, HEADER_SIZE + count * row.size
    for i in range(count):
        fields = row.unpack_from(data, i * row.size)
        if version == 1:  # no base_offset column: a delta's base bytes are at its own offset
            fields += (fields[0] if fields[6] & DELTA else 0,)
        entry = Entry(*fields)
        if (entry.offset != position or not 0 < entry.length <= MAX_CHUNK or entry.planes not in (1, 2, 4)
                or entry.length % entry.planes or entry.stored_offset != stored
                or entry.flags & ~DELTA or (not entry.flags & DELTA and entry.base_offset)):
            raise CodecError(f"{where}: chunk {i} of the table is inconsistent ({entry})")
        position, stored = entry.end, stored + entry.stored_length
        entries.append(entry)
    if position != size or stored != stored_size:
        raise CodecError(f"{where}: chunks cover {position} of {size} decoded bytes and {stored} of "
                         f"{stored_size} stored bytes")
    return entries


def overlapping(entries: Sequence[Entry], start: int, end: int) -> list[Entry]:
    """The chunks a decoded range ``[start, end)`` needs, in order (binary search)."""
    if start >= end:
        return []
    lo, hi = 0, len(entries)
    while lo < hi:
        mid = (lo + hi) // 2
        if entries[mid].end <= start:
            lo = mid + 1
        else:
            hi = mid
    out = []
    for entry in entries[lo:]:
        if entry.offset >= end:
            break
        out.append(entry)
    return out


def encode(data: bytes | memoryview, regions: Sequence[tuple[int, int, str | None]] = (), *,
           level: int = DEFAULT_LEVEL, chunk_size: int = DEFAULT_CHUNK, threads: int = 2,
           base: bytes | memoryview | None = None) -> bytes:
    """A whole container in memory (tests, the bench, small files)."""
    view = memoryview(data).cast("B")
    chunks = plan_chunks(len(view), regions, chunk_size)
    coded = encode_chunks(view, chunks, level=level, threads=threads, base=base)
    entries = table_entries(chunks, [(len(s), c) for s, c in coded], delta=base is not None)
    return pack_header(entries, len(view)) + b"".join(stored for stored, _ in coded)


def decode(container: bytes | memoryview, start: int = 0, end: int | None = None, *,
           base: bytes | memoryview | None = None, where: str = "container") -> bytes:
    """Decoded bytes ``[start, end)`` of an in-memory container, decoding only the chunks needed.
    ``base``: the whole decoded base file, for delta chunks (each at its base offset)."""
    view = memoryview(container).cast("B")
    head = read_header(view, where)
    entries = parse_table(view[HEADER_SIZE: HEADER_SIZE + head.table_size], head.count, head.size,
                          head.table_crc, len(view), where, head.version)
    size = head.size
    end = size if end is None else end
    if not 0 <= start <= end <= size:
        raise ValueError(f"{where}: range {start}-{end} outside 0-{size}")
    out = bytearray()
    for entry in overlapping(entries, start, end):
        basis = memoryview(base)[entry.base_offset: entry.base_end] if base is not None else None
        data = decode_chunk(entry, view[entry.stored_offset: entry.stored_offset + entry.stored_length], basis)
        out += data[max(0, start - entry.offset): min(entry.length, end - entry.offset)]
    return bytes(out)
