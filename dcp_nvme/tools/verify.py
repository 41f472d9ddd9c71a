"""``verify``: read every byte of a checkpoint and check every checksum and cross-reference.

Checked: the manifest, the index and the blocks table pass the validation every reader runs
(``manifest.read_manifest``/``read_files``: names, sizes, crc32c, row counts, each row inside
its data region, no shared bytes, tiling; the first failure there ends the check, since nothing
after it can be trusted); each container is a regular file of the recorded size, its header
bytes match ``header_crc``, its safetensors header parses and places, types and shapes every
item exactly as the index does; every ``checksum_block`` of every data region matches its
crc32c. Container problems are all collected, with the file, byte range and items they hit; in
a compressed mirror a chunk that does not decode is one such problem (``DecodedStore.read_into_checked``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c

from dcp_nvme.engines.requests import run_bounded
from dcp_nvme.errors import (
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    DCPNVMeError,
    InvalidInputError,
    ManifestError,
    TableError,
)
from dcp_nvme.format.checksums import checks_within, host_crcs, items_in, mismatches
from dcp_nvme.format.container import MANIFEST, parse_header
from dcp_nvme.format.manifest import Manifest, read_files, read_manifest
from dcp_nvme.format.safetensors_files import (
    HF_DIR,
    HF_INDEX,
    SAFETENSORS_FILE,
    check_layout,
    hf_files,
    scan_file,
    what_is,
)
from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.format.validation import header_mismatches
from dcp_nvme.humanize import progress_bar
from dcp_nvme.load.objects import items_needing_pickle
from dcp_nvme.storage.fsspec_dir import open_store
from dcp_nvme.storage.local_dir import Store, is_remote_url
from dcp_nvme.tiers.coded import decoded_view

DEFAULT_SPAN = 8 << 20
"""Bytes one worker reads and checks per task (rounded to whole checksum blocks)."""


@dataclass
class Problem:
    file: str
    kind: str
    """manifest, index, blocks, missing, size, header, layout, data, incomplete, pickle"""
    message: str
    start: int | None = None
    end: int | None = None
    items: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f" bytes [{self.start}, {self.end})" if self.start is not None else ""
        items = f" (items: {', '.join(self.items)})" if self.items else ""
        return f"{self.file}{where}: {self.message}{items}"


@dataclass
class VerifyReport:
    location: str
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    needs_pickle: list[str] = field(default_factory=list)
    """Non-tensor items that load only with ``allow_pickle=True`` (they would run code)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ok=self.ok, gbps=self.gbps, problems=[{**asdict(p), "text": str(p)} for p in self.problems])
        return out


