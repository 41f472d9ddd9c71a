"""Pure placement logic: items to byte ranges, byte ranges to I/O requests. No I/O here.

A container is one safetensors file per rank: an 8-byte little-endian header length, a JSON
header padded with spaces so the data region starts on an ``ALIGN`` boundary, then every
item's bytes back to back. Requests are planned over the data region so that, when the data
comes from a staging arena laid out in the same order, memory and file offsets stay aligned.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .config import ALIGN


def align_up(value: int, alignment: int = ALIGN) -> int:
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int = ALIGN) -> int:
    return value // alignment * alignment


# --------------------------------------------------------------------------- container


def place_back_to_back(sizes: Sequence[int], alignments: Sequence[int] | None = None) -> tuple[list[int], int]:
    """Offsets of items laid one after the other, each rounded up to its alignment, and the end.

    The one layout of both a container's data region and a staging arena, so that zero-copy
    writes cannot silently drift: the container passes no alignments (safetensors has no gaps
    between items), the arena each dtype's itemsize (a typed view cannot start mid-element).
    While no padding is needed the two agree byte for byte, and every write window is one span
    of the arena (``contiguous_span``); after a padding, windows fall back to a bounce copy.
    """
    offsets, cursor = [], 0
    for index, size in enumerate(sizes):
        if alignments is not None:
            cursor = align_up(cursor, alignments[index])
        offsets.append(cursor)
        cursor += size
    return offsets, cursor



@dataclass(frozen=True)
class ItemSpec:
    """One item as the safetensors header describes it."""

    key: str
    nbytes: int
    st_dtype: str
    st_shape: tuple[int, ...]


@dataclass(frozen=True)
class ContainerLayout:
    header: bytes
    """The 8-byte length plus the padded JSON: exactly ``data_start`` bytes."""
    offsets: tuple[int, ...]
    """Each item's offset inside the data region."""
    data_size: int

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def plan_container(
    items: Sequence[ItemSpec], metadata: dict[str, str], alignment: int = ALIGN
) -> ContainerLayout:
    """Place items back to back and build the safetensors header that describes them."""
    offsets, cursor = place_back_to_back([item.nbytes for item in items])
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    for item, offset in zip(items, offsets):
        if item.key in header:
            raise ValueError(f"duplicate item key {item.key!r} in one container")
        header[item.key] = {
            "dtype": item.st_dtype,
            "shape": list(item.st_shape),
            "data_offsets": [offset, offset + item.nbytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    data_start = align_up(8 + len(text), alignment)
    padded = text + b" " * (data_start - 8 - len(text))
    return ContainerLayout(struct.pack("<Q", len(padded)) + padded, tuple(offsets), cursor)


# --------------------------------------------------------------------------- write windows


@dataclass(frozen=True)
class SourceSpan:
    """``length`` bytes of source ``source`` from ``src_offset`` land at ``dst_offset``."""

    source: int
    src_offset: int
    length: int
    dst_offset: int


@dataclass(frozen=True)
class Window:
    """One write request: ``length`` bytes at data-region offset ``offset``."""

    offset: int
    length: int
    pieces: tuple[SourceSpan, ...]


def plan_windows(sizes: Sequence[int], block_size: int) -> Iterator[Window]:
    """Cut the concatenation of ``sizes`` into requests of ``block_size`` bytes (the last shorter)."""
    total = sum(sizes)
    source, consumed = 0, 0  # current source and bytes of it already placed
    for start in range(0, total, block_size):
        length = min(block_size, total - start)
        pieces: list[SourceSpan] = []
        filled = 0
        while filled < length:
            while sizes[source] - consumed == 0:
                source, consumed = source + 1, 0
            take = min(sizes[source] - consumed, length - filled)
            pieces.append(SourceSpan(source, consumed, take, filled))
            consumed += take
            filled += take
        yield Window(start, length, tuple(pieces))


def contiguous_span(window: Window, addresses: Sequence[int | None]) -> int | None:
    """The address of the window's bytes when they are one span of host memory (sources laid
    out as ``place_back_to_back`` lays the container), else None; ``addresses`` are the
    sources' host addresses (None: not in host memory)."""
    first = window.pieces[0]
    start = addresses[first.source]
    if start is None:
        return None
    start += first.src_offset
    expected = start
    for piece in window.pieces:
        base = addresses[piece.source]
        if base is None or base + piece.src_offset != expected:
            return None
        expected += piece.length
    return start


# --------------------------------------------------------------------------- tensor slices


def _run_split(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """Index of the outermost dimension from which the slice is one contiguous run."""
    split = len(shape)
    while split > 0 and offsets[split - 1] == 0 and lengths[split - 1] == shape[split - 1]:
        split -= 1
    return max(split - 1, 0)


def count_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """How many contiguous byte runs a row-major slice touches (0 for an empty slice)."""
    if any(n == 0 for n in lengths):
        return 0
    return math.prod(lengths[: _run_split(shape, offsets, lengths)])


def slice_runs(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> list[tuple[int, int, int]]:
    """The runs of a slice of a row-major array: ``(src_byte, nbytes, packed_dst_byte)``.

    ``packed_dst_byte`` is the run's place in the slice stored contiguously in row-major order.
    """
    if len(shape) != len(offsets) or len(shape) != len(lengths):
        raise ValueError(f"rank mismatch: shape {shape}, offsets {offsets}, lengths {lengths}")
    for dim, (size, off, n) in enumerate(zip(shape, offsets, lengths)):
        if off < 0 or n < 0 or off + n > size:
            raise ValueError(f"slice [{off}, {off + n}) out of bounds for dim {dim} of {shape}")
    if count_runs(shape, offsets, lengths) == 0:
        return []
    if not shape:
        return [(0, itemsize, 0)]
    split = _run_split(shape, offsets, lengths)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    run_bytes = lengths[split] * strides[split] * itemsize
    runs: list[tuple[int, int, int]] = []
    index = [0] * split
    packed = 0
    while True:
        element = sum((offsets[d] + index[d]) * strides[d] for d in range(split))
        element += offsets[split] * strides[split]
        if runs and runs[-1][0] + runs[-1][1] == element * itemsize:
            src, n, dst = runs[-1]
            runs[-1] = (src, n + run_bytes, dst)
        else:
            runs.append((element * itemsize, run_bytes, packed))
        packed += run_bytes
        for d in reversed(range(split)):  # odometer over the outer dimensions
            index[d] += 1
            if index[d] < lengths[d]:
                break
            index[d] = 0
        else:
            return runs


def covering_rows(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """The contiguous byte range of whole dim-0 rows that holds a slice: ``(src_byte, nbytes)``."""
    if not shape:
        return 0, itemsize
    row = math.prod(shape[1:]) * itemsize
    return offsets[0] * row, lengths[0] * row


# --------------------------------------------------------------------------- read planning

SCRATCH = -1
"""Destination id of bytes that are read (to be verified) but wanted by nobody."""

@dataclass(frozen=True)
class Need:
    """Bytes ``[file_offset, file_offset + length)`` go to ``dest`` at ``dest_offset``."""

    file_offset: int
    length: int
    dest: int
    dest_offset: int


@dataclass
class ReadRequest:
    """One positional read of a contiguous file range, scattered into destination pieces.

    ``pieces`` are ``(dest, dest_offset, length)`` in file order and sum to ``length``;
    ``checks`` are ``(offset_in_request, length, expected_crc32c)`` for whole checksum blocks.
    """

    file: str
    file_offset: int
    length: int
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    checks: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class FileBlocks:
    """What a reader knows about one container to plan verified reads."""

    data_start: int
    data_size: int
    block_size: int
    crcs: Sequence[int]


def _split_overlaps(needs: Sequence[Need]) -> tuple[list[Need], list[Need]]:
    """Needs that do not overlap each other, and the rest (planned in another pass)."""
    kept, deferred = [], []
    end = -1
    for need in sorted(needs, key=lambda n: (n.file_offset, n.length)):
        if need.length == 0:
            continue
        if need.file_offset < end:
            deferred.append(need)
        else:
            kept.append(need)
            end = need.file_offset + need.length
    return kept, deferred


def plan_reads(
    file: str,
    needs: Sequence[Need],
    *,
    max_request: int,
    blocks: FileBlocks | None = None,
    max_gap: int = 0,
) -> list[ReadRequest]:
    """Sort, merge and cut the needs of one file into requests of at most ``max_request`` bytes.

    With ``blocks`` every request covers whole checksum blocks (the unwanted bytes go to
    SCRATCH) and carries the checks for them. Needs closer than ``max_gap`` share a request.
    """
    kept, deferred = _split_overlaps(needs)
    if not kept:
        return []
    granule = blocks.block_size if blocks else 1
    if blocks and max_request % granule:
        raise ValueError(f"max_request {max_request} is not a multiple of {granule}")
    base = blocks.data_start if blocks else 0

    def expand(start: int, end: int) -> tuple[int, int]:
        if not blocks:
            return start, end
        if start < blocks.data_start or end > blocks.data_start + blocks.data_size:
            raise ValueError(f"range [{start}, {end}) is outside the data region of {file}")
        lo = base + align_down(start - base, granule)
        hi = min(base + align_up(end - base, granule), base + blocks.data_size)
        return lo, hi

    spans: list[list[int]] = []  # merged [start, end) ranges to read
    for need in kept:
        lo, hi = expand(need.file_offset, need.file_offset + need.length)
        if spans and lo <= spans[-1][1] + max_gap:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])

    requests: list[ReadRequest] = []
    cursor = 0  # index into kept
    for lo, hi in spans:
        start = lo
        while start < hi:
            # cut at a multiple of max_request from the block base keeps requests block-aligned
            end = min(hi, start + max_request)
            request = ReadRequest(file, start, end - start)
            position = start
            while cursor < len(kept) and kept[cursor].file_offset < end:
                need = kept[cursor]
                need_end = need.file_offset + need.length
                piece_start = max(need.file_offset, position)
                if piece_start > position:
                    request.pieces.append((SCRATCH, 0, piece_start - position))
                piece_end = min(need_end, end)
                request.pieces.append(
                    (need.dest, need.dest_offset + piece_start - need.file_offset, piece_end - piece_start)
                )
                position = piece_end
                if need_end <= end:
                    cursor += 1
                else:
                    break
            if position < end:
                request.pieces.append((SCRATCH, 0, end - position))
            if blocks:
                first = (start - base) // granule
                for index in range(first, -(-(end - base) // granule)):
                    block_lo = base + index * granule
                    block_hi = min(block_lo + granule, base + blocks.data_size)
                    request.checks.append((block_lo - start, block_hi - block_lo, blocks.crcs[index]))
            requests.append(request)
            start = end
    return requests + plan_reads(
        file, deferred, max_request=max_request, blocks=blocks, max_gap=max_gap
    )
