"""``verify``: read every byte of a checkpoint and check every checksum and cross-reference.

Checked: the manifest parses and its two tables match their recorded size and crc32c; the
tables agree with the manifest and with each other; each container has the recorded size, its
header bytes match ``header_crc``, its safetensors header parses and places every item exactly
where the index says; every ``checksum_block`` of every data region matches its crc32c. Every
problem is collected (not just the first), with the file, byte range and items it hits.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c

from ..checksums import checks_within, host_crcs, items_in, mismatches
from ..concurrency import run_bounded
from ..display import progress_bar
from ..errors import CheckpointNotCommittedError, CheckpointNotFoundError, ManifestError, TableError
from ..manifest import (
    MANIFEST,
    ChunkRecord,
    FileRecord,
    Manifest,
    parse_dtype,
    read_files,
    read_manifest,
    save_key_of,
)
from ..objects import items_needing_pickle
from ..remote import open_store
from ..store import Store
from ..tiers.coded import decoded_view
from .st_format import ST_ITEMSIZE, parse_header

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
) -> VerifyReport:
    """Verify a checkpoint (local path or fsspec URL). ``report.ok`` only when all is intact.

    Raises CheckpointNotFoundError when the path is missing or holds no dcp_nvme checkpoint at
    all; an unfinished or damaged checkpoint is a report with problems, not an exception.
    A non-tensor item that only full pickle can load is a problem unless ``allow_pickle``;
    either way it is listed in ``report.needs_pickle``.
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    source = decoded_view(open_store(location))  # a compressed mirror reads as its plain files
    report = VerifyReport(source.location)
    started = time.perf_counter()
    manifest = _manifest(source, report)
    if manifest is not None:
        files = _files(source, manifest, report)
        if files is not None:
            _check_tables(manifest, files, report)
            _check_containers(source, manifest, files, report, jobs, progress, span)
        _check_objects(source, manifest, report, allow_pickle)
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
    """The manifest, the index and the blocks table must tell the same story."""
    doc = manifest.doc
    index_name = doc["index"].get("name", "index")
    listed = {f.get("name"): f for f in doc.get("files", []) if isinstance(f, dict)}
    for name in sorted(set(listed) | set(files)):
        if name not in files:
            report.problems.append(Problem(name, "blocks", f"listed in {MANIFEST} but not in the blocks table"))
        elif name not in listed:
            report.problems.append(Problem(name, "manifest", f"in the blocks table but not listed in {MANIFEST}"))
        else:
            record, entry = files[name], listed[name]
            if entry.get("size") != record.size or entry.get("rank") != record.rank:
                report.problems.append(Problem(name, "manifest", (
                    f"{MANIFEST} says rank {entry.get('rank')}, {entry.get('size')} bytes; the blocks "
                    f"table says rank {record.rank}, {record.size} bytes")))
    if doc.get("total_bytes") != sum(f.size for f in files.values()):
        report.problems.append(Problem(MANIFEST, "manifest", (
            f"total_bytes {doc.get('total_bytes')} differs from the sum of file sizes "
            f"{sum(f.size for f in files.values())}")))
    key = doc.get("save_key")
    tables = [doc["index"].get("name"), doc["blocks"].get("name")]
    for name in [*files, *tables]:
        if save_key_of(name or "") != key:
            report.problems.append(Problem(MANIFEST, "manifest", f"save_key {key!r} does not match file {name}"))
    world = doc.get("world_size")
    if not isinstance(world, int) or any(not 0 <= f.rank < world for f in files.values()):
        report.problems.append(Problem(MANIFEST, "manifest", f"world_size {world!r} does not cover the files' ranks"))
    for record in files.values():
        expected = math.ceil(record.data_size / record.checksum_block) if record.checksum_block > 0 else -1
        if record.data_size < 0 or len(record.crcs) != expected:
            report.problems.append(Problem(record.name, "blocks", (
                f"the blocks table has {len(record.crcs)} checksums for a {record.data_size}-byte data "
                f"region in blocks of {record.checksum_block}")))
    for chunk in manifest.chunks:
        message = _chunk_problem(chunk, files)
        if message:
            report.problems.append(Problem(index_name, "index", f"row {chunk.key!r} of {chunk.fqn}: {message}"))


def _chunk_problem(chunk: ChunkRecord, files: dict[str, FileRecord]) -> str:
    record = files.get(chunk.file)
    if record is None:
        return f"names file {chunk.file!r}, which the checkpoint does not have"
    if chunk.byte_offset < record.data_start or chunk.byte_offset + chunk.length > record.size:
        return (f"bytes [{chunk.byte_offset}, {chunk.byte_offset + chunk.length}) are outside the data "
                f"region [{record.data_start}, {record.size}) of {chunk.file}")
    if chunk.kind == "bytes":
        return ""
    if chunk.kind != "tensor":
        return f"unknown kind {chunk.kind!r}"
    try:
        itemsize = parse_dtype(chunk.dtype).itemsize
    except Exception as exc:
        return str(exc)
    dims = (len(chunk.offsets), len(chunk.sizes), len(chunk.global_shape))
    if len(set(dims)) != 1:
        return f"offsets/sizes/shape have different ranks {dims}"
    if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, chunk.global_shape)):
        return f"chunk at {chunk.offsets} of size {chunk.sizes} lies outside the shape {chunk.global_shape}"
    if math.prod(chunk.sizes) * itemsize != chunk.length:
        return f"length {chunk.length} is not {chunk.sizes} x {itemsize} bytes"
    return ""


