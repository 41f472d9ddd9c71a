"""Pure placement logic: items to byte ranges, byte ranges to I/O requests. No I/O here.

A container is one safetensors file per rank: an 8-byte little-endian header length, a JSON
header padded with spaces so the data region starts on an ``ALIGN`` boundary, then the items
in order. A host tensor large enough to matter starts at a data offset congruent to its memory
address (``place_congruent``), the gap before it a padding entry, so the aligned bulk of its
bytes can be written straight from its memory with O_DIRECT (``plan_segments``); only its
unaligned head and tail go through a bounce buffer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .config import ALIGN
from .format import build_header, is_pad_key, pad_key


def align_up(value: int, alignment: int = ALIGN) -> int:
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int = ALIGN) -> int:
    return value // alignment * alignment


# --------------------------------------------------------------------------- container


def place_back_to_back(sizes: Sequence[int], alignments: Sequence[int] | None = None) -> tuple[list[int], int]:
    """Offsets of items laid one after the other, each rounded up to its alignment, and the end.

    A staging arena's layout, each dtype's itemsize the alignment (a typed view cannot start
    mid-element); a container without host addresses, no alignments. ``place_congruent`` puts
    an arena's items at their arena offsets in the container (its gaps become pad entries), so
    every write window is one span of the arena, written without a copy.
    """
    offsets, cursor = [], 0
    for index, size in enumerate(sizes):
        if alignments is not None:
            cursor = align_up(cursor, alignments[index])
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


DIRECT_MIN = 64 << 10
"""Host items at least this large get a gap (< the congruence) to be written from their memory."""
ITEMSIZE_GAP = 16
"""Smaller items take a gap only below this (the largest itemsize): a staging arena's dtype
padding, so an arena's items keep their arena offsets and its windows stay one span."""


def place_congruent(
    sizes: Sequence[int], addresses: Sequence[int | None], congruence: int = ALIGN,
    threshold: int = DIRECT_MIN,
) -> tuple[list[int], int]:
    """Offsets of items in order, each at ``offset = address (mod congruence)`` when the gap that
    takes is worth it, else right after the item before; and the end.

    A gap is taken for an item with an address (host memory) and bytes: any gap below
    ``congruence`` when it holds ``threshold`` bytes or more, else only one below
    ``ITEMSIZE_GAP``. Sources laid out by ``place_back_to_back`` with itemsize alignments in one
    ``congruence``-aligned arena get exactly their arena offsets (relative to the first).
    """
    offsets, cursor = [], 0
    for size, address in zip(sizes, addresses, strict=True):
        if address is not None and size > 0:
            gap = (address - cursor) % congruence
            if gap < (congruence if size >= threshold else ITEMSIZE_GAP):
                cursor += gap
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
    pads: tuple[tuple[int, int], ...] = ()
    """``(offset, size)`` of each padding entry (a gap before an item) in the data region."""

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def plan_container(
    items: Sequence[ItemSpec], metadata: dict[str, str], alignment: int = ALIGN,
    addresses: Sequence[int | None] | None = None, congruence: int = ALIGN,
) -> ContainerLayout:
    """Place items and build the safetensors header that describes them: back to back, or with
    ``addresses`` (each item's host address, None when not in host memory) by
    ``place_congruent``, every gap a padding entry (``format.pad_key``)."""
    sizes = [item.nbytes for item in items]
    if addresses is None:
        offsets, cursor = place_back_to_back(sizes)
    else:
        offsets, cursor = place_congruent(sizes, addresses, congruence)
    entries: list[tuple[str, str, Sequence[int], int]] = []
    pads: list[tuple[int, int]] = []
    end = 0
    for item, offset in zip(items, offsets):
        if is_pad_key(item.key):
            raise ValueError(f"item key {item.key!r} is reserved for padding entries")
        if offset > end:
            pads.append((end, offset - end))
            entries.append((pad_key(len(pads) - 1), "U8", (offset - end,), offset - end))
        entries.append((item.key, item.st_dtype, item.st_shape, item.nbytes))
        end = offset + item.nbytes
    header, _ = build_header(entries, metadata, alignment)  # back to back: the same offsets
    return ContainerLayout(header, tuple(offsets), cursor, tuple(pads))


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


@dataclass(frozen=True)
class Segment:
    """One iovec of a window's write: ``length`` bytes at window offset ``offset``, straight from
    host memory at ``address``, or (``address`` None) from the window's bounce buffer at the same
    offset, filled from ``pieces`` (``dst_offset`` relative to the window) then ``fill`` zero
    bytes (the O_DIRECT round-up of the file's last window)."""

    offset: int
    length: int
    address: int | None
    pieces: tuple[SourceSpan, ...] = ()
    fill: int = 0


def _host_runs(window: Window, addresses: Sequence[int | None]) -> list[tuple[int, int, int | None]]:
    """``(window offset, length, address)`` of the window's pieces, merged where they are one
    span of host memory (address None: not in host memory)."""
    runs: list[tuple[int, int, int | None]] = []
    for piece in window.pieces:
        base = addresses[piece.source]
        address = None if base is None else base + piece.src_offset
        if runs and address is not None:
            position, length, start = runs[-1]
            if start is not None and start + length == address:
                runs[-1] = (position, length + piece.length, start)
                continue
        runs.append((piece.dst_offset, piece.length, address))
    return runs