def verify_checkpoint(
    location: str | os.PathLike,
    *,
    jobs: int = 4,
    progress: bool = False,
    span: int = DEFAULT_SPAN,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> VerifyReport:
    """Verify a checkpoint (local path or fsspec URL, ``storage_options`` its filesystem's
    options). ``report.ok`` only when all is intact.

    Raises CheckpointNotFoundError when the path is missing or holds no dcp_nvme checkpoint at
    all; an unfinished or damaged checkpoint is a report with problems, not an exception.
    A non-tensor item that only full pickle can load is listed in ``report.needs_pickle`` and
    is not a problem: integrity and the pickle policy are apart (``allow_pickle`` is kept for
    callers and changes nothing).
    """
    if jobs < 1:
        raise InvalidInputError(f"--jobs must be at least 1, got {jobs}")
    if not is_remote_url(location) and what_is(location) in (HF_DIR, SAFETENSORS_FILE):
        return _verify_safetensors(os.fspath(location))
    source = decoded_view(open_store(location, storage_options))  # a compressed mirror reads as its plain files
    report = VerifyReport(source.location)
    started = time.perf_counter()
    manifest = _manifest(source, report)
    if manifest is not None:
        files = _files(source, manifest, report)
        if files is not None:
            _check_tables(manifest, files, report)
            _check_containers(source, manifest, files, report, jobs, progress, span)
        _check_objects(source, manifest, report)
    report.seconds = time.perf_counter() - started
    return report


def _verify_safetensors(location: str) -> VerifyReport:
    """A Hugging Face model directory or safetensors file: no checksums to check, so what can
    be is: its index and every file's header (``load.foreign``: names, dtypes, offsets inside
    the file)."""
    report = VerifyReport(location)
    started = time.perf_counter()
    try:
        files = hf_files(location, what_is(location))
    except ManifestError as exc:
        report.problems.append(Problem(HF_INDEX, "index", str(exc)))
        files = []
    chunks = []
    for file in files:
        try:
            chunks += scan_file(file)
        except (ManifestError, OSError) as exc:
            report.problems.append(Problem(os.path.basename(file), "header", str(exc)))
        report.files += 1
    if not report.problems:
        try:  # the files together: every tensor tiled by its chunks (no shard missing, none overlapping)
            check_layout(chunks, location)
        except ManifestError as exc:
            report.problems.append(Problem(os.path.basename(location), "layout", str(exc)))
    report.seconds = time.perf_counter() - started
    return report


# --------------------------------------------------------------------------- manifest and tables


def _manifest(source: Store, report: VerifyReport) -> Manifest | None:
    try:
        return read_manifest(source, source.location)
    except CheckpointNotCommittedError as exc:
        report.problems.append(Problem(MANIFEST, "incomplete", str(exc)))
    except CheckpointNotFoundError:
        raise
    except TableError as exc:  # a table missing or not matching manifest.json
        report.problems.append(Problem(exc.name, "index" if exc.name.startswith("index.") else "blocks", str(exc)))
    except (ManifestError, ValueError, KeyError, TypeError) as exc:  # a corrupt manifest or index
        report.problems.append(Problem(MANIFEST, "manifest", str(exc)))
    # anything else (credentials, an unreachable store) is not a finding about the checkpoint: raised
    return None


def _files(source: Store, manifest: Manifest, report: VerifyReport) -> dict[str, FileRecord] | None:
    name = manifest.doc["blocks"].get("name", "blocks table") if isinstance(manifest.doc["blocks"], dict) else "?"
    try:
        return read_files(source, manifest, source.location)
    except Exception as exc:
        report.problems.append(Problem(name, "blocks", str(exc)))
        return None


def _check_tables(manifest: Manifest, files: dict[str, FileRecord], report: VerifyReport) -> None:
    """What read_manifest/read_files leave to verify: the manifest's total agrees with the files.

    Every name and number of the manifest, the index and the blocks table (files listed alike,
    ranks, sizes, checksum blocks, each row inside its data region, no shared bytes, tiling) was
    checked while reading them; a failure there is already a problem of this report."""
    doc = manifest.doc
    if doc.get("total_bytes") != sum(f.size for f in files.values()):
        report.problems.append(Problem(MANIFEST, "manifest", (
            f"total_bytes {doc.get('total_bytes')} differs from the sum of file sizes "
            f"{sum(f.size for f in files.values())}")))


# --------------------------------------------------------------------------- containers


def _check_header(source: Store, record: FileRecord, rows: list[ChunkRecord], report: VerifyReport,
                  actual: int) -> bool:
    """Header crc, safetensors parse, and agreement with the index; False when unreadable."""
    prefix = bytearray(min(record.data_start, actual))  # what the file really holds, at most
    got, damaged = _read(source, record.name, 0, memoryview(prefix))
    report.bytes_read += got
    if got < record.data_start:
        report.problems.append(Problem(record.name, "size", f"ends at byte {got}, inside its header"))
        return False
    if damaged:  # a compressed mirror's chunk: the header is unknown, its data still checked
        report.problems.extend(Problem(record.name, "header", why, lo, hi) for lo, hi, why in damaged)
        return True
    if crc32c.crc32c(prefix) != record.header_crc:
        report.problems.append(Problem(record.name, "header", "header bytes do not match their crc32c",
                                       0, record.data_start))
    try:
        _, items, data_start = parse_header(prefix, record.name)
    except DCPNVMeError as exc:
        report.problems.append(Problem(record.name, "header", str(exc), 0, record.data_start))
        return True
    if data_start != record.data_start:
        report.problems.append(Problem(record.name, "header", (
            f"the safetensors header puts the data at byte {data_start}, the blocks table at "
            f"{record.data_start}"), 0, record.data_start))
        return True
    for message in header_mismatches(items, rows, record.data_start):
        report.problems.append(Problem(record.name, "layout", message, 0, record.data_start,
                                       _keys_named(message, rows)))
    return True


def _keys_named(message: str, rows: list[ChunkRecord]) -> tuple[str, ...]:
    return tuple(r.key for r in rows if f"{r.key!r}" in message)


@dataclass(frozen=True)
class _Task:
    record: FileRecord
    first_block: int
    blocks: int

    @property
    def start(self) -> int:
        return self.record.data_start + self.first_block * self.record.checksum_block

    @property
    def length(self) -> int:
        return min(self.blocks * self.record.checksum_block, self.record.size - self.start)


def _tasks(records: list[FileRecord], span: int) -> Iterator[_Task]:
    for record in records:
        per_task = max(1, span // record.checksum_block)
        for first in range(0, len(record.crcs), per_task):
            yield _Task(record, first, min(per_task, len(record.crcs) - first))


def _check_span(source: Store, task: _Task, buffer: bytearray) -> tuple[int, list[tuple[int, int, str]]]:
    """Read one task's blocks; return the bytes read and the bad ``(start, end, why)`` ranges."""
    record, length = task.record, task.length
    view = memoryview(buffer)[:length]
    got, damaged = _read(source, record.name, task.start, view)
    checks = checks_within(record, task.start, task.start + length)
    bad = [(task.start + rel, task.start + rel + n, "unreadable: the file ends before this block")
           for rel, n, _ in checks if rel + n > got]
    readable = checks[: len(checks) - len(bad)]
    bad += [(task.start + rel, task.start + rel + n, "data does not match its crc32c")
            for (rel, n, _), _ in mismatches(readable, host_crcs([view], readable))]
    if damaged:  # a chunk that did not decode is its own problem, not also its blocks' crcs
        bad = [b for b in bad if not any(lo < b[1] and b[0] < hi for lo, hi, _ in damaged)] + damaged
    return got, bad


def _read(source: Store, name: str, offset: int, view: memoryview) -> tuple[int, list[tuple[int, int, str]]]:
    """Bytes read, and the damaged ranges of a compressed mirror's chunks (reported as problems
    rather than raised, so that verify lists every damaged chunk; ``DecodedStore``)."""
    checked = getattr(source, "read_into_checked", None)
    if checked is None:
        return source.read_into(name, offset, view), []
    return checked(name, offset, view)


def _merge(ranges: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    merged: list[tuple[int, int, str]] = []
    for start, end, why in sorted(ranges):
        if merged and merged[-1][1] == start and merged[-1][2] == why:
            merged[-1] = (merged[-1][0], end, why)
        else:
            merged.append((start, end, why))
    return merged


def _check_objects(source: Store, manifest: Manifest, report: VerifyReport) -> None:
    """Items that load only with full pickle: listed, never an integrity problem (an intact
    checkpoint of an ``argparse.Namespace`` is intact; whether to run its pickle is the loader's
    decision, ``NVMeReader(allow_pickle=True)``)."""
    for fqn, _, reason in items_needing_pickle(source, manifest.chunks):
        report.needs_pickle.append(f"{fqn}: {reason}")


def _check_containers(source: Store, manifest: Manifest, files: dict[str, FileRecord],
                      report: VerifyReport, jobs: int, progress: bool, span: int) -> None:
    rows = manifest.rows_by_file()
    readable = []
    for record in files.values():
        report.files += 1
        try:
            actual = source.size(record.name)  # a regular file, or refused unopened
        except FileNotFoundError:
            report.problems.append(Problem(record.name, "missing", "the file is missing"))
            continue
        except DCPNVMeError as exc:
            report.problems.append(Problem(record.name, "missing", str(exc)))
            continue
        if actual != record.size:
            report.problems.append(Problem(record.name, "size", f"is {actual} bytes, expected {record.size}"))
        if _check_header(source, record, rows.get(record.name, []), report, actual):
            readable.append(record)
    total = sum(max(r.data_size, 0) for r in readable)
    bad: dict[str, list[tuple[int, int, str]]] = {}
    local = threading.local()
    lock = threading.Lock()
    buffer_size = max((min(max(1, span // r.checksum_block), len(r.crcs)) * r.checksum_block
                       for r in readable), default=0)
    bar = progress_bar(total, progress, "verify")

    def run(task: _Task) -> None:
        if getattr(local, "buffer", None) is None:
            local.buffer = bytearray(buffer_size)
        got, found = _check_span(source, task, local.buffer)
        with lock:
            report.bytes_read += got
            bad.setdefault(task.record.name, []).extend(found)
            bar.update(task.length)

    try:
        run_bounded(jobs, _tasks(readable, span), run, "dcp-nvme-verify")
    finally:
        bar.close()
    for name in sorted(bad):
        for start, end, why in _merge(bad[name]):
            spans = [(r.byte_offset, r.byte_offset + r.length, r.key) for r in rows.get(name, [])]
            report.problems.append(Problem(name, "data", why, start, end, items_in(spans, start, end)))