# --------------------------------------------------------------------------- containers


def _rows_by_file(manifest: Manifest) -> dict[str, list[ChunkRecord]]:
    rows: dict[str, list[ChunkRecord]] = {}
    for chunk in manifest.chunks:
        rows.setdefault(chunk.file, []).append(chunk)
    return rows


def _check_header(source: Store, record: FileRecord, rows: list[ChunkRecord], report: VerifyReport) -> bool:
    """Header crc, safetensors parse, and agreement with the index; False when unreadable."""
    prefix = bytearray(record.data_start)
    got = source.read_into(record.name, 0, memoryview(prefix))
    report.bytes_read += got
    if got < record.data_start:
        report.problems.append(Problem(record.name, "size", f"ends at byte {got}, inside its header"))
        return False
    if crc32c.crc32c(prefix) != record.header_crc:
        report.problems.append(Problem(record.name, "header", "header bytes do not match their crc32c",
                                       0, record.data_start))
    try:
        header, data_start = parse_header(bytes(prefix), record.name)
    except ValueError as exc:
        report.problems.append(Problem(record.name, "header", str(exc), 0, record.data_start))
        return True
    if data_start != record.data_start:
        report.problems.append(Problem(record.name, "header", (
            f"the safetensors header puts the data at byte {data_start}, the blocks table at "
            f"{record.data_start}"), 0, record.data_start))
        return True
    for message in header_mismatches(header, rows, record.data_start):
        report.problems.append(Problem(record.name, "layout", message, 0, record.data_start))
    return True


def header_mismatches(header: dict[str, Any], rows: list[ChunkRecord], data_start: int) -> list[str]:
    """Where a container's safetensors header and the index disagree (pure)."""
    problems = []
    items = {k: v for k, v in header.items() if k != "__metadata__"}
    keys = {r.key for r in rows}
    extra, missing = sorted(set(items) - keys), sorted(keys - set(items))
    if extra:
        problems.append(f"the safetensors header has item(s) the index lacks: {extra[:5]}")
    if missing:
        problems.append(f"the index has item(s) the safetensors header lacks: {missing[:5]}")
    for row in rows:
        entry = items.get(row.key)
        if not isinstance(entry, dict):
            continue
        try:
            start, end = (int(x) for x in entry["data_offsets"])
            itemsize = ST_ITEMSIZE[entry["dtype"]]
            count = math.prod(int(n) for n in entry["shape"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"item {row.key!r} has a malformed safetensors entry {entry!r}")
            continue
        if (data_start + start, end - start) != (row.byte_offset, row.length):
            problems.append(f"item {row.key!r}: the safetensors header says bytes "
                            f"[{data_start + start}, {data_start + end}), the index "
                            f"[{row.byte_offset}, {row.byte_offset + row.length})")
        elif count * itemsize != row.length:
            problems.append(f"item {row.key!r}: dtype {entry['dtype']} x shape {entry['shape']} is not "
                            f"{row.length} bytes")
    return problems


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
    got = source.read_into(record.name, task.start, view)
    checks = checks_within(record, task.start, task.start + length)
    bad = [(task.start + rel, task.start + rel + n, "unreadable: the file ends before this block")
           for rel, n, _ in checks if rel + n > got]
    readable = checks[: len(checks) - len(bad)]
    bad += [(task.start + rel, task.start + rel + n, "data does not match its crc32c")
            for (rel, n, _), _ in mismatches(readable, host_crcs([view], readable))]
    return got, bad


def _merge(ranges: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    merged: list[tuple[int, int, str]] = []
    for start, end, why in sorted(ranges):
        if merged and merged[-1][1] == start and merged[-1][2] == why:
            merged[-1] = (merged[-1][0], end, why)
        else:
            merged.append((start, end, why))
    return merged


def _check_objects(source: Store, manifest: Manifest, report: VerifyReport, allow_pickle: bool) -> None:
    for fqn, name, reason in items_needing_pickle(source, manifest.chunks):
        report.needs_pickle.append(f"{fqn}: {reason}")
        if not allow_pickle:
            report.problems.append(Problem(name, "pickle", f"non-tensor item {fqn!r} loads only with "
                                           f"allow_pickle=True, which would run code ({reason})", items=(fqn,)))


def _check_containers(source: Store, manifest: Manifest, files: dict[str, FileRecord],
                      report: VerifyReport, jobs: int, progress: bool, span: int) -> None:
    rows = _rows_by_file(manifest)
    readable = []
    for record in files.values():
        report.files += 1
        if not source.has(record.name):
            report.problems.append(Problem(record.name, "missing", "the file is missing"))
            continue
        actual = source.size(record.name)
        if actual != record.size:
            report.problems.append(Problem(record.name, "size", f"is {actual} bytes, expected {record.size}"))
        if len(record.crcs) != math.ceil(max(record.data_size, 0) / max(record.checksum_block, 1)):
            continue  # already reported: its blocks cannot be checked
        if _check_header(source, record, rows.get(record.name, []), report):
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
