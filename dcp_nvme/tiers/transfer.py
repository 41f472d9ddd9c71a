"""The rules of a transfer, without its I/O: which journaled pieces still
match the pieces a file is cut into (``format.pieces``), whether a target overlaps its source, how a
failure is named and whether a retry can fix it, and the token bucket that caps bandwidth. No
I/O here except sleeping."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dcp_nvme.errors import BucketMissingError, ChecksumMismatchError
from dcp_nvme.format.pieces import Piece

MiB = 1 << 20


S3_MIN_PART = 5 * MiB
"""S3 refuses multipart parts below 5 MiB (except the last)."""
S3_MAX_PARTS = 10_000
"""S3 numbers a multipart upload's parts 1 to 10,000."""


class DrainFault(Exception):
    """A problem the drain found itself (not raised by a library); the message is the cause.
    ``permanent`` faults are not retried: a retry cannot fix them."""

    permanent = False


class TargetTaken(DrainFault):
    """The target holds the mirror of another checkpoint: one URL holds one checkpoint."""

    permanent = True


class IncompleteOnTarget(DrainFault):
    """A file on the target does not match the manifest after it was sent (size, coverage)."""


class NodeSilent(DrainFault):
    """A node-local checkpoint's drain: another node, whose files the mirror still lacks, wrote
    no heartbeat on the target for the silence limit (it died, or its drain ended without them).
    Not retried; what this node sent stays on the target for the resume."""

    permanent = True


class LocalDamage(DrainFault):
    """A file of the local checkpoint is missing or is not the size its manifest records: the
    save being drained is damaged here, and no retry brings the bytes back."""

    permanent = True


class SourceChanged(DrainFault):
    """The local checkpoint was overwritten (a new save committed) while it was draining."""

    permanent = True


class ProcessExiting(DrainFault):
    """Python is shutting down and its thread pools refuse new work, so the drain cannot go on
    in this process. Never retried (a retry meets the same refusal); what reached the target is
    kept for the resume."""

    permanent = True


_REFUSED_AT_EXIT = "cannot schedule new futures after interpreter shutdown"
"""concurrent.futures' refusal once the interpreter's exit has stopped its pools."""


def exiting(exc: BaseException) -> ProcessExiting | None:
    """The ProcessExiting that ``exc`` (or an exception it was raised from) stands for, or None."""
    seen: BaseException | None = exc
    for _ in range(8):  # the refusal can arrive wrapped (a coder's failure handed to the senders)
        if seen is None:
            return None
        if isinstance(seen, ProcessExiting):
            return seen
        if isinstance(seen, RuntimeError) and _REFUSED_AT_EXIT in str(seen):
            return ProcessExiting(
                "the process exited before the drain finished: Python's thread pools refuse new work "
                f"during interpreter exit ({_REFUSED_AT_EXIT}). Resume it with `dcp-nvme drain PATH`; "
                "a script can wait for its drains with dcp_nvme.tiers.wait_for_drains()")
        seen = seen.__cause__ or seen.__context__
    return None


def piece_entry(piece: Piece, tag: str) -> dict[str, int | str]:
    """What the journal keeps of a piece that reached the target: its byte range and tag."""
    return {"offset": piece.offset, "length": piece.length, "tag": tag}


def matching_pieces(journaled: dict[str, object], pieces: list[Piece]) -> dict[int, str]:
    """Pieces of ``pieces`` the journal claims are on the target, with their tags.

    A claim counts only when its recorded byte range is exactly the planned piece's: an entry
    from another plan (another part size) or an older journal without ranges claims nothing.
    """
    claimed = {}
    for piece in pieces:
        entry = journaled.get(str(piece.index))
        if (isinstance(entry, dict) and entry.get("offset") == piece.offset
                and entry.get("length") == piece.length and isinstance(entry.get("tag"), str)):
            claimed[piece.index] = entry["tag"]
    return claimed


def check_coverage(pieces: list[Piece], size: int, name: str) -> None:
    """The pieces a file is assembled from cover ``[0, size)`` exactly, in order, once."""
    offset = 0
    for piece in sorted(pieces, key=lambda p: p.offset):
        if piece.offset != offset or piece.length <= 0:
            raise IncompleteOnTarget(f"{name}: the pieces sent leave bytes {offset}-{piece.offset} "
                                     "uncovered or overlap; not committing")
        offset += piece.length
    if offset != size:
        raise IncompleteOnTarget(f"{name}: the pieces sent cover {offset} of {size} bytes; not committing")


