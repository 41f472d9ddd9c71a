"""The drain: copy one committed local checkpoint to its mirror, confirmed, manifest last.

    drain(local, target)  one checkpoint, in the calling thread, retried with backoff
    (the background worker, ``Drainer``, is ``tiers.background``)

The save being drained is fixed when the drain starts: its manifest and tables are read once
and checked, and a drain whose checkpoint is overwritten before the commit fails (the new save
gets a drain of its own). Order on the target: data files (pieces in parallel, each verified
against the blocks table before it is sent), each then checked for its size, (``verify=
"readback"``) every byte read back and verified, then the index and blocks tables (read back),
then ``manifest.json``: until that last write the mirror holds no loadable checkpoint. A piece
or file an earlier, interrupted drain left on the target is skipped only once the target
confirms it (read back, or the server's md5 of it equals the local bytes'). Files of other
saves left on the target are removed after the commit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any, TypeGuard

from dcp_nvme.engines.requests import run_bounded
from dcp_nvme.errors import (
    CheckpointNotFoundError,
    DrainError,
    ManifestError,
    MissingDependencyError,
)
from dcp_nvme.format.container import MANIFEST, save_key_of
from dcp_nvme.format.pieces import Piece, plan_pieces, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.storage.local_dir import is_local_path
from dcp_nvme.tiers.compress import SUFFIX as CODED_SUFFIX
from dcp_nvme.tiers.compress import CompressedSource, default_threads, remove_scratch, through_codec
from dcp_nvme.tiers.delta import journal_summary, pick_base
from dcp_nvme.tiers.journal import DRAINING, FAILED, MIRRORED, DrainBusy, Journal, drain_lock
from dcp_nvme.tiers.options import DrainOptions
from dcp_nvme.tiers.sinks import Sink, open_sink
from dcp_nvme.tiers.source import DrainSource, overwritten
from dcp_nvme.tiers.target import (
    Heartbeat,
    heartbeat_interval,
    put_confirmed,
    refuse_other_checkpoint,
    wait_for_every_node,
)
from dcp_nvme.tiers.transfer import (
    IncompleteOnTarget,
    NodeSilent,
    SourceChanged,
    TokenBucket,
    backoff_delay,
    check_coverage,
    classify,
    exiting,
    is_permanent,
    matching_pieces,
    no_credentials,
    overlap,
    piece_entry,
    step,
    unreachable,
)

log = logging.getLogger(__name__)


Hook = Callable[[str, dict[str, Any]], None]


_hook: Hook | None = None
"""Test seam: called at named points of a drain (``piece-sent``, ``piece-journaled``,
``file-finished``, ``before-commit``) so crash and race tests can act at an exact moment."""


def set_drain_hook(hook: Hook | None) -> Hook | None:
    """Install ``hook(point, info)`` (tests: kill the process, overwrite the source...)."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def _at(point: str, **info: Any) -> None:
    if _hook is not None:
        _hook(point, info)


