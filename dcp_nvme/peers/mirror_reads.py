"""What no node of a restoring job holds, from the checkpoint's mirror (``NVMeReader(mirror=...)``):
ranged reads into a window that moves on as each piece is checked and kept.

The exchange (``peers/exchange.py``) calls ``from_mirror`` on every rank with the asks of that
rank no node can serve; what comes is kept through the exchange's ``Arrivals``, as what peers send.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from dcp_nvme.errors import CheckpointNotFoundError, DCPNVMeError
from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.pieces import Span, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.peers.fetching import MirrorSource

WAVE_BYTES = 256 << 20
"""What no node holds is read from the mirror at most this many bytes a rank ahead of what is kept."""
MIRROR_RANGE = 8 << 20
MIRROR_IN_FLIGHT = 8
"""What no node holds comes from the mirror in ranged reads of ``MIRROR_RANGE`` bytes, this
many at once (the reader's default ``block_size`` and ``queue_depth``)."""
KEEP_PIECE = 32 << 20
"""What comes from the mirror is checked and kept in pieces of about this many bytes."""


class Arrivals(Protocol):
    """Where what came is kept (``peers.exchange.Arrivals``)."""

    chosen: list[int]
    """Each ask's source; 0 once the mirror served it."""
    taken: dict[str, dict[str, float]]
    """Per kind of source: files, bytes, seconds."""

    def keep(self, record: FileRecord, start: int, data: memoryview, kind: str) -> None: ...


def from_mirror(manifest: Manifest, records: dict[str, FileRecord], mine: list[tuple[int, Span]],
                mirror: MirrorSource | None, optional: bool, out: Arrivals) -> tuple[str | None, list[Span]]:
    """This rank's asks that no node holds (``_spans``), the time counted as the mirror's in
    ``out.taken`` (last_stats)."""
    began = time.perf_counter()
    try:
        return _spans(manifest, records, mine, mirror, optional, out)
    finally:
        if "mirror" in out.taken:
            out.taken["mirror"]["seconds"] += time.perf_counter() - began


def _spans(manifest: Manifest, records: dict[str, FileRecord], mine: list[tuple[int, Span]],
           mirror: MirrorSource | None, optional: bool, out: Arrivals) -> tuple[str | None, list[Span]]:
    """This rank's asks that no node holds, from the mirror: ranged reads of ``MIRROR_RANGE``
    bytes, ``MIRROR_IN_FLIGHT`` at once (one span at a time, one read each, left the link
    mostly idle), each span checked and kept in pieces of about ``KEEP_PIECE`` bytes as soon as
    a piece came; at most ``WAVE_BYTES`` read ahead, however large a span (a span read whole
    held all of it in memory). Returns (why it stopped, the spans that came whole)."""
    got: list[Span] = []
    if mirror is None:  # the first ask names what is missing, unless the asks are optional
        if mine and not optional:
            _, span = mine[0]
            return f"{CheckpointNotFoundError.__name__}: {_no_mirror_message(manifest, records[span.file], span)}", got
        return None, got

    def part(piece: Span, offset: int, into: memoryview) -> None:
        mirror.read_into(piece.file, piece.start + offset, into)

    def post(piece: Span) -> tuple[memoryview, list[Future[None]]]:
        view = memoryview(bytearray(piece.length))
        return view, [pool.submit(part, piece, offset, view[offset:offset + MIRROR_RANGE])
                      for offset in range(0, piece.length, MIRROR_RANGE)]

    left: dict[int, int] = {}  # ask -> its pieces not kept yet
    failed: set[int] = set()  # optional asks a piece of which failed: left out whole

    def keep(index: int, span: Span, piece: Span, view: memoryview, parts: list[Future[None]]) -> str | None:
        if index in failed:
            return None
        try:
            for future in parts:
                future.result()
            record = records[piece.file]
            verify_piece(record, piece.start, view, mirror.describe(piece.file))
            out.keep(record, piece.start, view, "mirror")
        except (DCPNVMeError, OSError) as exc:
            if not optional:
                return f"{type(exc).__name__}: {exc}"
            failed.add(index)
            return None
        left[index] -= 1
        if not left[index]:
            out.chosen[index] = 0
            got.append(span)
        return None

    # a sliding window: the next piece's reads are queued as soon as one is kept (groups that
    # each waited for their last read left the link idle between them)
    with ThreadPoolExecutor(MIRROR_IN_FLIGHT, thread_name_prefix="dcp-nvme-mirror") as pool:
        posted: deque[tuple[int, Span, Span, memoryview, list[Future[None]]]] = deque()
        held = 0
        why = None
        for index, span in mine:
            pieces = keep_pieces(records[span.file], span)
            left[index] = len(pieces)
            for piece in pieces:
                while posted and held + piece.length > WAVE_BYTES and why is None:
                    oldest = posted.popleft()
                    held -= oldest[2].length
                    why = keep(*oldest)
                if why is not None or index in failed:  # an optional ask left out: no more of it read
                    break
                posted.append((index, span, piece, *post(piece)))
                held += piece.length
            if why is not None:
                break
        while posted and why is None:
            why = keep(*posted.popleft())
        for *_, parts in posted:
            for future in parts:
                future.cancel()
        if why is not None:
            return why, got
    return None, got


def keep_pieces(record: FileRecord, span: Span) -> list[Span]:
    """``span`` cut at the file's ``KEEP_PIECE`` boundaries (whole checksum blocks from the data's
    start), so that each piece is checked on its own."""
    step = max(record.checksum_block, KEEP_PIECE - KEEP_PIECE % record.checksum_block)
    pieces, at = [], span.start
    cut = record.data_start + ((max(at, record.data_start) - record.data_start) // step + 1) * step
    while cut < span.end:
        pieces.append(Span(span.file, at, cut))
        at, cut = cut, cut + step
    pieces.append(Span(span.file, at, span.end))
    return pieces


def _no_mirror_message(manifest: Manifest, record: FileRecord, span: Span) -> str:
    """Why a range no node holds cannot be loaded when the load has no mirror."""
    writer = manifest.node_of(record.rank)
    return (f"{span.file} bytes [{span.start}, {span.end}) (rank {record.rank}'s data, written on node "
            f"{writer}) are on no node of this job and the load has no mirror that holds them: restart "
            f"with node {writer} in the job, or give NVMeReader(mirror=...) where the checkpoint drained")