def _direct_spans(window: Window, addresses: Sequence[int | None], align: int,
                  min_direct: int) -> list[tuple[int, int, int]]:
    """The aligned bulk of every host run whose memory is congruent to its file offset."""
    spans = []
    for position, length, address in _host_runs(window, addresses):
        if address is None or (address - window.offset - position) % align:
            continue
        lo, hi = align_up(position, align), align_down(position + length, align)
        if hi - lo >= max(min_direct, 1):
            spans.append((lo, hi - lo, address + lo - position))
    return spans


def _clip(window: Window, starts: Sequence[int], lo: int, hi: int) -> tuple[SourceSpan, ...]:
    """The window's pieces cut to window offsets ``[lo, hi)`` (``starts``: their dst offsets)."""
    out = []
    index = max(bisect.bisect_right(starts, lo) - 1, 0)
    for piece in window.pieces[index:]:
        if piece.dst_offset >= hi:
            break
        start, end = max(lo, piece.dst_offset), min(hi, piece.dst_offset + piece.length)
        if start < end:
            out.append(SourceSpan(piece.source, piece.src_offset + start - piece.dst_offset, end - start, start))
    return tuple(out)


def plan_segments(
    window: Window, addresses: Sequence[int | None], align: int = 1, *, min_direct: int = ALIGN,
    max_segments: int = 1024,
) -> list[Segment]:
    """Cut one write window into segments: the ``align``-aligned bulk of each host run (a tensor,
    or tensors one after the other in memory) whose address is congruent to its file offset
    modulo ``align`` is written from its own memory; the rest (edges, pads, small items, device
    memory) through a bounce buffer. Every segment but the last starts and ends on an ``align``
    boundary, the last is rounded up with ``fill``, so O_DIRECT takes the whole list as one
    vectored write (``align``: the larger of its memory and offset alignments; 1 when buffered).

    ``addresses``: each source's host address (None: not in host memory). The window's file
    offset must be a multiple of ``align``: the data region starts on a page. Direct spans
    shorter than ``min_direct`` bounce (a memcpy beats an iovec); at most ``max_segments``
    (IOV_MAX) come out, the shortest direct spans bouncing first.
    """
    if window.offset % align:
        raise ValueError(f"window at {window.offset} is not aligned to {align}")
    spans = _direct_spans(window, addresses, align, min_direct)
    keep = max((max_segments - 1) // 2, 0)  # each direct span may bring a bounce segment
    if len(spans) > keep:
        spans = sorted(sorted(spans, key=lambda span: -span[1])[:keep])
    starts = [piece.dst_offset for piece in window.pieces]
    segments: list[Segment] = []
    position = 0
    for lo, length, address in spans:
        if lo > position:
            segments.append(Segment(position, lo - position, None, _clip(window, starts, position, lo)))
        segments.append(Segment(lo, length, address))
        position = lo + length
    if position < window.length:
        fill = align_up(window.length, align) - window.length
        segments.append(Segment(position, window.length - position, None,
                                _clip(window, starts, position, window.length), fill))
    return segments


def plan_read_segments(
    offset: int, pieces: Sequence[tuple[int, int | None]], lo: int, hi: int, align: int = 1, *,
    min_direct: int = ALIGN, max_segments: int = 1024,
) -> list[Segment]:
    """Cut one read of file bytes ``[lo, hi)`` into segments, the mirror of ``plan_segments``:
    the ``align``-aligned bulk of each piece whose destination address is congruent to its file
    offset is read straight into that memory, the rest (edges, bytes nobody wants, pieces with
    no host address, the rounding out to ``[lo, hi)``) into the bounce buffer at the same offset
    from ``lo``, so the whole list is one vectored O_DIRECT read.

    ``pieces``: ``(length, address)`` of the request's bytes from file offset ``offset`` on, in
    order (address None: not host memory, or scratch). Each segment's ``pieces`` name them by
    index as ``source`` (``src_offset`` within the piece, ``dst_offset`` from ``lo``); source
    ``len(pieces)`` is the rounding, which goes nowhere.
    """
    end = offset + sum(length for length, _ in pieces)
    if not lo <= offset <= end <= hi:
        raise ValueError(f"read range [{lo}, {hi}) does not hold the request [{offset}, {end})")
    rounding = len(pieces)
    spans, position = [], offset - lo
    if position:
        spans.append(SourceSpan(rounding, 0, position, 0))
    for source, (length, _) in enumerate(pieces):
        if length:
            spans.append(SourceSpan(source, 0, length, position))
            position += length
    if position < hi - lo:
        spans.append(SourceSpan(rounding, 0, hi - lo - position, position))
    addresses = [address for _, address in pieces] + [None]
    return plan_segments(Window(lo, hi - lo, tuple(spans)), addresses, align, min_direct=min_direct,
                         max_segments=max_segments)


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
