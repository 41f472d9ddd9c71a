"""How a container is cut into pieces for transfer (whole checksum blocks), and how a
piece is checked against the blocks table (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_nvme.format.checksums import check_host, checks_within
from dcp_nvme.format.tables import FileRecord


@dataclass(frozen=True, order=True)
class Span:
    """Bytes ``[start, end)`` of one container file: what a load asks of another node."""

    file: str
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def span_of(record: FileRecord, start: int, end: int) -> Span:
    """``[start, end)`` of a container widened to whole checksum blocks of its data region."""
    block, base = record.checksum_block, record.data_start
    lo = base + (start - base) // block * block if start >= base else 0
    hi = min(record.size, base + -(-(end - base) // block) * block) if end > base else base
    return Span(record.name, lo, hi)


@dataclass(frozen=True)
class Piece:
    """One transfer unit of a file: ``[offset, offset + length)``."""

    index: int
    offset: int
    length: int


def plan_pieces(size: int, data_start: int, checksum_block: int, part_size: int) -> list[Piece]:
    """Cut a container into pieces whose boundaries fall on checksum blocks of its data region.

    The first piece carries the header plus ``part_size`` bytes of data, so every piece covers
    whole blocks and can be verified on its own.
    """
    if part_size < checksum_block:
        part_size = checksum_block
    part_size -= part_size % checksum_block
    pieces: list[Piece] = []
    offset = 0
    end = min(size, data_start + part_size)
    while True:
        pieces.append(Piece(len(pieces), offset, end - offset))
        if end >= size:
            return pieces
        offset, end = end, min(size, end + part_size)


def verify_piece(record: FileRecord, offset: int, data: bytes | memoryview, where: str) -> None:
    """Check the header and every checksum block inside ``data`` (the file's bytes at ``offset``).

    Raises ChecksumMismatchError naming ``where`` (the file, local or remote) and the range.
    """
    view = memoryview(data)
    check_host(where, offset, checks_within(record, offset, offset + len(view)), [view])
