"""Reading a compressed mirror: ranges of the original rank files, decoded from ``.dcz`` files.

A mirror drained with compression holds, per rank file, ``<rank file>.dcz`` (see
``dcp_nvme.tiers.codec``) and a manifest whose ``compression`` section names it. ``CodedFile``
serves any byte range of the original file by fetching only the stored bytes of the chunks it
overlaps (in runs of adjacent chunks, one ranged read each) and decoding them, each chunk checked
against its crc32c; a delta run reads its base's bytes under it the same way, at once.
``CodedEngine`` is the read half of the engine protocol on top of it, so ``NVMeReader`` plans,
reshards and verifies (blocks table of the original) exactly as for a plain checkpoint; one
read call fetches and decodes each chunk its requests overlap once (``_ReadPlan``).
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.requests import IOStats, ReadRequest, run_bounded
from dcp_nvme.errors import ChecksumMismatchError, ManifestError
from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.pieces import plan_pieces, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.tiers import codec

if TYPE_CHECKING:
    import torch

FETCH = 32 << 20
"""Stored bytes per ranged read of a load (at least): an object store answers a few large
ranged GETs much faster than many small ones (each pays a round trip)."""
IN_FLIGHT = 128 << 20
"""Stored bytes a load fetches at once (runs in flight x their size): bounds its memory."""
RUN_DECODED = 64 << 20
"""Decoded bytes per run (at most, or one chunk): a run's decoded chunks, and a delta run's base
bytes, are held until delivered, and a delta codes far smaller than a full checkpoint (an
unchanged tensor, to almost nothing), so the stored bound alone would not bound them."""

BASE_GAP = 1 << 20
"""Base ranges of one run at most this far apart are read as one (a few pads and small items
between two tensors cost less than another ranged read)."""

Fetch = Callable[[str, int, int], bytes]
"""(name, start, end) -> the stored bytes [start, end) of a file of the mirror."""


def store_fetch(store: Any) -> Fetch:
    """Ranged reads from a LocalStore or FsspecStore."""
    if hasattr(store, "read_range"):
        return store.read_range

    def fetch(name: str, start: int, end: int) -> bytes:
        buffer = bytearray(end - start)
        got = store.read_into(name, start, memoryview(buffer))
        return bytes(buffer[:got])

    return fetch


def coded_files(doc: dict[str, Any], location: str) -> dict[str, tuple[str, int, int, str | None]] | None:
    """original name -> (stored name, original size, stored size, base file or None) from a manifest's
    ``compression`` section; None for a plain checkpoint. Checked before any is used."""
    section = doc.get("compression")
    if section is None:
        return None
    where = f"{location}/manifest.json compression section"
    if not isinstance(section, dict) or section.get("codec") != codec.CODEC:
        raise codec.CodecError(f"{where}: unknown codec {section.get('codec') if isinstance(section, dict) else section!r}")
    if section.get("version") not in codec.READABLE_VERSIONS:
        raise codec.CodecError(f"{where}: codec version {section.get('version')!r}, this dcp_nvme reads "
                               f"{', '.join(map(str, codec.READABLE_VERSIONS))}; upgrade dcp_nvme")
    files = section.get("files")
    if not isinstance(files, dict):
        raise codec.CodecError(f"{where}: 'files' is not a mapping")
    out: dict[str, tuple[str, int, int, str | None]] = {}
    for name, info in files.items():
        stored = info.get("stored") if isinstance(info, dict) else None
        size, stored_size = (info.get(k) if isinstance(info, dict) else None for k in ("size", "stored_size"))
        if (not isinstance(stored, str) or stored != name + ".dcz" or "/" in stored
                or not isinstance(size, int) or size < 0 or not isinstance(stored_size, int) or stored_size < 0):
            raise codec.CodecError(f"{where}: entry for {name!r} is malformed: {info!r}")
        base = info.get("base")
        if base is not None and (not isinstance(base, str) or "/" in base or base.startswith(".")):
            raise codec.CodecError(f"{where}: base of {name!r} is malformed: {base!r}")
        out[name] = (stored, size, stored_size, base)
    return out


def open_base(store: Any, doc: dict[str, Any], location: str) -> Any:
    """The decoded view of the checkpoint a delta mirror is coded against (itself perhaps a
    delta: its own base is opened the same way). Refused clearly when it is missing or holds
    another save."""
    from dcp_nvme.storage.fsspec_dir import FsspecStore
    from dcp_nvme.storage.local_dir import LocalStore, is_remote_url, local_path

    delta = (doc.get("compression") or {}).get("delta")
    url, key = (delta.get("base"), delta.get("base_save_key")) if isinstance(delta, dict) else (None, None)
    if not isinstance(url, str) or not url or not isinstance(key, str):
        raise codec.CodecError(f"{location}/manifest.json: delta section is malformed: {delta!r}")
    base = FsspecStore(url, fs=store.fs) if is_remote_url(url) and hasattr(store, "fs") else LocalStore(local_path(url))
    what = (f"{location} is coded as a delta against {url} (save {key})")
    try:
        found = json.loads(base.read("manifest.json")) if base.has("manifest.json") else None
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict):
        raise codec.CodecError(f"{what}, which is missing or not committed: the delta cannot be decoded "
                               "without it; restore that mirror, or load a full checkpoint")
    if found.get("save_key") != key:
        raise codec.CodecError(f"{what}, but {url} now holds save {found.get('save_key')}: the delta "
                               "cannot be decoded; load a full checkpoint")
    return decoded_view(base)


Piece = tuple[int, "bytes | bytearray | memoryview"]
"""(file offset, decoded bytes) of a file: ranges are handed on chunk by chunk, not joined."""

BaseRead = Callable[[int, int, "IOStats | None"], Iterator[Piece]]
"""(start, end, stats) -> a delta's base file's decoded bytes [start, end) as adjacent pieces,
fetched in batched runs as a load fetches but decoded only as they are taken (so a base chunk is
decoded just before the delta chunk it is XORed into, while it is in cache), its decoding
counted in ``stats`` when the base is itself coded."""


def _base_reader(view: Any, name: str) -> BaseRead:
    def read(start: int, end: int, stats: IOStats | None = None) -> Iterator[Piece]:
        if isinstance(view, DecodedStore) and name in view.files:
            return view._coded(name).pieces(start, end, stats)
        buffer = bytearray(end - start)
        return iter([(start, memoryview(buffer)[: view.read_into(name, start, memoryview(buffer))])])

    return read


class _Cursor:
    """Walks a base's adjacent pieces in order, handing out the ranges of a run's delta chunks
    (ascending): a view of one piece when the base is chunked as its delta is, else joined."""

    def __init__(self, pieces: Iterator[Piece], name: str) -> None:
        self.pieces, self.name = pieces, name
        self.held: list[Piece] = []

    def take(self, start: int, end: int) -> bytes | memoryview:
        self.held = [(at, data) for at, data in self.held if at + len(data) > start]
        while not self.held or self.held[-1][0] + len(self.held[-1][1]) < end:
            piece = next(self.pieces, None)
            if piece is None:
                got = self.held[-1][0] + len(self.held[-1][1]) if self.held else start
                raise codec.CodecError(f"its base file {self.name} ends at {got}, before {end}")
            self.held.append(piece)
        parts = [memoryview(data)[max(0, start - at): end - at] for at, data in self.held
                 if at < end and at + len(data) > start]
        return parts[0] if len(parts) == 1 else b"".join(parts)


class CodedFile:
    """One ``.dcz`` file of a mirror: header and chunk table read once, ranges decoded on demand."""

    def __init__(self, fetch: Fetch, stored: str, size: int, stored_size: int, where: str,
                 base: BaseRead | None = None, base_name: str = "") -> None:
        self.fetch, self.stored, self.where, self.base, self.base_name = fetch, stored, where, base, base_name
        head = codec.read_header(fetch(stored, 0, codec.HEADER_SIZE), where)
        if head.size != size:
            raise codec.CodecError(f"{where} decodes to {head.size} bytes, the manifest says {size}")
        table = fetch(stored, codec.HEADER_SIZE, codec.HEADER_SIZE + head.table_size)
        self.entries = codec.parse_table(table, head.count, head.size, head.table_crc, stored_size, where,
                                         head.version)
        self.size = head.size
        if base is None and any(e.flags & codec.DELTA for e in self.entries):
            raise codec.CodecError(f"{where} holds delta chunks but the manifest names no base for it")

    def read(self, start: int, end: int, stats: IOStats | None = None) -> bytes:
        """Decoded bytes [start, end) (fewer at the end of the file), checked per chunk."""
        return b"".join(data for _, data in self.pieces(start, end, stats))

    def pieces(self, start: int, end: int, stats: IOStats | None = None) -> Iterator[Piece]:
        """Decoded bytes [start, end) (fewer at the end of the file), one piece per chunk,
        fetched in runs (``fetch_runs``: a long range is a few large ranged reads) and decoded
        as they are taken."""
        end = min(end, self.size)
        for run in fetch_runs(codec.overlapping(self.entries, start, end), FETCH):
            for entry, data in self._decoding(run, stats):
                lo = max(start, entry.offset)
                yield lo, memoryview(data)[lo - entry.offset: min(entry.length, end - entry.offset)]

    def decode_run(self, run: Sequence[codec.Entry], stats: IOStats | None = None) -> list[bytes | bytearray]:
        """The decoded bytes of consecutive chunks, fetched with one ranged read, each checked
        against its crc32c (CodecError naming the file and the chunk's decoded bytes). A delta
        run's base is fetched for the whole run at once (each base chunk decoded once). With
        ``stats``, the CPU time of the decoding alone (not the fetches) is counted there, a
        delta base's decoding included."""
        return [data for _, data in self._decoding(run, stats)]

    def _decoding(self, run: Sequence[codec.Entry],
                  stats: IOStats | None) -> Iterator[tuple[codec.Entry, bytes | bytearray]]:
        first = run[0].stored_offset
        stored = memoryview(self.fetch(self.stored, first, run[-1].stored_offset + run[-1].stored_length))
        bases = self._bases(run, stats)
        taken: dict[int, bytes | memoryview] = {}  # base bytes read ahead of their delta chunk
        for entry in run:
            lo = entry.stored_offset - first
            try:
                base = None
                if entry.flags & codec.DELTA:
                    while entry.offset not in taken:
                        at, ahead = next(bases)
                        taken[at] = ahead
                    base = taken.pop(entry.offset)
                started = time.thread_time()
                data = codec.decode_chunk(entry, stored[lo: lo + entry.stored_length], base)
                if stats is not None:
                    stats.decoded(entry.length, time.thread_time() - started)
            except codec.CodecError as exc:
                raise codec.CodecError(f"{self.where}: {exc}") from None
            yield entry, data

    def _bases(self, run: Sequence[codec.Entry], stats: IOStats | None) -> Iterator[tuple[int, bytes | memoryview]]:
        """(decoded offset, base bytes) of a run's delta chunks in the order of their base
        offsets: base ranges a little apart are read as one (``BASE_GAP``), each through a
        cursor, so a run whose tensors the base placed in another order (or elsewhere) still
        reads each base chunk once; in the usual order each comes just before its delta chunk."""
        deltas = sorted((e for e in run if e.flags & codec.DELTA), key=lambda e: (e.base_offset, e.offset))
        groups: list[list[codec.Entry]] = []
        ends: list[int] = []  # each group's last base byte
        for entry in deltas:  # a group's span stays bounded (one read of a plain base holds it all)
            if (groups and entry.base_offset <= ends[-1] + BASE_GAP
                    and max(ends[-1], entry.base_end) - groups[-1][0].base_offset <= RUN_DECODED):
                groups[-1].append(entry)
                ends[-1] = max(ends[-1], entry.base_end)
            else:
                groups.append([entry])
                ends.append(entry.base_end)
        assert self.base is not None  # only delta chunks come here; __init__ refuses them without a base
        for end, group in zip(ends, groups, strict=True):
            cursor = _Cursor(self.base(group[0].base_offset, end, stats), self.base_name)
            for entry in group:
                yield entry.offset, cursor.take(entry.base_offset, entry.base_end)


def fetch_runs(entries: Sequence[codec.Entry], limit: int) -> list[list[codec.Entry]]:
    """Chunks (sorted, unique) cut into runs that are adjacent in the file, each fetched with one
    ranged read of at most ``limit`` stored bytes and decoding to at most ``max(limit,
    RUN_DECODED)`` bytes (or one chunk): few round trips, bounded memory, and runs enough to
    decode in parallel."""
    decoded_limit = max(limit, RUN_DECODED)
    runs: list[list[codec.Entry]] = []
    size = decoded = 0
    for entry in entries:
        last = runs[-1][-1] if runs else None
        adjacent = last is not None and last.stored_offset + last.stored_length == entry.stored_offset
        if adjacent and size + entry.stored_length <= limit and decoded + entry.length <= decoded_limit:
            runs[-1].append(entry)
            size += entry.stored_length
            decoded += entry.length
        else:
            runs.append([entry])
            size, decoded = entry.stored_length, entry.length
    return runs


class _ReadPlan:
    """One engine read call of a compressed mirror: every chunk the requests overlap is fetched
    (in runs) and decoded once; a request is assembled and delivered as soon as its last chunk
    is decoded, and a chunk is dropped once every request using it is delivered."""

    def __init__(self, engine: CodedEngine, requests: Sequence[ReadRequest]) -> None:
        self.requests = list(requests)
        self.files = [engine.file(r.file) for r in self.requests]
        self.needs: list[list[codec.Entry]] = []
        self.users: dict[tuple[int, int], list[int]] = {}  # (file id, chunk offset) -> requests
        chunks: dict[int, dict[int, codec.Entry]] = {}
        for index, (request, coded) in enumerate(zip(self.requests, self.files, strict=True)):
            end = min(request.file_offset + request.length, coded.size)
            needed = codec.overlapping(coded.entries, request.file_offset, end)
            self.needs.append(needed)
            for entry in needed:
                self.users.setdefault((id(coded), entry.offset), []).append(index)
                chunks.setdefault(id(coded), {})[entry.offset] = entry
        self.waiting = [len(n) for n in self.needs]
        self.left = {key: len(users) for key, users in self.users.items()}
        by_id = {id(f): f for f in self.files}
        limit = max(engine.config.block_size, FETCH)
        self.depth = max(1, min(engine.config.queue_depth, IN_FLIGHT // limit))
        self.runs = [(by_id[key], run) for key, found in chunks.items()
                     for run in fetch_runs(sorted(found.values(), key=lambda e: e.offset), limit)]
        self.cache: dict[tuple[int, int], bytes | bytearray] = {}
        self.lock = threading.Lock()
        self.peak = 0
        """Most decoded chunks held at once (tests: the cache is bounded by the runs in flight)."""

    def empty(self) -> list[int]:
        """Requests that need no chunk (past the end of the file): delivered short at once."""
        return [i for i, n in enumerate(self.needs) if not n]

    def run(self, coded: CodedFile, run: list[codec.Entry], stats: IOStats) -> list[int]:
        """Fetch and decode one run (its decoding counted in ``stats``); the requests it completes."""
        decoded = coded.decode_run(run, stats)
        ready = []
        with self.lock:
            for entry, data in zip(run, decoded, strict=True):
                key = (id(coded), entry.offset)
                self.cache[key] = data
                for index in self.users[key]:
                    self.waiting[index] -= 1
                    if self.waiting[index] == 0:
                        ready.append(index)
            self.peak = max(self.peak, len(self.cache))
        return ready

    def assemble(self, index: int) -> bytes:
        """A request's decoded bytes from the cached chunks; chunks no request still needs go."""
        request, coded = self.requests[index], self.files[index]
        start, end = request.file_offset, min(request.file_offset + request.length, coded.size)
        keys = [(id(coded), e.offset) for e in self.needs[index]]
        with self.lock:
            parts = [self.cache[k] for k in keys]
        out = b"".join(memoryview(data)[max(0, start - e.offset): min(e.length, end - e.offset)]
                       for e, data in zip(self.needs[index], parts, strict=True))
        with self.lock:
            for key in keys:
                self.left[key] -= 1
                if not self.left[key]:
                    del self.cache[key]
        return out


class CodedEngine:
    """Ranged reads of a compressed mirror into destination tensors, ``queue_depth`` at a time;
    each request's decoded bytes are checked against the original's blocks before use."""

    name = "dcz"

    def __init__(self, fetch: Fetch, paths: dict[str, tuple[str, int, int, str | None]], location: str,
                 config: IOConfig, base: Callable[[], Any] | None = None) -> None:
        self.fetch, self.paths, self.location, self.config = fetch, paths, location, config
        self.base = base
        self._files: dict[str, CodedFile] = {}
        self._lock = threading.Lock()
        self.last_peak = 0
        """Most decoded chunks the last read held at once."""

    def file(self, path: str) -> CodedFile:
        with self._lock:
            opened = self._files.get(path)
        if opened is None:
            stored, size, stored_size, base = self.paths[os.path.normpath(path)]
            where = f"{self.location}/{stored}"
            reader = _base_reader(self.base(), base) if base and self.base else None
            opened = CodedFile(self.fetch, stored, size, stored_size, where, reader, base or "")
            with self._lock:
                self._files[path] = opened
        return opened

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats:
        from dcp_nvme.engines.fsspec import deliver

        stats = IOStats("read")
        started = time.perf_counter()
        plan = _ReadPlan(self, requests)

        def give(index: int) -> None:
            begun = stats.begin()
            data = plan.assemble(index)
            stats.end(begun, len(data), len(data))
            deliver(plan.requests[index], data, dests)  # length, then the original's blocks

        for index in plan.empty():
            give(index)

        def run(task: tuple[CodedFile, list[codec.Entry]]) -> None:
            for index in plan.run(*task, stats):
                give(index)

        run_bounded(plan.depth, plan.runs, run, "dcp-nvme-dcz")
        self.last_peak = plan.peak
        stats.seconds = time.perf_counter() - started
        return stats

    def write_file(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("a compressed mirror is written by the drain, not by NVMeWriter")

    def close(self) -> None:
        pass


def decoded_store(store: Any, manifest: Manifest, location: str) -> Any:
    """A compressed mirror's store as the plain checkpoint it holds (``seams.decoded_store``)."""
    files = coded_files(manifest.doc, location)
    return store if files is None else DecodedStore(store, files, manifest.doc)


_ENGINES: weakref.WeakKeyDictionary[Manifest, CodedEngine] = weakref.WeakKeyDictionary()
"""Each manifest's engine, kept as long as the manifest (its other parsed tables live as long)."""


def coded_engine(store: Any, manifest: Manifest, location: str, config: IOConfig) -> CodedEngine | None:
    """The engine for a compressed mirror (one per manifest, tables cached), else None."""
    files = coded_files(manifest.doc, location)
    if files is None:
        return None
    engine = _ENGINES.get(manifest)
    if engine is None:
        paths = {os.path.normpath(store.path(name)): info for name, info in files.items()}
        engine = CodedEngine(store_fetch(store), paths, location, config, _lazy_base(store, manifest.doc, location))
        _ENGINES[manifest] = engine
    return engine


def same_save(remote: bytes, local: bytes) -> bool:
    """Whether a mirror's manifest is the local one plus a compression section."""
    try:
        theirs, ours = json.loads(remote), json.loads(local)
    except ValueError:
        return False
    if not isinstance(theirs, dict) or not isinstance(ours, dict) or "compression" not in theirs:
        return False
    strip = ("compression", "manifest_crc32c")
    return {k: v for k, v in theirs.items() if k not in strip} == {k: v for k, v in ours.items() if k not in strip}


def readback_coded(store: Any, location: str, records: dict[str, FileRecord], window: int) -> int:
    """Decode every chunk of a compressed mirror (its delta base chain too) and check the result
    against the original's blocks table (ChecksumMismatchError / CodecError naming the file);
    returns the bytes checked."""
    view = decoded_view(store)
    if not isinstance(view, DecodedStore):
        raise codec.CodecError(f"{location} is not a compressed mirror")
    checked = 0
    for name, (stored, size, _, _) in view.files.items():
        record = records.get(name)
        where = f"{location}/{stored}"
        if record is None or record.size != size:
            raise codec.CodecError(f"{where}: not a file of this save (or of another size)")
        coded = view._coded(name)
        for piece in plan_pieces(size, record.data_start, record.checksum_block, window):
            data = coded.read(piece.offset, piece.offset + piece.length)
            if len(data) != piece.length:
                raise codec.CodecError(f"{where}: decodes short at {piece.offset + len(data)}")
            verify_piece(record, piece.offset, data, where)
        checked += size
    return checked


class DecodedStore:
    """A compressed mirror seen as the plain checkpoint it encodes: the tools (verify, list,
    export) read rank files by their original names and get decoded, chunk-checked bytes."""

    def __init__(self, store: Any, files: dict[str, tuple[str, int, int, str | None]],
                 doc: dict[str, Any] | None = None) -> None:
        self.inner, self.files, self.location = store, files, store.location
        self._base = _lazy_base(store, doc or {}, store.location)
        self._fetch = store_fetch(store)
        self._open: dict[str, CodedFile] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # path, make, write_atomic... as the store's
        return getattr(self.inner, name)

    def _coded(self, name: str) -> CodedFile:
        with self._lock:
            opened = self._open.get(name)
        if opened is None:
            stored, size, stored_size, base = self.files[name]
            where = f"{self.location}/{stored}"
            opened = CodedFile(self._fetch, stored, size, stored_size, where,
                               _base_reader(self._base(), base) if base else None, base or "")
            with self._lock:
                self._open[name] = opened
        return opened

    def exists(self) -> bool:
        return self.inner.exists()

    def has(self, name: str) -> bool:
        return self.inner.has(self.files[name][0]) if name in self.files else self.inner.has(name)

    def names(self) -> list[str]:
        stored = {info[0]: name for name, info in self.files.items()}
        return sorted(stored.get(n, n) for n in self.inner.names())

    def size(self, name: str) -> int:
        return self._coded(name).size if name in self.files else self.inner.size(name)

    def read(self, name: str, max_size: int | None = None) -> bytes:
        if name not in self.files:
            return self.inner.read(name, max_size)
        coded = self._coded(name)
        if max_size is not None and coded.size > max_size:
            raise ManifestError(f"{self.location}/{name} decodes to {coded.size} bytes, over the "
                                f"{max_size} allowed for it")
        return coded.read(0, coded.size)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        if name not in self.files:
            return self.inner.read_into(name, offset, buffer)
        data = self._coded(name).read(offset, offset + len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def read_into_checked(self, name: str, offset: int, buffer: memoryview) -> tuple[int, list[tuple[int, int, str]]]:
        """``read_into`` that does not stop at a damaged chunk (verify's read): returns the bytes
        read and the damaged ``(start, end, why)`` ranges, in decoded offsets of ``name``, one per
        chunk that fails to decode or to match its crc32c (its bytes are left zero, ``why`` names
        the ``.dcz`` file and the chunk); every other chunk of the range is still decoded."""
        if name not in self.files:
            return self.inner.read_into(name, offset, buffer), []
        try:
            return self.read_into(name, offset, buffer), []
        except (codec.CodecError, ChecksumMismatchError):
            pass  # decoded again chunk by chunk, to tell the damaged ones from the rest
        coded = self._coded(name)
        end = min(offset + len(buffer), coded.size)
        damaged: list[tuple[int, int, str]] = []
        for entry in codec.overlapping(coded.entries, offset, end):
            lo, hi = max(offset, entry.offset), min(end, entry.end)
            try:
                data = coded.read(lo, hi)
                buffer[lo - offset: lo - offset + len(data)] = data
            except (codec.CodecError, ChecksumMismatchError) as exc:
                buffer[lo - offset: hi - offset] = bytes(hi - lo)
                damaged.append((lo, hi, f"chunk [{entry.offset}, {entry.end}) cannot be decoded: {exc}"))
        return max(end - offset, 0), damaged


def decoded_view(store: Any) -> Any:
    """``store`` itself for a plain checkpoint, a DecodedStore for a compressed mirror (a
    missing or unreadable manifest is left for the caller to report)."""
    try:
        doc = json.loads(store.read("manifest.json")) if store.has("manifest.json") else None
    except (OSError, ValueError):
        return store
    files = coded_files(doc, store.location) if isinstance(doc, dict) else None
    return store if files is None else DecodedStore(store, files, doc)


def _lazy_base(store: Any, doc: dict[str, Any], location: str) -> Callable[[], Any]:
    """Opens the delta base on first need (a full mirror never touches it)."""
    opened: list[Any] = []
    lock = threading.Lock()

    def get() -> Any:
        with lock:
            if not opened:
                opened.append(open_base(store, doc, location))
            return opened[0]

    return get


def describe_compression(location: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """One line on a compressed mirror (codec, version, ratio, sizes), or None if plain."""
    from dcp_nvme.storage.fsspec_dir import open_store

    store = open_store(location, storage_options)
    try:
        doc = json.loads(store.read("manifest.json"))
    except (OSError, ValueError):
        return None
    section = doc.get("compression") if isinstance(doc, dict) else None
    if not isinstance(section, dict):
        return None
    line = (f"{section.get('codec')} v{section.get('version')}, level {section.get('level')}: "
            f"{section.get('bytes')} -> {section.get('stored_bytes')} bytes ({section.get('ratio')}x)")
    delta = section.get("delta")
    if isinstance(delta, dict):
        fraction = delta.get("fraction")
        share = (f"{fraction * 100:.1f}% of the items' bytes delta-coded" if isinstance(fraction, (int, float))
                 else "delta-coded")
        line += f"; {share} against {delta.get('base')} (chain depth {delta.get('depth')})"
    return line