def overlap(source: str, target: str) -> str | None:
    """Why draining ``source`` into local directory ``target`` would destroy it, or None.

    Both are resolved paths (symlinks followed). Refused: the same directory, a target inside
    the checkpoint, or the checkpoint inside the target.
    """
    source, target = os.path.normpath(source), os.path.normpath(target)
    if source == target:
        return f"the target {target} is the checkpoint itself"
    if target.startswith(source.rstrip(os.sep) + os.sep):
        return f"the target {target} is inside the checkpoint {source}"
    if source.startswith(target.rstrip(os.sep) + os.sep):
        return f"the checkpoint {source} is inside the target {target}"
    return None


STEP = "dcp_nvme_drain_step"
"""Attribute the drain sets on an exception: the operation and file it happened in."""


@contextmanager
def step(what: str) -> Iterator[None]:
    """Name the operation and file on any exception raised inside (the innermost name wins)."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, STEP, None) is None:
            try:
                setattr(exc, STEP, what)
            except (AttributeError, TypeError):
                pass
        raise


_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError")
"""botocore's (not imported here): no key and secret found in the options, the environment or a
profile. A retry finds none either."""
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError")
"""botocore's: the endpoint did not answer a connection, after botocore's and s3fs's own retries."""


def _named(exc: BaseException, names: tuple[str, ...]) -> bool:
    return any(kind.__name__ in names for kind in type(exc).__mro__)


def no_credentials(exc: BaseException) -> bool:
    """botocore found no credentials to sign with."""
    return _named(exc, _NO_CREDENTIALS)


def unreachable(exc: BaseException) -> bool:
    """The target's endpoint did not take a connection (refused, or no answer in time)."""
    return _named(exc, _UNREACHABLE) or isinstance(exc, (ConnectionRefusedError, socket.gaierror))


def classify(exc: BaseException) -> str:
    """A one-line cause for the drain state: what went wrong, during which operation on which
    file (when known), in words a user can act on."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = type(exc).__name__
    step = getattr(exc, STEP, None)
    where = f"{step}: " if step else ""
    if isinstance(exc, ChecksumMismatchError):
        return f"checksum mismatch: {where}{text}"
    if isinstance(exc, SourceChanged):
        return f"source changed: {text}"
    if isinstance(exc, DrainFault):
        return f"{where}{text}"
    if no_credentials(exc):
        return (f"no credentials: {where}{text} (give key and secret in storage_options, or set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")
    if isinstance(exc, PermissionError):
        return f"access denied (credentials refused?): {where}{text}"
    if isinstance(exc, BucketMissingError):
        return f"bucket missing: {where}{text}"
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return f"server busy (503 SlowDown): {where}{text}"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"quota exceeded / no space: {where}{text}"
    if "Connect" in name or "Endpoint" in name or isinstance(exc, (ConnectionError, TimeoutError)):
        return f"remote unreachable: {where}{name}: {text}"
    return f"{where}{name}: {text}"


def is_permanent(exc: BaseException) -> bool:
    """Errors a retry cannot fix: bad or missing local data, a corrupt mirror, a local checkpoint
    gone or overwritten under the drain, a backend package that is not installed, no
    credentials, credentials refused (access denied), a bucket that does not exist. (An endpoint
    that never answered is decided by the drain: see ``_DrainRun._failed``.)"""
    from dcp_nvme.errors import CheckpointNotFoundError, ManifestError, MissingDependencyError

    if isinstance(exc, DrainFault):
        return exc.permanent
    return no_credentials(exc) or isinstance(exc, (
        ChecksumMismatchError, CheckpointNotFoundError, ManifestError, MissingDependencyError, PermissionError,
        BucketMissingError))


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff: base, 2*base, 4*base... capped at ``cap`` seconds."""
    return min(cap, base * (2 ** max(0, attempt - 1)))


class TokenBucket:
    """A bandwidth cap shared by the transfer threads: ``take(n)`` sleeps until n bytes may go.

    ``rate`` bytes/s with a burst of ``burst`` bytes (one second's worth when not given); a
    piece larger than the burst goes once the bucket is full.
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
