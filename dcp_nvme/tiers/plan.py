"""Pure parts of the drain: how a file is cut into pieces, how a piece is verified, how an
error is named, and the token bucket that caps bandwidth. No I/O here except sleeping."""

from __future__ import annotations

import errno
import threading
import time
from dataclasses import dataclass

from ..checksums import check_host, checks_within
from ..errors import BucketMissingError, ChecksumMismatchError
from ..manifest import FileRecord

MiB = 1 << 20
S3_MIN_PART = 5 * MiB
"""S3 refuses multipart parts below 5 MiB (except the last)."""


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
    pieces, offset = [], 0
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


def classify(exc: BaseException) -> str:
    """A one-line cause for the drain state: what went wrong, in words a user can act on."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = type(exc).__name__
    if isinstance(exc, ChecksumMismatchError):
        return f"checksum mismatch: {text}"
    if isinstance(exc, PermissionError):
        return f"access denied (credentials refused?): {text}"
    if isinstance(exc, BucketMissingError):
        return f"bucket missing: {text}"
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return f"server busy (503 SlowDown): {text}"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"quota exceeded / no space: {text}"
    if "Connect" in name or "Endpoint" in name or isinstance(exc, (ConnectionError, TimeoutError)):
        return f"remote unreachable: {name}: {text}"
    return f"{name}: {text}"


def is_permanent(exc: BaseException) -> bool:
    """Errors a retry cannot fix: bad local data, a corrupt mirror, a local checkpoint gone."""
    from ..errors import CheckpointNotFoundError, ManifestError

    return isinstance(exc, (ChecksumMismatchError, CheckpointNotFoundError, ManifestError))


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff: base, 2*base, 4*base... capped at ``cap`` seconds."""
    return min(cap, base * (2 ** max(0, attempt - 1)))


class TokenBucket:
    """A bandwidth cap shared by the transfer threads: ``take(n)`` sleeps until n bytes may go.

    ``rate`` bytes/s with a burst of one second's worth (at least one piece), so a cap well
    below the link speed keeps the training job's network traffic flowing.
    """

    def __init__(self, rate: float | None, burst: float | None = None) -> None:
        self.rate = rate
        self.capacity = burst if burst is not None else (rate or 0)
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self.lock:  # one waiter at a time keeps the order fair and the math simple
            now = time.monotonic()
            self.tokens = min(max(self.capacity, nbytes), self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= nbytes
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
            if wait:
                time.sleep(wait)
                self.stamp = time.monotonic()
                self.tokens = 0.0
