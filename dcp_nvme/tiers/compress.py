"""Compression on the way to the mirror: the drain sends byte-grouped ``.dcz`` containers.

The local tier stays plain safetensors. With ``DrainOptions(compress="bytegroup")`` (or
``"auto"`` when it pays) each rank file is read in block-aligned windows, each window checked
against the blocks table, coded by ``dcp_nvme.codec`` on a bounded thread pool, and written to
``<checkpoint>/.drain-zip.<key>/<rank file>.dcz``. The drain then sends those files exactly as
it sends plain ones (pieces, journal, confirmation before ``mirrored``): each gets a FileRecord
of its own bytes, so "confirmed" means the bytes sent are the bytes encoded. The tables are
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c

from .. import codec
from ..manifest import SELF_CRC, FileRecord, Manifest, seal
from .source import DrainSource
from .transfer import DrainFault, Piece, plan_pieces, step, verify_piece

log = logging.getLogger(__name__)

MODES = ("off", "auto", "bytegroup", "delta")
SUFFIX = ".dcz"
SECTION = "compression"
WINDOW = 32 << 20
"""Decoded bytes read, verified and coded at a time (bounds the drain's memory)."""
SAMPLE = 8 << 20
"""Bytes ``auto`` codes to measure the codec on this machine."""


def default_threads() -> int:
    """Codec threads when none are configured: half the cores, at most 2 (the training job
    keeps the rest)."""
    return max(1, min(2, (os.cpu_count() or 1) // 2))


def stored_name(name: str) -> str:
    return name + SUFFIX


@dataclass(frozen=True)
class Measure:
    """The codec on a sample of this checkpoint: decoded bytes per second and ratio."""

    throughput: float
    ratio: float


def pays(measure: Measure, link: float | None) -> tuple[bool, str]:
    """Whether coding a file before sending it finishes sooner than sending it plain.

    The drain codes a file, then sends it: time per byte 1/E + 1/(r*L) against 1/L plain
    (E codec throughput, r ratio, L the link's bytes/s: the bandwidth cap or ``link_rate``).
    Without a known link the drain sends plain (say ``compress="bytegroup"`` to force it).
    """
    figures = f"codec {measure.throughput / 1e6:.0f} MB/s at {measure.ratio:.2f}x"
    if not link:
        return False, f"{figures}; link speed unknown (set bandwidth or link_rate): sending plain"
    coded = 1 / measure.throughput + 1 / (measure.ratio * link)
    if coded < 1 / link:
        return True, f"{figures} beats the {link / 1e6:.0f} MB/s link ({1 / link / coded:.2f}x sooner)"
    return False, f"{figures} does not beat the {link / 1e6:.0f} MB/s link: sending plain"


def regions(manifest: Manifest, name: str) -> list[tuple[int, int, str | None]]:
    """(offset, length, dtype) of each tensor in one rank file; non-tensor items are plain."""
    return [(c.byte_offset, c.length, c.dtype if c.kind == "tensor" else None)
            for c in manifest.chunks if c.file == name]


def plan_file(record: FileRecord, manifest: Manifest, window: int = WINDOW,
              chunk_size: int = codec.DEFAULT_CHUNK) -> list[tuple[Piece, list[codec.Chunk]]]:
    """Block-aligned windows of a rank file, each with the codec chunks inside it."""
    spans = regions(manifest, record.name)
    plan = []
    for piece in plan_pieces(record.size, record.data_start, record.checksum_block, window):
        lo, hi = piece.offset, piece.offset + piece.length
        clipped = [(max(o, lo) - lo, min(o + n, hi) - max(o, lo), d) for o, n, d in spans
                   if o < hi and o + n > lo]
        chunks = codec.plan_chunks(piece.length, clipped, chunk_size)
        plan.append((piece, [codec.Chunk(c.offset + lo, c.length, c.planes) for c in chunks]))
    return plan


@dataclass
class CodecStats:
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of the codec threads (thread time: the training job's threads are not counted)."""
    files: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 1.0


class Encoder:
    """A bounded pool of codec threads, its CPU time counted."""

    def __init__(self, threads: int, level: int) -> None:
        self.level = level
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="dcp-nvme-codec")
        self.cpu = 0.0
        self._lock = threading.Lock()

    def code(self, data: bytes, chunks: list[codec.Chunk], origin: int,
             base: bytes | None = None) -> list[tuple[bytes, int]]:
        view = memoryview(data)
        basis = memoryview(base) if base is not None else None

        def one(chunk: codec.Chunk) -> tuple[bytes, int]:
            started = time.thread_time()
            lo, hi = chunk.offset - origin, chunk.offset - origin + chunk.length
            piece = view[lo:hi]
            out = (codec.encode_chunk(piece, chunk.planes, self.level, basis[lo:hi] if basis is not None else None),
                   crc32c.crc32c(piece))
            with self._lock:
                self.cpu += time.thread_time() - started
            return out

        return list(self.pool.map(one, chunks))

    def close(self) -> None:
        self.pool.shutdown()


def measure(source: DrainSource, encoder: Encoder, sample: int = SAMPLE) -> Measure:
    """Code up to ``sample`` bytes of the checkpoint's largest file; wall-clock throughput."""
    record = max(source.files.values(), key=lambda r: r.size)
    piece, chunks = plan_file(record, source.manifest, window=max(sample, record.checksum_block))[0]
    data = source.piece(record, piece)
    started = time.perf_counter()
    coded = encoder.code(data, chunks, piece.offset)
    seconds = max(time.perf_counter() - started, 1e-9)
    stored = sum(len(s) for s, _ in coded) or 1
    return Measure(len(data) / seconds, len(data) / stored)


@dataclass
class Base:
    """An earlier checkpoint of the same run a delta is coded against: its local copy (read,
    checked) and the mirror it is committed on (where a reader finds it)."""

    source: DrainSource
    target: str
    depth: int
    """Deltas between the base and its nearest full checkpoint (0: the base is full)."""

    def match(self, record: FileRecord, manifest: Manifest) -> FileRecord | None:
        """The base's file of the same rank when its layout is the same (else code it full)."""
        for name, candidate in self.source.files.items():
            if (candidate.rank == record.rank and candidate.size == record.size
                    and candidate.data_start == record.data_start
                    and candidate.checksum_block == record.checksum_block
                    and _layout(self.source.manifest, name) == _layout(manifest, record.name)):
                return candidate
        return None


def _layout(manifest: Manifest, name: str) -> list[tuple[str, int, int, str]]:
    return sorted((c.fqn, c.byte_offset, c.length, c.dtype) for c in manifest.chunks if c.file == name)


def pick_base(location: str, target: str, every: int, mirror_manifest: Any) -> tuple[Base | None, str]:
    """The newest older checkpoint of the run directory that is mirrored (and still local), or
    None (code full) with the reason. A chain reaching ``every`` - 1 deltas starts over full.
    ``mirror_manifest(url)`` returns the parsed manifest committed at a mirror URL, or None."""
    from ..rundir import checkpoints
    from .state import MIRRORED, drain_state

    here = os.path.realpath(location)
    older = []
    for entry in checkpoints(os.path.dirname(here), kinds=("nvme",)):
        if os.path.realpath(entry.path) == here:
            break
        older.append(entry)
    for entry in reversed(older):
        state = drain_state(entry.path)
        if state.state != MIRRORED or not state.target or state.target == target:
            continue
        doc = mirror_manifest(state.target)
        if not isinstance(doc, dict):
            return None, f"the mirror of {entry.path} ({state.target}) is unreadable: coding full"
        section = mirror_codec(doc) or {}
        delta = section.get("delta") if isinstance(section.get("delta"), dict) else None
        depth = int(delta.get("depth", 0)) if delta else 0
        if depth + 1 >= every:
            return None, f"{every - 1} deltas since the last full checkpoint: coding full"
        try:
            source = DrainSource(str(entry.path))
        except Exception as exc:  # noqa: BLE001
            return None, f"base {entry.path} unreadable ({exc}): coding full"
        if source.manifest.save_key != doc.get("save_key"):
            return None, f"{entry.path} no longer holds the save mirrored at {state.target}: coding full"
        return Base(source, state.target, depth), f"delta against {entry.path} ({state.target})"
    return None, "no earlier mirrored checkpoint in the run directory: coding full"


class CompressedSource:
    """A DrainSource seen through the codec: what the drain sends are the coded files.

    Has what the drain uses of a DrainSource: ``location``, ``save_key``, ``manifest``
    (``file_names``: the stored names), ``files`` (records of the coded files), ``piece``,
    ``tables``, ``manifest_bytes`` (the mirror's manifest) and ``changed``.
    """

    def __init__(self, inner: DrainSource, encoder: Encoder, *, level: int,
                 chunk_size: int = codec.DEFAULT_CHUNK, window: int = WINDOW, base: Base | None = None) -> None:
        self.inner = inner
        self.base = base
        self.location = inner.location
        self.save_key = inner.save_key
        self.tables = inner.tables
        self.scratch = os.path.join(inner.location, f".drain-zip.{inner.save_key}")
        self.stats = CodecStats()
        started, cpu0 = time.perf_counter(), encoder.cpu
        os.makedirs(self.scratch, exist_ok=True)
        self.files: dict[str, FileRecord] = {}
        names = []
        for name in inner.manifest.file_names:
            record = inner.files[name]
            base_record = base.match(record, inner.manifest) if base is not None else None
            coded = self._encode(record, encoder, chunk_size, window, base_record)
            self.files[coded.name] = coded
            names.append(coded.name)
            self.stats.files[name] = {"stored": coded.name, "size": record.size, "stored_size": coded.size}
            if base_record is not None:
                self.stats.files[name]["base"] = base_record.name
            self.stats.bytes_in += record.size
            self.stats.bytes_out += coded.size
        self.stats.seconds = time.perf_counter() - started
        self.stats.cpu_seconds = encoder.cpu - cpu0
        self.manifest = _Names(names, inner.manifest.doc)
        doc = {k: v for k, v in json.loads(inner.manifest_bytes).items() if k != SELF_CRC}
        doc[SECTION] = {
            "codec": codec.CODEC, "version": codec.CODEC_VERSION, "level": level,
            "chunk_size": chunk_size, "bytes": self.stats.bytes_in, "stored_bytes": self.stats.bytes_out,
            "ratio": round(self.stats.ratio, 4), "files": self.stats.files,
        }
        if base is not None:
            doc[SECTION]["delta"] = {"base": base.target, "base_save_key": base.source.save_key,
                                     "depth": base.depth + 1}
        self.manifest_bytes = seal(doc)

    def _encode(self, record: FileRecord, encoder: Encoder, chunk_size: int, window: int,
                base_record: FileRecord | None) -> FileRecord:
        plan = plan_file(record, self.inner.manifest, window, chunk_size)
        chunks = [c for _, cs in plan for c in cs]
        final = os.path.join(self.scratch, stored_name(record.name))
        temp = final + ".tmp"
        lengths: list[tuple[int, int]] = []
        with step(f"compressing {record.name} into {final}"):
            with open(temp, "wb") as out:
                out.seek(codec.HEADER_SIZE + codec.ENTRY_SIZE * len(chunks))
                for piece, cs in plan:
                    data = self.inner.piece(record, piece)  # checked against the blocks table
                    basis = self.base.source.piece(base_record, piece) if base_record is not None else None
                    for stored, crc in encoder.code(data, cs, piece.offset, basis):
                        out.write(stored)
                        lengths.append((len(stored), crc))
                entries = codec.table_entries(chunks, lengths, delta=base_record is not None)
                out.seek(0)
                out.write(codec.pack_header(entries, record.size))
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, final)
            return _record_of(final, record)

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

    def discard(self) -> None:
        """Remove the coded files (after the commit; they are only the drain's scratch)."""
        shutil.rmtree(self.scratch, ignore_errors=True)


class _Names:
    """The part of a Manifest the drain loop reads: the names of the files to send."""

    def __init__(self, names: list[str], doc: dict[str, Any]) -> None:
        self.file_names, self.doc = names, doc


def _record_of(path: str, original: FileRecord) -> FileRecord:
    """A FileRecord of a coded file: crc32c per checksum block, read back from disk (what is
    sent and confirmed later is what was written)."""
    block = original.checksum_block
    crcs = []
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            crcs.append(crc32c.crc32c(chunk))
    size = os.path.getsize(path)
    return FileRecord(os.path.basename(path), original.rank, size, 0, block, 0, tuple(crcs))


def remove_scratch(location: str, keep: str | None = None) -> None:
    """Remove coded scratch directories of a checkpoint (all, or all but save ``keep``'s)."""
    try:
        names = os.listdir(location)
    except OSError:
        return
    for name in names:
        if name.startswith(".drain-zip.") and name != f".drain-zip.{keep}":
            shutil.rmtree(os.path.join(location, name), ignore_errors=True)


def mirror_codec(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The compression section of a manifest, or None for a plain checkpoint."""
    section = doc.get(SECTION)
    return section if isinstance(section, dict) else None


def through_codec(source: DrainSource, mode: str, *, link: float | None, threads: int,
                  level: int, base: Base | None = None) -> tuple[DrainSource | CompressedSource, dict[str, Any]]:
    """The source the drain sends for ``mode``, and what was decided (for DrainResult)."""
    if mode == "off":
        return source, {"mode": "off"}
    encoder = Encoder(threads, level)
    try:
        info: dict[str, Any] = {"mode": mode, "threads": threads, "level": level}
        if mode == "auto":
            sample = measure(source, encoder)
            go, why = pays(sample, link)
            info.update(decision=why, measured_throughput=sample.throughput, measured_ratio=sample.ratio)
            log.info("dcp_nvme: compress=auto for %s: %s", source.location, why)
            if not go:
                info["cpu_seconds"] = encoder.cpu
                return source, info
        coded = CompressedSource(source, encoder, level=level, base=base)
        info.update(codec=codec.CODEC, ratio=coded.stats.ratio, bytes=coded.stats.bytes_in,
                    stored_bytes=coded.stats.bytes_out, encode_seconds=coded.stats.seconds,
                    cpu_seconds=encoder.cpu)
        return coded, info
    finally:
        encoder.close()
