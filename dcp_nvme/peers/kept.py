"""What a restore on many ranks keeps of what came: the ranges of other nodes' files it fetched
for this node, on disk in ``.ranges/`` for the next load (``KeptRanges``, ``keep_spans``,
``kept_file``), and the bytes that came to this rank, held in memory for this load
(``ReceivedBytes``). The copies ``save.copies`` wrote are found by ``format.copies``."""

from __future__ import annotations

import bisect
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Iterable, Mapping

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.container import RANGES_DIR, SPANS_SUFFIX
from dcp_nvme.format.pieces import Span
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import create_no_follow, fsync_dir, open_regular, read_regular, write_file_fresh

log = logging.getLogger(__name__)


MAX_SPANS_RECORD = 16 << 20
"""A ranges record larger than this is not read (it would be damaged or planted)."""


class KeptRanges:
    """The ranges of other nodes' files this node keeps, read once per load.

    A restore keeps what it fetched for this node's ranks (``peers.exchange``): ``.ranges/<file>``
    is a sparse file at the container's size that holds only those ranges, and ``<file>.spans``
    lists them, written after the data is fsynced. The next load on this node reads a chunk
    there when one of its places lies inside a kept range, so a replacement node fetches once.
    Every byte read there is still checked against the blocks table; a record that does not
    fit its file (another save's, damaged, planted) is ignored with a warning."""

    def __init__(self, directory: str, files: Mapping[str, FileRecord]) -> None:
        self.root = os.path.join(directory, RANGES_DIR)
        self.spans: dict[str, list[tuple[int, int]]] = {}
        try:
            entries = os.listdir(self.root) if stat.S_ISDIR(os.lstat(self.root).st_mode) else []
        except OSError:
            entries = []
        for entry in sorted(entries):
            record = files.get(entry[: -len(SPANS_SUFFIX)]) if entry.endswith(SPANS_SUFFIX) else None
            if record is None:
                continue
            try:
                self.spans[record.name] = read_spans(self.root, record)
            except (ManifestError, OSError) as exc:
                log.warning("dcp_nvme: %s: the kept ranges of %s are not used: %s", directory, record.name, exc)

    def path(self, name: str) -> str | None:
        """Where the kept ranges of ``name`` are, if this node keeps any."""
        return os.path.join(self.root, name) if self.spans.get(name) else None

    def covers(self, span: Span) -> bool:
        return any(start <= span.start and span.end <= end for start, end in self.spans.get(span.file, ()))


def read_spans(root: str, record: FileRecord) -> list[tuple[int, int]]:
    """The kept ranges of ``record``'s file, checked as input: the data file is a regular file of
    the container's size, the spans lie inside it, sorted, apart."""
    where = os.path.join(root, record.name + SPANS_SUFFIX)
    try:
        doc = json.loads(read_regular(where, MAX_SPANS_RECORD))
    except ValueError as exc:
        raise ManifestError(f"{where} is not JSON: {exc}") from None
    if os.lstat(os.path.join(root, record.name)).st_size != record.size or not isinstance(doc, dict) \
            or doc.get("size") != record.size or not isinstance(doc.get("spans"), list):
        raise ManifestError(f"{where} does not describe {record.name} ({record.size} bytes)")
    out: list[tuple[int, int]] = []
    for pair in doc["spans"]:
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair)
                and (out[-1][1] if out else 0) <= pair[0] < pair[1] <= record.size):
            raise ManifestError(f"{where}: span {pair!r} is not a sorted range inside the file")
        out.append((pair[0], pair[1]))
    return out


def keep_spans(directory: str, record: FileRecord, spans: Iterable[tuple[int, int]]) -> None:
    """Record that ``spans`` of ``record``'s file arrived checked in ``.ranges/`` (merged with
    what is kept already): the data is fsynced first, the record renamed into place after."""
    root = os.path.join(directory, RANGES_DIR)
    try:
        held = read_spans(root, record)
    except (ManifestError, OSError):
        held = []
    merged: list[tuple[int, int]] = []
    for start, end in sorted([*held, *spans]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    fd = open_regular(os.path.join(root, record.name))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    temp = os.path.join(root, f".{record.name}{SPANS_SUFFIX}.tmp-{secrets.token_hex(4)}")
    write_file_fresh(temp, json.dumps({"size": record.size, "spans": [list(s) for s in merged]}).encode())
    os.replace(temp, os.path.join(root, record.name + SPANS_SUFFIX))
    fsync_dir(root)


def kept_file(directory: str, record: FileRecord) -> str:
    """``.ranges/<file>``, made when absent: a sparse file at the container's size."""
    root = os.path.join(directory, RANGES_DIR)
    os.makedirs(root, mode=0o700, exist_ok=True)
    if not stat.S_ISDIR(os.lstat(root).st_mode):
        raise ManifestError(f"{root} is not a directory; remove it")
    target = os.path.join(root, record.name)
    fd = create_no_follow(target, os.O_WRONLY, 0o600)
    try:
        if os.fstat(fd).st_size != record.size:
            os.ftruncate(fd, record.size)
    finally:
        os.close(fd)
    return target


class ReceivedBytes:
    """Checked bytes a restore received, held in memory up to ``budget`` bytes, so that the same
    load copies them into its tensors instead of reading back what it just wrote (and checking
    it a second time). The rest is read from the kept copy on disk as usual."""

    def __init__(self, budget: int) -> None:
        self.budget, self.size = budget, 0
        self._starts: dict[str, list[int]] = {}
        self._pieces: dict[str, list[memoryview]] = {}
        self._lock = threading.Condition()
        self._ended = False

    def add(self, name: str, start: int, data: memoryview) -> None:
        """Hold ``data`` (already checked against the blocks table), the bytes at ``start`` of file
        ``name``; nothing is held once the budget is spent."""
        with self._lock:
            if self.size + len(data) > self.budget:
                return
            starts = self._starts.setdefault(name, [])
            at = bisect.bisect(starts, start)
            starts.insert(at, start)
            self._pieces.setdefault(name, []).insert(at, data)
            self.size += len(data)
            self._lock.notify_all()

    def wait_beyond(self, held: int, timeout: float) -> int:
        """Wait at most ``timeout`` seconds for more than ``held`` bytes to be held, or for a
        ``wake``; the bytes held."""
        with self._lock:
            self._lock.wait_for(lambda: self.size > held or self._ended, timeout)
            return self.size

    def wake(self) -> None:
        """Nothing more will come: ``wait_beyond`` returns at once from now on."""
        with self._lock:
            self._ended = True
            self._lock.notify_all()

    def take(self, name: str, start: int, length: int) -> list[memoryview] | None:
        """The held bytes ``[start, start + length)`` of ``name`` as consecutive views, or None
        when some of them are not held."""
        out, at, end = [], start, start + length
        with self._lock:
            starts, pieces = self._starts.get(name, []), self._pieces.get(name, [])
            while at < end:
                index = bisect.bisect(starts, at) - 1
                if index < 0 or starts[index] + len(pieces[index]) <= at:
                    return None
                offset = at - starts[index]
                view = pieces[index][offset: offset + end - at]
                out.append(view)
                at += len(view)
        return out
