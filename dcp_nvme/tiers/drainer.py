"""The drain: copy one committed local checkpoint to its mirror, verified, manifest last.

    drain(local, target)  one checkpoint, in the calling thread, retried with backoff
    Drainer               a background worker: submit() returns a Future per checkpoint,
                          applies retention after each success

Order on the target: data files (pieces in parallel, each verified against the blocks table
before it is sent), then (``verify="readback"``) every byte read back and verified, then the
index and blocks tables, then ``manifest.json``: until that last PUT the mirror holds no
loadable checkpoint. Files of other saves left on the target are removed after the commit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..concurrency import run_bounded
from ..manifest import MANIFEST, FileRecord, read_files, read_manifest, save_key_of
from ..store import LocalStore, open_regular
from .plan import (
    S3_MIN_PART,
    DrainError,
    MiB,
    Piece,
    TokenBucket,
    backoff_delay,
    classify,
    is_permanent,
    plan_pieces,
    verify_piece,
)
from .sinks import S3Sink, Sink, open_sink
from .state import DRAINING, FAILED, MIRRORED, Journal, drain_state

log = logging.getLogger(__name__)

VERIFY_MODES = ("sent", "readback")


@dataclass(frozen=True)
class DrainOptions:
    """How a drain behaves. Defaults suit a shared network: 4 transfers, 64 MiB pieces, no cap.

    max_transfers: pieces in flight at once (across files).
    part_size: bytes per piece (multipart part on S3; at least 5 MiB there).
    bandwidth: bytes/s cap for the whole drain (token bucket), None for no cap.
    verify: "sent" checks every piece's bytes against the blocks table before sending it;
        "readback" also reads every byte back from the target and checks it.
    retries: attempts after the first before the drain is marked failed.
    backoff, backoff_max: seconds of the first wait between attempts, and the cap (doubling).
    """

    max_transfers: int = 4
    part_size: int = 64 * MiB
    bandwidth: float | None = None
    verify: str = "sent"
    retries: int = 5
    backoff: float = 2.0
    backoff_max: float = 60.0

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.max_transfers < 1:
            raise ValueError(f"max_transfers must be >= 1, got {self.max_transfers}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


@dataclass
class DrainResult:
    location: str
    target: str
    save_key: str
    bytes_total: int
    bytes_sent: int = 0
    """Bytes sent by this call (resumed pieces are not counted)."""
    bytes_skipped: int = 0
    """Bytes already on the target from an earlier, interrupted drain."""
    bytes_verified_remote: int = 0
    seconds: float = 0.0
    attempts: int = 0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


Progress = Callable[[str, Piece], None]


def drain(
    local: str | os.PathLike,
    target: str,
    *,
    storage_options: dict[str, Any] | None = None,
    filesystem: Any = None,
    options: DrainOptions | None = None,
    progress: Progress | None = None,
) -> DrainResult:
    """Copy the committed checkpoint at ``local`` to ``target`` (any fsspec URL or a path).

    Resumes an interrupted drain of the same save to the same target without resending what
    the target already holds. Retries failures with exponential backoff; when it gives up the
    journal says ``failed: <cause>`` and DrainError is raised. The local checkpoint is only read.
    ``progress(file, piece)`` is called after each piece reaches the target.
    """
    options = options or DrainOptions()
    location = os.fspath(local)
    started = time.perf_counter()
    result: DrainResult | None = None
    journal: Journal | None = None
    attempt = 0
    while True:
        attempt += 1
        try:
            manifest = read_manifest(LocalStore(location), location)
            if journal is None or journal.doc["save_key"] != manifest.save_key:
                journal = Journal.open(location, target, manifest.save_key)
                result = DrainResult(location, target, manifest.save_key,
                                     int(manifest.doc.get("total_bytes", 0)))
            result.attempts = attempt
            journal.update(state=DRAINING, pid=os.getpid(), attempts=journal.doc.get("attempts", 0) + 1,
                           bytes_total=result.bytes_total)
            sink = open_sink(target, storage_options, filesystem)
            _attempt(location, manifest, sink, journal, options, result, progress)
            result.seconds = time.perf_counter() - started
            journal.update(state=MIRRORED, cause="", finished_unix=time.time())
            log.info("dcp_nvme: drained %s to %s: %.3f GB sent (%.3f GB already there) in %.2f s",
                     location, target, result.bytes_sent / 1e9, result.bytes_skipped / 1e9, result.seconds)
            return result
        except Exception as exc:  # noqa: BLE001  (botocore errors are not OSErrors)
            cause = classify(exc)
            if result is not None:
                result.errors.append(cause)
            final = is_permanent(exc) or attempt > options.retries
            if journal is not None:
                journal.update(state=FAILED if final else DRAINING, cause=cause)
            if final:
                log.error("dcp_nvme: drain of %s to %s failed after %d attempt(s): %s",
                          location, target, attempt, cause)
                raise DrainError(location, target, cause) from exc
            delay = backoff_delay(attempt, options.backoff, options.backoff_max)
            log.warning("dcp_nvme: drain of %s to %s, attempt %d failed (%s); retrying in %.2f s",
                        location, target, attempt, cause, delay)
            time.sleep(delay)


def _attempt(location, manifest, sink: Sink, journal: Journal, options: DrainOptions,
             result: DrainResult, progress: Progress | None) -> None:
    store = LocalStore(location)
    files = read_files(store, manifest, location)
    part_size = options.part_size
    if isinstance(sink, S3Sink):
        part_size = max(part_size, S3_MIN_PART)
    sink.prepare()
    work: list[tuple[FileRecord, list[Piece]]] = []
    for name in manifest.file_names:
        record = files.get(name)
        if record is None:
            raise DrainError(location, sink.target, f"{name} is missing from the blocks table")
        pieces = plan_pieces(record.size, record.data_start, record.checksum_block, part_size)
        entry = journal.file(name)
        if entry["done"]:
            if sink.remote_size(name) == record.size:
                result.bytes_skipped += record.size
                continue
            entry.update(done=False, pieces={})  # the target lost it (e.g. a server restarted empty)
        with journal.lock:
            sink.begin(name, record.size, entry)
            journal.save()
        skipped = sum(p.length for p in pieces if str(p.index) in entry["pieces"])
        result.bytes_skipped += skipped
        work.append((record, [p for p in pieces if str(p.index) not in entry["pieces"]]))

    bucket = TokenBucket(options.bandwidth, max(options.bandwidth or 0, part_size) if options.bandwidth else None)
    _send_all(store, sink, journal, work, options, bucket, result, progress)
    for record, _ in work:
        entry = journal.file(record.name)
        pieces = plan_pieces(record.size, record.data_start, record.checksum_block, part_size)
        sink.finish(record.name, pieces, entry)
        with journal.lock:
            entry.update(done=True, pieces={})
            journal.save()
    if options.verify == "readback":
        for name in manifest.file_names:
            _readback(sink, files[name], part_size, options, result)
    for entry in (manifest.doc["index"], manifest.doc["blocks"]):
        data = store.read(entry["name"])  # read_manifest checked the index; check both again
        _check_table(location, entry, data)
        sink.put_small(entry["name"], data)
    sink.put_small(MANIFEST, store.read(MANIFEST))  # the commit on the target
    for name in sink.names():
        stale = save_key_of(name)
        if stale and stale != manifest.save_key:
            sink.remove(name)


def _send_all(store, sink, journal, work, options, bucket, result, progress) -> None:
    lock = threading.Lock()

    def send(record: FileRecord, piece: Piece) -> None:
        with os.fdopen(open_regular(store.path(record.name)), "rb") as handle:  # no FIFO, no link
            data = os.pread(handle.fileno(), piece.length, piece.offset)
        if len(data) != piece.length:
            raise DrainError(store.path(record.name), sink.target,
                             f"local file is truncated at {piece.offset + len(data)} of {record.size}")
        verify_piece(record, piece.offset, data, store.path(record.name))  # what we send is right
        bucket.take(len(data))
        entry = journal.file(record.name)
        tag = sink.put_piece(record.name, piece, data, entry)
        journal.piece_done(record.name, piece.index, len(data), tag)
        with lock:
            result.bytes_sent += len(data)
        if progress is not None:
            progress(record.name, piece)

    def send_file(record: FileRecord, pieces: list[Piece]) -> None:
        for piece in pieces:
            send(record, piece)

    if sink.ordered:
        tasks = [(send_file, (record, pieces)) for record, pieces in work]
    else:
        tasks = [(send, (record, piece)) for record, pieces in work for piece in pieces]
    run_bounded(options.max_transfers, tasks, lambda task: task[0](*task[1]), "dcp-nvme-drain-io")


def _readback(sink: Sink, record: FileRecord, part_size: int, options: DrainOptions,
              result: DrainResult) -> None:
    where = sink.location(record.name)
    size = sink.remote_size(record.name)
    if size != record.size:
        raise DrainError(where, sink.target, f"readback: {record.name} is {size} bytes on the target, "
                         f"expected {record.size}")
    pieces = plan_pieces(record.size, record.data_start, record.checksum_block, part_size)

    def check(piece: Piece) -> None:
        data = sink.read_range(record.name, piece.offset, piece.offset + piece.length)
        verify_piece(record, piece.offset, data, where)

    run_bounded(options.max_transfers, pieces, check, "dcp-nvme-readback")
    result.bytes_verified_remote += record.size


def _check_table(location: str, entry: dict[str, Any], data: bytes) -> None:
    import crc32c

    from ..errors import ManifestError

    if len(data) != entry["size"] or crc32c.crc32c(data) != entry["crc32c"]:
        raise ManifestError(f"{location}: {entry['name']} does not match manifest.json; not draining "
                            "a corrupt checkpoint")


def verify_mirror(local: str | os.PathLike, target: str, *, storage_options: dict[str, Any] | None = None,
                  filesystem: Any = None, options: DrainOptions | None = None) -> DrainResult:
    """Read every byte of a drained checkpoint back from its target and check it against the
    local blocks table. A mismatch marks the drain ``failed: checksum mismatch`` and raises."""
    options = options or DrainOptions(verify="readback")
    location = os.fspath(local)
    manifest = read_manifest(LocalStore(location), location)
    files = read_files(LocalStore(location), manifest, location)
    journal = Journal.open(location, target, manifest.save_key)
    result = DrainResult(location, target, manifest.save_key, int(manifest.doc.get("total_bytes", 0)))
    started = time.perf_counter()
    sink = open_sink(target, storage_options, filesystem)
    try:
        if not sink.has(MANIFEST):
            raise DrainError(location, target, "the target holds no committed manifest.json")
        for name in manifest.file_names:
            _readback(sink, files[name], options.part_size, options, result)
    except Exception as exc:
        journal.update(state=FAILED, cause=classify(exc))
        raise
    result.seconds = time.perf_counter() - started
    return result


class Drainer:
    """Drains checkpoints in the background, one at a time, in submission order.

    ``submit`` returns a Future resolving to a DrainResult (or raising DrainError). With
    ``keep_last=K`` the parent directory of each drained checkpoint is pruned to the K newest
    local checkpoints after every success; checkpoints not yet mirrored are never removed.
    The worker thread is not a daemon: a process that ends waits for queued drains.
    """

    def __init__(self, options: DrainOptions | None = None, *, keep_last: int | None = None) -> None:
        self.options = options or DrainOptions()
        self.keep_last = keep_last
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-drain")
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, local: str | os.PathLike, target: str, *, storage_options: dict[str, Any] | None = None,
               filesystem: Any = None) -> Future[DrainResult]:
        def run() -> DrainResult:
            result = drain(local, target, storage_options=storage_options, filesystem=filesystem,
                           options=self.options)
            if self.keep_last is not None:
                from .retention import apply_retention

                apply_retention(os.path.dirname(os.path.abspath(os.fspath(local))), self.keep_last)
            return result

        future = self._pool.submit(run)
        future.add_done_callback(_log_failure)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [future]
        return future

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted drain has finished; re-raise the first failure."""
        with self._lock:
            futures = list(self._futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in futures:
            future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def state(self, local: str | os.PathLike):
        return drain_state(local)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("dcp_nvme: background drain failed: %s", future.exception())


_default: Drainer | None = None
_default_lock = threading.Lock()


def default_drainer() -> Drainer:
    """The process-wide Drainer used by ``NVMeWriter(mirror=...)``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Drainer()
        return _default


def set_default_drainer(drainer: Drainer | None) -> Drainer | None:
    """Replace the process-wide Drainer (e.g. ``Drainer(DrainOptions(bandwidth=...), keep_last=3)``);
    returns the one it replaces (None: a default one is made on first use)."""
    global _default
    with _default_lock:
        previous, _default = _default, drainer
    return previous