@dataclass
class DrainResult:
    location: str
    target: str
    save_key: str
    bytes_total: int
    bytes_sent: int = 0
    """Bytes sent by this call (confirmed, resumed pieces are not counted)."""
    bytes_skipped: int = 0
    """Bytes an earlier, interrupted drain left on the target, confirmed there and not resent."""
    bytes_verified_remote: int = 0
    seconds: float = 0.0
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    compression: dict[str, Any] = field(default_factory=dict)
    """What compression decided and cost: mode, ratio, stored bytes, encode and CPU seconds."""
    nodes: list[str] = field(default_factory=list)
    """Of a node-local checkpoint: the nodes whose files this drain sent."""

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

    Resumes an interrupted drain of the same save to the same target, resending only what the
    target cannot confirm. Retries failures with exponential backoff; when it gives up the
    journal says ``failed: <cause>`` and DrainError is raised. The local checkpoint is only
    read; a target that is the checkpoint (or inside it, or holds it) is refused. The drain is
    of the save committed when it starts: if the checkpoint is overwritten before the target's
    commit, it fails (``source changed``) and leaves nothing committed for that save.
    ``progress(file, piece)`` is called after each piece reaches the target.
    """
    options = options or DrainOptions()
    location = os.fspath(local)
    if is_local_path(target) and "://" not in target:  # a plain path is recorded (journal, a delta's
        target = os.path.abspath(target)  # base) absolute: it resolves from any working directory
    try:
        _refuse_overlap(location, target, open_sink(target, storage_options, filesystem))
        with drain_lock(location, target):
            if options.compress != "off" and DrainSource(location).node_local:
                raise DrainError(location, target, f"compress={options.compress!r} is not available for a "
                                 "node-local checkpoint (each node drains its own files); drain it with "
                                 "compress='off'")
            return _drain_locked(location, target, storage_options, filesystem, options, progress)
    except (DrainBusy, CheckpointNotFoundError, MissingDependencyError) as exc:
        raise DrainError(location, target, str(exc)) from exc


def _drain_locked(location: str, target: str, storage_options: dict[str, Any] | None, filesystem: Any,
                  options: DrainOptions, progress: Progress | None) -> DrainResult:
    return _DrainRun(location, target, storage_options, filesystem, options, progress).run()


class _DrainRun:
    """One drain under its lock, as named steps, attempt after attempt: read the save, code it
    (when asked), send it (``_attempt``), then mark it mirrored; a failure is retried with
    backoff until it is permanent or the retries are spent."""

    def __init__(self, location: str, target: str, storage_options: dict[str, Any] | None, filesystem: Any,
                 options: DrainOptions, progress: Progress | None) -> None:
        self.location, self.target, self.options, self.progress = location, target, options, progress
        self.storage_options = storage_options
        self.open_sink = lambda: open_sink(target, storage_options, filesystem)
        self.mirror_manifest = lambda url: _mirror_manifest(url, storage_options, filesystem)
        self.started = time.perf_counter()
        self.result: DrainResult | None = None
        self.journal: Journal | None = None
        self.source: DrainSource | None = None
        self.coded: CompressedSource | None = None
        self.answered = False
        """Whether the target answered in this drain (its preparation went through, once)."""
        self.heartbeat: Heartbeat | None = None

    def run(self) -> DrainResult:
        try:
            return self._run()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()

    def _run(self) -> DrainResult:
        attempt = 0
        while True:
            attempt += 1
            sink: Sink | None = None
            try:
                self._read_source(attempt)
                sink = self.open_sink()
                with step(f"preparing the target {sink.target}"):
                    sink.prepare()
                self.answered = True
                _, journal, result = self._current()
                _attempt(self._sending(), sink, journal, self.options, result, self.progress)
                return self._mirrored()
            except Exception as exc:  # noqa: BLE001  (botocore errors are not OSErrors)
                time.sleep(self._failed(exc, sink, attempt))

    def _read_source(self, attempt: int) -> None:
        """The save as committed now: the same save as at the first attempt, or a SourceChanged."""
        fresh = DrainSource(self.location)
        if self.source is not None and fresh.save_key != self.source.save_key:
            raise overwritten(self.location, f"save {self.source.save_key} was replaced by save {fresh.save_key}")
        self.source = fresh
        if fresh.node_local and self.heartbeat is None:  # the other nodes' drains wait while it beats
            self.heartbeat = Heartbeat(self.open_sink(), fresh.save_key, fresh.nodes_here,
                                       heartbeat_interval(self.options))
        if self.journal is None:
            self.journal = Journal.open(self.location, self.target, fresh.save_key, self.storage_options)
            self.result = DrainResult(self.location, self.target, fresh.save_key,
                                      int(fresh.manifest.doc.get("total_bytes", 0)))
        _, journal, result = self._current()
        result.attempts = attempt
        journal.update(state=DRAINING, pid=os.getpid(), attempts=journal.doc.get("attempts", 0) + 1,
                       bytes_total=result.bytes_total, cause="")
        fresh.check_present()  # a missing or cut local file: failed at once, and journaled

    def _sending(self) -> DrainSource | CompressedSource:
        """What goes to the target: the save itself, or its coded view (coded once per save,
        kept across retries)."""
        options = self.options
        source, _, result = self._current()
        if options.compress == "off":
            return source
        if self.coded is None or self.coded.save_key != source.save_key:
            base, why = None, ""
            if options.compress == "delta":
                base, why = pick_base(self.location, self.target, options.delta_every, self.mirror_manifest)
            view, result.compression = through_codec(
                source, options.compress, link=options.bandwidth or options.link_rate,
                threads=options.codec_threads or default_threads(), level=options.level, base=base, base_why=why)
            self.coded = view if isinstance(view, CompressedSource) else None
        return self.coded or source

    def _current(self) -> tuple[DrainSource, Journal, DrainResult]:
        """The save, its journal and the result as ``_read_source`` left them (each attempt reads first)."""
        if self.source is None or self.journal is None or self.result is None:
            raise AssertionError(f"{self.location}: the drain has not read its source")
        return self.source, self.journal, self.result

    def _mirrored(self) -> DrainResult:
        _, journal, result = self._current()
        if self.coded is not None:
            result.compression.update(self.coded.summary())
            self.coded.close()
        remove_scratch(self.location)
        result.seconds = time.perf_counter() - self.started
        journal.update(state=MIRRORED, cause="", finished_unix=time.time(),
                       compression=_summary(result.compression))
        log.info("dcp_nvme: drained %s to %s: %.3f GB sent (%.3f GB confirmed already there) in %.2f s",
                 self.location, self.target, result.bytes_sent / 1e9, result.bytes_skipped / 1e9, result.seconds)
        return result

    def _failed(self, exc: Exception, sink: Sink | None, attempt: int) -> float:
        """Journal the failure; raise DrainError when it is final, else return the backoff."""
        if sink is not None:
            sink.abandon()
        source, journal = self.source, self.journal
        why = source.changed() if source is not None and not isinstance(exc, SourceChanged) else None
        if why is not None:  # e.g. a data file the overwrite's cleanup removed under us
            changed = overwritten(self.location, why)
            changed.__cause__ = exc
            exc = changed
        refused = exiting(exc)
        if refused is not None and refused is not exc:  # the interpreter is exiting: final, never retried
            refused.__cause__ = exc
            exc = refused
        cause = classify(exc)
        if self.result is not None:
            self.result.errors.append(cause)
        # an endpoint that never answered, after botocore's and s3fs's own connection retries,
        # is a wrong URL or a server that is down: waiting minutes between attempts finds it down
        permanent = is_permanent(exc) or (unreachable(exc) and not self.answered)
        final = permanent or attempt > self.options.retries
        if self.coded is not None and (final or self.coded.failed):  # a failed coder codes again next time
            self.coded.close()
            self.coded = None
        # a drain cut short by the exit keeps what reached the target: its resume confirms it
        # (a target that never answered, or no credentials: nothing to clean there, and no way to)
        # nor a drain that gave up on a silent node: what this node sent stays for the resume
        if final and permanent and refused is None and journal is not None and not isinstance(exc, NodeSilent) \
                and not (not self.answered and (unreachable(exc) or no_credentials(exc))):
            _discard(sink, journal, self.open_sink)
        if final:  # a later drain codes again (deterministic): the fast tier gets its space back
            remove_scratch(self.location)
        if journal is not None:
            try:
                journal.update(state=FAILED if final else DRAINING, cause=cause)
            except OSError as journal_error:  # e.g. the same full disk: the drain's own error is the news
                log.warning("dcp_nvme: the drain journal of %s could not record the failure: %s",
                            self.location, journal_error)
        if final:
            log.error("dcp_nvme: drain of %s to %s failed after %d attempt(s)%s: %s", self.location,
                      self.target, attempt, " (not retried: a retry cannot fix it)" if permanent else "", cause)
            raise DrainError(self.location, self.target, cause) from exc
        delay = backoff_delay(attempt, self.options.backoff, self.options.backoff_max)
        log.warning("dcp_nvme: drain of %s to %s, attempt %d failed (%s); retrying in %.2f s",
                    self.location, self.target, attempt, cause, delay)
        return delay


def _summary(compression: dict[str, Any]) -> dict[str, Any]:
    """What the journal keeps of the compression (status prints it): codec and ratio, or off."""
    delta = {"delta": journal_summary(compression["delta"])} if "delta" in compression else {}
    if not compression.get("codec"):
        return {"mode": compression.get("mode", "off"), **delta}
    return {"mode": compression["mode"], "codec": compression["codec"], "ratio": round(compression["ratio"], 4),
            **delta}


def _mirror_manifest(url: str, storage_options: dict[str, Any] | None, filesystem: Any) -> Any:
    """The manifest committed at a mirror URL, parsed, or None when there is none readable."""
    try:
        sink = open_sink(url, storage_options, filesystem)
        return json.loads(sink.read_small(MANIFEST)) if sink.has(MANIFEST) else None
    except Exception:  # noqa: BLE001  no usable base: the drain codes full
        return None


def _refuse_overlap(location: str, target: str, sink: Sink) -> None:
    if sink.local_root is None:
        return
    why = overlap(os.path.realpath(location), os.path.realpath(sink.local_root))
    if why is not None:
        raise DrainError(location, target, f"refused: {why}; a mirror must be another directory "
                         "(draining there would replace or delete the only copy)")


def _plan(record: FileRecord, entry: dict[str, Any], part_size: int, sink: Sink) -> tuple[int, list[Piece]]:
    """The part size for one file and its pieces: the size its unfinished transfer began with,
    else the option's, made larger where the target takes fewer parts than that would cut."""
    planned = entry.get("part_size")
    in_progress = bool(entry["pieces"]) or bool(entry.get("upload_id"))
    if in_progress and isinstance(planned, int) and planned >= sink.min_part:
        return planned, plan_pieces(record.size, record.data_start, record.checksum_block, planned)
    pieces = plan_pieces(record.size, record.data_start, record.checksum_block, part_size)
    if sink.max_parts is None or len(pieces) <= sink.max_parts:
        return part_size, pieces
    # S3 numbers at most max_parts parts: the fewest whole checksum blocks a part that fit
    block = record.checksum_block
    planned = -(-(record.size - record.data_start) // (sink.max_parts * block)) * block
    return planned, plan_pieces(record.size, record.data_start, record.checksum_block, planned)


def _attempt(source: DrainSource | CompressedSource, sink: Sink, journal: Journal, options: DrainOptions,
             result: DrainResult, progress: Progress | None) -> None:
    manifest = source.manifest
    part_size = max(options.part_size, sink.min_part)
    refuse_other_checkpoint(manifest.doc, sink)
    result.bytes_skipped = 0
    work: list[tuple[FileRecord, list[Piece], list[Piece]]] = []
    streamed: list[str] = []
    for name in source.names:
        entry = journal.file(name)
        if _streams(source, sink, name, entry):
            with journal.lock, step(f"opening the transfer of {sink.location(name)}"):
                entry.update(done=False, part_size=part_size)
                sink.begin(name, source.opening(name), entry, resuming=False)
                journal.save()
            streamed.append(name)
            continue
        record = _record(source, name)
        planned, pieces = _plan(record, entry, part_size, sink)
        with step(f"checking {sink.location(name)} on the target"):
            complete = sink.confirm_file(name, record, pieces, source.piece)
        if complete:
            with journal.lock:
                entry.update(done=True, pieces={}, part_size=planned)
                entry.pop("upload_id", None)
                journal.save()
            result.bytes_skipped += record.size
            continue
        claimed = matching_pieces(entry["pieces"], pieces)
        with journal.lock, step(f"opening the transfer of {sink.location(name)}"):
            entry.update(done=False, part_size=planned)
            sink.begin(name, record, entry, resuming=bool(claimed))
            journal.save()
        with step(f"confirming the pieces of {sink.location(name)} already on the target"):
            confirmed = sink.confirm_pieces(name, record, pieces, claimed, source.piece)
        with journal.lock:
            entry["pieces"] = {str(i): piece_entry(pieces[i], tag) for i, tag in confirmed.items()}
            journal.save()
        result.bytes_skipped += sum(pieces[i].length for i in confirmed)
        work.append((record, pieces, [p for p in pieces if p.index not in confirmed]))

    # at most one piece ahead of the cap: a second's burst let the drain run 10 % over it for
    # seconds beside training's collectives
    bucket = TokenBucket(options.bandwidth, part_size if options.bandwidth else None)
    _send_all(source, sink, journal, work, options, bucket, result, progress,
              [(name, part_size) for name in streamed])
    for name in streamed:  # coded by now: the plan of the finished file, as every other file's
        record = _record(source, name)
        work.append((record, plan_pieces(record.size, record.data_start, record.checksum_block, part_size), []))
    for record, pieces, _ in work:
        _finish_file(sink, journal, record, pieces)
    if options.verify == "readback":
        for name in source.names:
            readback(sink, _record(source, name), part_size, options, result)
    # every node drains its own files; the mirror commits once all have (sent plain: a DrainSource)
    if isinstance(source, DrainSource) and source.node_local:
        wait_for_every_node(sink, source, options, journal)
    for name, data in source.tables:
        put_confirmed(sink, name, data)
    _at("before-commit", location=source.location)
    why = source.changed()
    if why is not None:
        raise overwritten(source.location, why)
    put_confirmed(sink, MANIFEST, source.manifest_bytes, commit=True)
    _remove_stale(sink, source.save_key, set(manifest.file_names) | {name for name, _ in source.tables})
    result.nodes = source.nodes_here


def _finish_file(sink: Sink, journal: Journal, record: FileRecord, pieces: list[Piece]) -> None:
    """Publish one file once every planned piece is journaled as sent or confirmed, then check
    its size on the target against the manifest."""
    where = sink.location(record.name)
    entry = journal.file(record.name)
    with journal.lock:
        tags = matching_pieces(entry["pieces"], pieces)
    missing = [p.index for p in pieces if p.index not in tags]
    if missing:
        raise IncompleteOnTarget(f"{where}: piece(s) {missing[:5]} never reached the target; not committing")
    check_coverage(pieces, record.size, where)
    with step(f"completing {where}"):
        sink.finish(record.name, pieces, tags, entry)
    _at("file-finished", name=record.name)
    with step(f"checking the size of {where}"):
        size = sink.remote_size(record.name)
    if size != record.size:
        raise IncompleteOnTarget(f"{where} is {size} bytes on the target after its transfer, the manifest "
                                 f"says {record.size}; not committing")
    with journal.lock:
        entry.update(done=True, pieces={})
        entry.pop("upload_id", None)
        journal.save()


def _remove_stale(sink: Sink, save_key: str, sent: set[str]) -> None:
    """After the commit: files of other saves (an overwritten checkpoint) leave the target, and
    so do temporary files of drains that were killed (partial files, half-written temps)."""
    try:
        for name in sink.names():
            if name.startswith((".drain-node.", ".drain-alive.")):
                if not name.startswith((f".drain-node.{save_key}.", f".drain-alive.{save_key}.")):
                    sink.remove(name)  # another save's node markers and heartbeats
                continue
            if name.startswith(".") and (".drain-partial" in name or ".drain-tmp-" in name):
                if save_key_of(name[1:].split(".drain-", 1)[0].removesuffix(CODED_SUFFIX)) != save_key:
                    sink.remove(name)
                continue
            stale = save_key_of(name.removesuffix(CODED_SUFFIX))
            if stale and (stale != save_key or name not in sent):  # older saves; plain vs coded
                sink.remove(name)
    except Exception as exc:  # noqa: BLE001  the mirror is committed; leftovers only cost space
        log.warning("dcp_nvme: %s is mirrored, but removing files of older saves there failed: %s",
                    sink.target, classify(exc))


def _discard(sink: Sink | None, journal: Journal, open_target: Callable[[], Sink]) -> None:
    """After a permanent failure: drop this save's unfinished transfers and, unless the target's
    committed manifest is this save's, its data files there too. Best effort."""
    save_key = journal.doc["save_key"]
    try:
        sink = sink if sink is not None else open_target()
        with journal.lock:
            for name, entry in journal.doc["files"].items():
                if isinstance(entry, dict):
                    sink.discard(name, entry)
                    entry.update(done=False, pieces={})
        committed = None
        if sink.has(MANIFEST):
            committed = json.loads(sink.read_small(MANIFEST)).get("save_key")
        if committed != save_key:
            for name in sink.names():
                if save_key_of(name.removesuffix(CODED_SUFFIX)) == save_key:
                    sink.remove(name)
    except Exception as exc:  # noqa: BLE001  cleanup must not hide the failure being reported
        log.warning("dcp_nvme: could not clean up the unfinished drain on %s: %s",
                    sink.target if sink is not None else journal.doc.get("target"), classify(exc))


def _record(source: DrainSource | CompressedSource, name: str) -> FileRecord:
    record = source.record(name)
    if record is None:
        raise ManifestError(f"{source.location}: {name} is missing from the blocks table")
    return record


def _streams(source: DrainSource | CompressedSource, sink: Sink, name: str,
             entry: dict[str, Any]) -> TypeGuard[CompressedSource]:
    """Whether a file is sent while it is still being coded: it is, and nothing of it was ever
    sent (a fresh journal entry: nothing on the target to confirm first), and the target takes
    pieces in any order (the first piece, holding the header, is coded last)."""
    return (isinstance(source, CompressedSource) and source.coding(name) and not sink.ordered
            and not entry.get("done") and not entry["pieces"] and not entry.get("upload_id"))


def _send_all(source: DrainSource | CompressedSource, sink: Sink, journal: Journal,
              work: list[tuple[FileRecord, list[Piece], list[Piece]]], options: DrainOptions,
              bucket: TokenBucket, result: DrainResult, progress: Progress | None,
              streamed: Sequence[tuple[str, int]] = ()) -> None:
    lock = threading.Lock()

    def send(record: FileRecord, piece: Piece) -> None:
        buffer = sink.buffer(piece.length) if isinstance(source, DrainSource) else None
        data = source.piece_into(record, piece, buffer) if buffer is not None and isinstance(source, DrainSource) \
            else source.piece(record, piece)
        bucket.take(len(data))
        entry = journal.file(record.name)
        where = sink.location(record.name)
        with step(f"sending piece {piece.index} (bytes {piece.offset}-{piece.offset + piece.length}) "
                   f"of {where}"):
            tag = sink.put_piece(record.name, piece, data, entry, record)
        _at("piece-sent", name=record.name, piece=piece)
        journal.piece_done(record.name, piece, tag)
        _at("piece-journaled", name=record.name, piece=piece)
        with lock:
            result.bytes_sent += len(data)
        if progress is not None:
            progress(record.name, piece)

    def send_file(record: FileRecord, pieces: list[Piece]) -> None:
        for piece in pieces:
            send(record, piece)

    tasks: list[Callable[[], None]]
    if sink.ordered:
        tasks = [partial(send_file, record, todo) for record, _, todo in work]
    else:
        tasks = [partial(send, record, piece) for record, _, todo in work for piece in todo]
    # pieces of files still being coded are drawn as the coder writes them (run_bounded draws
    # lazily): sending overlaps coding
    coded: Iterator[Callable[[], None]] = iter(())
    if streamed:
        assert isinstance(source, CompressedSource)  # only files being coded stream
        coded = (partial(send, *found) for name, part_size in streamed for found in source.stream(name, part_size))
    run_bounded(options.max_transfers, chain(tasks, coded), lambda task: task(), "dcp-nvme-drain-io")


def readback(sink: Sink, record: FileRecord, part_size: int, options: DrainOptions,
              result: DrainResult) -> None:
    where = sink.location(record.name)
    size = sink.remote_size(record.name)
    if size != record.size:
        raise IncompleteOnTarget(f"readback: {where} is {size} bytes on the target, expected {record.size}")
    pieces = plan_pieces(record.size, record.data_start, record.checksum_block, part_size)

    def check(piece: Piece) -> None:
        with step(f"reading back {where} bytes {piece.offset}-{piece.offset + piece.length}"):
            data = sink.read_range(record.name, piece.offset, piece.offset + piece.length)
            verify_piece(record, piece.offset, data, where)

    run_bounded(options.max_transfers, pieces, check, "dcp-nvme-readback")
    result.bytes_verified_remote += record.size
