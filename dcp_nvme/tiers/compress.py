"""Compression on the way to the mirror: the drain sends byte-grouped ``.dcz`` containers.

The local tier stays plain safetensors. With ``DrainOptions(compress="bytegroup")`` (or
``"auto"`` when it pays) each rank file is read in block-aligned windows, each window checked
against the blocks table, coded by ``tiers.codec`` on a bounded thread pool, and written to
``<checkpoint>/.drain-zip.<key>/<rank file>.dcz``, on a coder thread of its own. The drain sends
those files as it sends plain ones (pieces, journal, confirmation before ``mirrored``), each
piece as soon as it is coded (``CompressedSource.stream``): each gets a FileRecord of its own
bytes, so "confirmed" means the bytes sent are the bytes encoded. The tables are
sent unchanged (they describe the decoded files); the mirror's manifest is the local one plus a
``compression`` section (codec, version, level, per-file stored name and sizes, ratio) and its
own checksum. Coding is deterministic, so a resumed drain re-encodes the same bytes and the
target's confirmed pieces still count.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, overload

import crc32c

from dcp_nvme.config import COMPRESS_MODES
from dcp_nvme.format.manifest import SELF_CRC, Manifest, seal
from dcp_nvme.format.pieces import Piece, plan_pieces, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import create_no_follow, make_private_dir
from dcp_nvme.tiers import codec
from dcp_nvme.tiers.compress_sample import measure, pays
from dcp_nvme.tiers.delta import Base, base_bytes, note
from dcp_nvme.tiers.delta_match import FileMatch, assign_bases
from dcp_nvme.tiers.encoder import DEPTH, CodecStats, Encoder, Window, chunks_in, regions
from dcp_nvme.tiers.source import DrainSource
from dcp_nvme.tiers.transfer import DrainFault, step

log = logging.getLogger(__name__)


MODES = COMPRESS_MODES


SUFFIX = ".dcz"


SECTION = "compression"


WINDOW = 32 << 20
"""Decoded bytes read, verified and coded at a time (bounds the drain's memory)."""


def default_threads() -> int:
    """Codec threads when none are configured: half the cores, at most 2 (the training job
    keeps the rest)."""
    return max(1, min(2, (os.cpu_count() or 1) // 2))


def stored_name(name: str) -> str:
    return name + SUFFIX


def plan_file(record: FileRecord, manifest: Manifest, window: int = WINDOW,
              chunk_size: int = codec.DEFAULT_CHUNK,
              match: FileMatch | None = None) -> list[tuple[Piece, list[codec.Chunk]]]:
    """Block-aligned windows of a rank file, each with the codec chunks inside it; with a
    ``match``, each chunk of a matched item names its base bytes (a delta)."""
    spans = regions(manifest, record.name)
    items = [(o, n) for o, n, _ in spans]
    plan = []
    for piece in plan_pieces(record.size, record.data_start, record.checksum_block, window):
        chunks = chunks_in(spans, piece, chunk_size)
        plan.append((piece, assign_bases(chunks, items, match.offsets) if match and match.base else chunks))
    return plan


class _Coding:
    """One rank file being coded into the scratch directory, as far as the coder has got.

    The container's chunks follow its header and table, whose length is known before coding
    (the chunk plan) but whose bytes are not (stored lengths): the checksum blocks holding
    them (``hold``) are summed at the end; every later block is summed, from the bytes read
    back from disk, as soon as it is whole. ``known``: bytes [hold, known) are final."""

    def __init__(self, path: str, original: FileRecord, header: int) -> None:
        self.path, self.original = path, original
        self.block = original.checksum_block
        self.hold = -(-header // self.block) * self.block
        self.known = self.hold
        self.crcs: list[int] = [0] * (self.hold // self.block)  # the held blocks: placeholders
        self.record: FileRecord | None = None
        self.error: BaseException | None = None
        self.changed = threading.Condition()

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def written(self, end: int) -> None:
        """Bytes up to ``end`` are on disk: sum the blocks they complete, wake the senders."""
        whole = end - (end - self.hold) % self.block
        if whole <= self.known:
            return
        with open(self.path, "rb") as handle:
            crcs = [crc32c.crc32c(os.pread(handle.fileno(), self.block, at))
                    for at in range(self.known, whole, self.block)]
        with self.changed:
            self.crcs += crcs
            self.known = whole
            self.changed.notify_all()

    def partial(self) -> FileRecord:
        """A record of the bytes coded so far (the held blocks' crcs are not known yet)."""
        with self.changed:
            return FileRecord(self.name, self.original.rank, self.known, 0, self.block, 0, tuple(self.crcs))

    def finish(self, record: FileRecord | None, error: BaseException | None = None) -> None:
        with self.changed:
            self.record, self.error = record, error
            self.changed.notify_all()

    @overload
    def wait(self, until: None = None) -> FileRecord: ...
    @overload
    def wait(self, until: int) -> FileRecord | None: ...

    def wait(self, until: int | None = None) -> FileRecord | None:
        """Block until the file is coded (its record), or, with ``until``, until bytes up to
        there are final (None then); raises when the coder failed."""
        with self.changed:
            while (self.record is None and self.error is None
                   and (until is None or self.known < until)):
                self.changed.wait()
            if self.error is not None:
                raise self.error  # as the coder raised it: a corrupt local file stays permanent
            return self.record


class CompressedSource:
    """A DrainSource seen through the codec: what the drain sends are the coded files.

    Has what the drain uses of a DrainSource: ``location``, ``save_key``, ``manifest``
    (``file_names``: the stored names), ``files`` (records of the coded files), ``piece``,
    ``tables``, ``manifest_bytes`` (the mirror's manifest) and ``changed``. Files are coded
    on a thread of their own, in order, while the drain sends: ``stream`` hands out a file's
    pieces as they are coded; ``record``, ``files`` and ``manifest_bytes`` wait for the coder.
    """

    def __init__(self, inner: DrainSource, encoder: Encoder, *, level: int,
                 chunk_size: int = codec.DEFAULT_CHUNK, window: int | None = None, base: Base | None = None,
                 depth: int | None = None, base_why: str = "") -> None:
        self.inner = inner
        self.base = base
        self.encoder = encoder
        self.level, self.chunk_size = level, chunk_size
        self.window, self.depth = window or WINDOW, depth or DEPTH
        self.location = inner.location
        self.save_key = inner.save_key
        self.tables = inner.tables
        self.scratch = os.path.join(inner.location, f".drain-zip.{inner.save_key}")
        self.stats = CodecStats()
        make_private_dir(self.scratch)  # a link planted as the scratch directory is refused
        self._plans = {}
        self._codings: dict[str, _Coding] = {}
        self.matches: dict[str, FileMatch] = {}
        """Per rank file, what its delta is coded against (a delta drain with a base)."""
        for name in inner.manifest.file_names:
            record = inner.files[name]
            if base is not None:
                self.matches[name] = base.match(record, inner.manifest)
            plan = plan_file(record, inner.manifest, self.window, chunk_size, self.matches.get(name))
            header = codec.HEADER_SIZE + codec.ENTRY_SIZE * sum(len(cs) for _, cs in plan)
            coding = _Coding(os.path.join(self.scratch, stored_name(name)), record, header)
            self._codings[coding.name] = coding
            self._plans[coding.name] = plan
        self.manifest = _Names(list(self._codings), inner.manifest.doc)
        self.delta = note(inner.location, base, base_why, list(self.matches.values())) if base_why else None
        """The drain result's ``delta`` section (a drain that asked for a delta), else None."""
        self.names = list(self._codings)
        self.node_local = False  # node-local drains are sent plain
        self.nodes_here: list[str] = []
        self._manifest_bytes = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcp-nvme-coder", daemon=True)
        self._thread.start()

    # -- the coder thread

    def _run(self) -> None:
        started, cpu0 = time.perf_counter(), self.encoder.cpu
        try:
            for coding in self._codings.values():
                original = coding.original
                match = self.matches.get(original.name)
                base_record = match.base if match is not None else None
                coded = self._encode(coding, base_record)
                self.stats.files[original.name] = {"stored": coded.name, "size": original.size,
                                                   "stored_size": coded.size}
                if match is not None and base_record is not None:
                    self.stats.files[original.name].update(base=base_record.name, delta_bytes=match.delta_bytes)
                self.stats.bytes_in += original.size
                self.stats.bytes_out += coded.size
                coding.finish(coded)
            self.stats.seconds = time.perf_counter() - started
            self.stats.cpu_seconds = self.encoder.cpu - cpu0
            self._manifest_bytes = self._mirror_manifest()
        except BaseException as exc:  # noqa: BLE001  handed to every sender waiting on a file
            for coding in self._codings.values():
                if coding.record is None:
                    coding.finish(None, exc)
        finally:
            self.encoder.close()

    def _windows(self, coding: _Coding, base_record: FileRecord | None) -> Iterator[Window]:
        for piece, chunks in self._plans[coding.name]:
            if self._stop.is_set():
                raise DrainFault("the drain stopped while coding")
            data = self.inner.piece(coding.original, piece)  # checked against the blocks table
            bases = None
            if base_record is not None:
                assert self.base is not None  # a file matched in a base
                bases = base_bytes(self.base.source, base_record, chunks)
            yield data, chunks, piece.offset, bases

    def _encode(self, coding: _Coding, base_record: FileRecord | None) -> FileRecord:
        plan = self._plans[coding.name]
        chunks = [c for _, cs in plan for c in cs]
        lengths: list[tuple[int, int]] = []
        record = coding.original
        with step(f"compressing {record.name} into {coding.path}"):
            # a fresh file: a link (or leftover) planted under its name is removed, never followed
            with os.fdopen(create_no_follow(coding.path, os.O_WRONLY, fresh=True), "wb") as out:
                position = codec.HEADER_SIZE + codec.ENTRY_SIZE * len(chunks)
                out.seek(position)
                for coded in self.encoder.code_windows(self._windows(coding, base_record), self.depth):
                    for stored, crc in coded:
                        out.write(stored)
                        lengths.append((len(stored), crc))
                        position += len(stored)
                    out.flush()
                    coding.written(position)
                entries = codec.table_entries(chunks, lengths)  # a chunk with a base is a delta
                out.seek(0)
                out.write(codec.pack_header(entries, record.size))
                out.flush()
                os.fsync(out.fileno())
            return _record_of(coding, position)

    def _mirror_manifest(self) -> bytes:
        doc = {k: v for k, v in json.loads(self.inner.manifest_bytes).items() if k != SELF_CRC}
        doc[SECTION] = {
            "codec": codec.CODEC, "version": codec.CODEC_VERSION, "level": self.level,
            "chunk_size": self.chunk_size, "bytes": self.stats.bytes_in, "stored_bytes": self.stats.bytes_out,
            "ratio": round(self.stats.ratio, 4), "files": self.stats.files,
        }
        if self.base is not None:
            doc[SECTION]["delta"] = {"base": self.base.target, "base_save_key": self.base.source.save_key,
                                     "depth": self.base.depth + 1}
            if self.delta is not None:
                doc[SECTION]["delta"].update({k: self.delta[k] for k in ("item_bytes", "delta_bytes", "fraction")})
        return seal(doc)

    # -- what the drain reads

    def record(self, name: str) -> FileRecord | None:
        """The coded file's record once it is coded (waits for the coder)."""
        coding = self._codings.get(name)
        return coding.wait() if coding is not None else None

    @property
    def files(self) -> dict[str, FileRecord]:
        return {name: coding.wait() for name, coding in self._codings.items()}

    @property
    def manifest_bytes(self) -> bytes:
        for coding in self._codings.values():
            coding.wait()
        return self._manifest_bytes

    @property
    def failed(self) -> bool:
        return any(c.error is not None for c in self._codings.values())

    def coding(self, name: str) -> bool:
        """Whether ``name`` is still being coded (its pieces can be streamed)."""
        coding = self._codings.get(name)
        return coding is not None and coding.record is None and coding.error is None

    def opening(self, name: str) -> FileRecord:
        """A record to open a streamed file's transfer with: its final size is not known yet."""
        return replace(self._codings[name].partial(), size=0, crcs=())

    def stream(self, name: str, part_size: int) -> Iterator[tuple[FileRecord, Piece]]:
        """The pieces of a coded file as ``plan_pieces`` cuts it, each with a record that checks
        it, as soon as the coder has written them: whole parts past the held blocks while it
        codes, then, once the file is coded, the rest (the first, holding the header, and the last)."""
        coding = self._codings[name]
        part = max(coding.block, part_size - part_size % coding.block)
        index = max(1, -(-coding.hold // part))  # the first part wholly past the held blocks
        early: dict[int, Piece] = {}
        while coding.wait(until=(index + 1) * part) is None:
            early[index] = Piece(index, index * part, part)
            yield coding.partial(), early[index]
            index += 1
        record = coding.wait()
        assert record is not None
        planned = plan_pieces(record.size, record.data_start, record.checksum_block, part_size)
        for piece in planned:
            if piece.index not in early:
                yield record, piece
            elif early[piece.index] != piece:
                raise DrainFault(f"{coding.path}: piece {piece.index} was sent as {early[piece.index]}, "
                                 f"the finished file plans it as {piece}")
        if max(early, default=-1) >= len(planned):
            raise DrainFault(f"{coding.path}: pieces past the end of the finished file were sent")

    def piece(self, record: FileRecord, piece: Piece) -> bytes:
        """A piece of a coded file from the scratch directory, checked against its record."""
        path = os.path.join(self.scratch, record.name)
        with step(f"reading {path} bytes {piece.offset}-{piece.offset + piece.length}"):
            with open(path, "rb") as handle:
                data = os.pread(handle.fileno(), piece.length, piece.offset)
            if len(data) != piece.length:
                raise DrainFault(f"{path} is truncated at {piece.offset + len(data)} of {record.size} bytes")
            verify_piece(record, piece.offset, data, path)
        return data

    def changed(self) -> str | None:
        return self.inner.changed()

    def summary(self) -> dict[str, Any]:
        """What coding cost, once done: ratio, bytes, stored bytes, seconds, CPU seconds."""
        self.manifest_bytes  # noqa: B018  waits for the coder
        out: dict[str, Any] = {"ratio": self.stats.ratio, "bytes": self.stats.bytes_in, "stored_bytes": self.stats.bytes_out,
               "encode_seconds": self.stats.seconds, "cpu_seconds": self.encoder.cpu}
        if self.delta is not None:
            out["delta"] = self.delta
        return out

    def close(self) -> None:
        """Stop the coder (after a failed drain) and wait for it: nothing writes the scratch after."""
        self._stop.set()
        self._thread.join()

    def discard(self) -> None:
        """Remove the coded files (after the commit; they are only the drain's scratch)."""
        self.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


class _Names:
    """The part of a Manifest the drain loop reads: the names of the files to send."""

    def __init__(self, names: list[str], doc: dict[str, Any]) -> None:
        self.file_names, self.doc = names, doc


def _record_of(coding: _Coding, size: int) -> FileRecord:
    """The FileRecord of a coded file: the crc32c of each checksum block as read back from disk
    (what is sent and confirmed later is what was written); blocks summed while coding stand."""
    block = coding.block
    crcs = list(coding.crcs)
    with open(coding.path, "rb") as handle:
        for at in range(0, min(coding.hold, size), block):  # the header is written last
            crcs[at // block] = crc32c.crc32c(os.pread(handle.fileno(), min(block, size - at), at))
        crcs += [crc32c.crc32c(os.pread(handle.fileno(), block, at)) for at in range(coding.known, size, block)]
    if os.path.getsize(coding.path) != size:
        raise DrainFault(f"{coding.path} is {os.path.getsize(coding.path)} bytes after coding, expected {size}")
    crcs = crcs[: -(-size // block)]  # a file shorter than its held blocks
    return FileRecord(coding.name, coding.original.rank, size, 0, block, 0, tuple(crcs))


def remove_scratch(location: str, keep: str | None = None) -> None:
    """Remove coded scratch directories of a checkpoint (all, or all but save ``keep``'s)."""
    try:
        names = os.listdir(location)
    except OSError:
        return
    for name in names:
        if name.startswith(".drain-zip.") and name != f".drain-zip.{keep}":
            path = os.path.join(location, name)
            try:
                real_dir = stat.S_ISDIR(os.lstat(path).st_mode)
                if not real_dir:  # a link, FIFO or file under our name: the entry goes, never its target
                    os.unlink(path)
            except OSError:
                continue
            if real_dir:
                shutil.rmtree(path, ignore_errors=True)


def mirror_codec(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The compression section of a manifest, or None for a plain checkpoint."""
    section = doc.get(SECTION)
    return section if isinstance(section, dict) else None


SCRATCH_RESERVE = 16 << 20
"""Bytes left free on the fast tier beside a coded copy: the next save's lock and manifest."""


def scratch_shortfall(source: DrainSource) -> str | None:
    """Why the fast tier has no room for the coded copy of ``source`` (at most its plain size:
    incompressible chunks are stored raw), or None when it has."""
    needed = sum(source.files[name].size for name in source.names)
    try:
        free = shutil.disk_usage(source.location).free
    except OSError:
        return None  # cannot tell: coding fails cleanly (DrainError, scratch removed) if it must
    if free >= needed + needed // 100 + SCRATCH_RESERVE:
        return None
    return (f"{source.location}'s filesystem has {free >> 20} MiB free, and the coded copy could "
            f"take {needed >> 20} MiB of it: sent plain, not coded")


def through_codec(source: DrainSource, mode: str, *, link: float | None, threads: int,
                  level: int, base: Base | None = None,
                  base_why: str = "") -> tuple[DrainSource | CompressedSource, dict[str, Any]]:
    """The source the drain sends for ``mode``, and what was decided (for DrainResult). A
    CompressedSource codes on its own thread from here on (it owns the encoder; its
    ``summary()`` adds the figures once it is done). ``base_why``: how ``pick_base`` chose
    (a delta drain), said in the result's ``base`` and, with what was coded full, ``delta``."""
    if mode == "off":
        return source, {"mode": "off"}
    short = scratch_shortfall(source)
    if short is not None:  # the coded copy is made on the fast tier: never fill it
        log.warning("dcp_nvme: compress=%s for %s: %s", mode, source.location, short)
        info: dict[str, Any] = {"mode": mode, "decision": short}
        if mode == "delta":
            info["delta"] = note(source.location, None, short, [])
        return source, info
    encoder = Encoder(threads, level)
    try:
        info = {"mode": mode, "threads": threads, "level": level}
        if mode == "auto":
            sample = measure(source, encoder)
            go, why = pays(sample, link)
            info.update(decision=why, measured_throughput=sample.throughput, measured_ratio=sample.ratio)
            log.info("dcp_nvme: compress=auto for %s: %s", source.location, why)
            if not go:
                info["cpu_seconds"] = encoder.cpu
                encoder.close()
                return source, info
        coded = CompressedSource(source, encoder, level=level, base=base,
                                 base_why=base_why if mode == "delta" else "")
    except BaseException:
        encoder.close()
        raise
    info.update(codec=codec.CODEC)
    if base_why:
        info["base"] = base_why
    if coded.delta is not None:
        info["delta"] = coded.delta
    return coded, info
