"""The on-disk schema: a JSON manifest (the commit marker) naming two Parquet tables.

    manifest.json          format version, world size, DCP planner data, config, timings, and
                           the name, size and crc32c of the two tables below. Written last:
                           the checkpoint exists once this file does.
    index.<key>.parquet    one row per stored chunk: fqn, chunk offsets/sizes, global shape,
                           dtype, file, byte offset, length.
    blocks.<key>.parquet   one row per container file: size, data start, crc32c per block.

``<key>`` is a random id per save, so an overwrite never touches the files of the checkpoint it
replaces until its own manifest is committed. Nothing here is pickled.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .checksums import check_table
from .errors import CheckpointNotCommittedError, CheckpointNotFoundError, ManifestError, TableError
from .store import fsync_dir

FORMAT = "dcp_nvme"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"  # the commit marker of DCP's own FileSystemWriter

_DATA_RE = re.compile(r"^rank_(\d{5,})\.([0-9a-f]+)\.safetensors$")
_TABLE_RE = re.compile(r"^(index|blocks)\.([0-9a-f]+)\.parquet$")


def new_save_key() -> str:
    return secrets.token_hex(4)


def data_file_name(rank: int, key: str) -> str:
    return f"rank_{rank:05d}.{key}.safetensors"


def save_key_of(name: str) -> str | None:
    """The save key in one of our file names, or None for anything else."""
    match = _DATA_RE.match(name) or _TABLE_RE.match(name)
    return match.group(2) if match else None


_TEMP_RE = re.compile(r"^\.(manifest\.json|(?:index|blocks)\.[0-9a-f]+\.parquet)\.tmp-([0-9A-Za-z]+)$")


def temp_name(name: str, save_key: str) -> str:
    """Where ``name`` is written before it is renamed into place; it names the save."""
    return f".{name}.tmp-{save_key}"


def temp_of(name: str) -> tuple[str, str] | None:
    """(final name, save key or legacy pid) of one of our commit temp files, else None.

    Other hidden temp files of the directory (the drain journal's) are not ours."""
    match = _TEMP_RE.match(name)
    return (match.group(1), match.group(2)) if match else None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_commit_file(directory: str | os.PathLike, name: str, data: bytes, save_key: str) -> None:
    """Write ``directory/name`` all or nothing: temp file, write, fsync, rename, fsync of the dir.

    A failure removes the temp file and raises OSError naming the file and the step (the
    errno is kept: ENOSPC stays ENOSPC). Until the rename nothing under ``name`` changed."""
    directory = os.fspath(directory)
    temp = os.path.join(directory, temp_name(name, save_key))
    final = os.path.join(directory, name)
    step, subject = "create", temp
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            step = "write"
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            step = "fsync"
            os.fsync(fd)
        finally:
            os.close(fd)
        step, subject = "rename into place", final
        os.replace(temp, final)
    except OSError as exc:
        _unlink_quietly(temp)
        raise OSError(exc.errno, f"cannot {step} {subject} while saving: {exc.strerror or exc}") from exc
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise OSError(exc.errno, f"{final} was renamed into place but the fsync of {directory} "
                                 f"failed: {exc.strerror or exc}; it may not survive a power loss") from exc


# --------------------------------------------------------------------------- dtypes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r} in the manifest (written by a newer torch?)")
    return value


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ChunkRecord:
    """Where one stored chunk (or non-tensor item) lives."""

    fqn: str
    kind: str  # "tensor" or "bytes"
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    file: str
    byte_offset: int
    length: int
    key: str

    @property
    def index(self) -> MetadataIndex:
        return MetadataIndex(self.fqn, self.offsets if self.kind == "tensor" else None)


@dataclass(frozen=True)
class FileRecord:
    """One container file and the crc32c of each of its data blocks."""

    name: str
    rank: int
    size: int
    data_start: int
    checksum_block: int
    header_crc: int
    crcs: tuple[int, ...]

    @property
    def data_size(self) -> int:
        return self.size - self.data_start


@dataclass(frozen=True)
class StoredItem:
    """A WriteResult's ``storage_data``: the chunk, plus its file on one result per file."""

    chunk: ChunkRecord
    file: FileRecord | None = None
    stats: dict[str, Any] | None = None


_CHUNK_SCHEMA = pa.schema([
    ("fqn", pa.string()),
    ("kind", pa.string()),
    ("chunk_offsets", pa.list_(pa.int64())),
    ("chunk_sizes", pa.list_(pa.int64())),
    ("global_shape", pa.list_(pa.int64())),
    ("dtype", pa.string()),
    ("file", pa.string()),
    ("byte_offset", pa.int64()),
    ("length", pa.int64()),
    ("key", pa.string()),
])

_FILE_SCHEMA = pa.schema([
    ("name", pa.string()),
    ("rank", pa.int32()),
    ("size", pa.int64()),
    ("data_start", pa.int64()),
    ("checksum", pa.string()),
    ("checksum_block", pa.int64()),
    ("header_crc", pa.int64()),
    ("crcs", pa.list_(pa.uint32())),
])


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def chunks_table(chunks: Sequence[ChunkRecord]) -> bytes:
    columns = {
        "fqn": [c.fqn for c in chunks],
        "kind": [c.kind for c in chunks],
        "chunk_offsets": [list(c.offsets) for c in chunks],
        "chunk_sizes": [list(c.sizes) for c in chunks],
        "global_shape": [list(c.global_shape) for c in chunks],
        "dtype": [c.dtype for c in chunks],
        "file": [c.file for c in chunks],
        "byte_offset": [c.byte_offset for c in chunks],
        "length": [c.length for c in chunks],
        "key": [c.key for c in chunks],
    }
    return _parquet_bytes(pa.table(columns, schema=_CHUNK_SCHEMA))


def files_table(files: Sequence[FileRecord]) -> bytes:
    columns = {
        "name": [f.name for f in files],
        "rank": [f.rank for f in files],
        "size": [f.size for f in files],
        "data_start": [f.data_start for f in files],
        "checksum": ["crc32c"] * len(files),
        "checksum_block": [f.checksum_block for f in files],
        "header_crc": [f.header_crc for f in files],
        "crcs": [list(f.crcs) for f in files],
    }
    return _parquet_bytes(pa.table(columns, schema=_FILE_SCHEMA))


def _read_table(data: bytes, schema: pa.Schema, what: str) -> dict[str, list]:
    try:
        # no Arrow thread pool: its threads, once started, can abort the interpreter at exit
        # ("terminate called without an active exception", apache/arrow#34314; 1 in 100 CLI runs
        # under load here). A single-threaded read of a small index starts none.
        table = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"{what} is not a readable Parquet file: {exc}") from None
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise ManifestError(f"{what} lacks column(s) {missing}")
    return {name: table.column(name).to_pylist() for name in schema.names}


def parse_chunks(data: bytes, what: str = "index") -> list[ChunkRecord]:
    cols = _read_table(data, _CHUNK_SCHEMA, what)
    return [
        ChunkRecord(fqn, kind, tuple(off), tuple(sizes), tuple(shape), dtype, file, int(b), int(n), key)
        for fqn, kind, off, sizes, shape, dtype, file, b, n, key in zip(*cols.values())
    ]


def parse_files(data: bytes, what: str = "blocks") -> dict[str, FileRecord]:
    cols = _read_table(data, _FILE_SCHEMA, what)
    files = {}
    for name, rank, size, start, checksum, block, hcrc, crcs in zip(*cols.values()):
        if checksum != "crc32c":
            raise ManifestError(f"{what}: file {name} uses unknown checksum {checksum!r}")
        files[name] = FileRecord(name, rank, size, start, block, hcrc, tuple(crcs))
    return files


# --------------------------------------------------------------------------- planner data


def encode_json(value: Any, where: str = "planner_data") -> Any:
    """JSON with tuples kept as tuples; anything JSON cannot carry is an error, never a pickle."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode_json(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_json(v, where) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is a {type(k).__name__}, not a string")
            if k == "__tuple__":
                raise ValueError(f"{where}: the key '__tuple__' is reserved")
            out[k] = encode_json(v, f"{where}[{k!r}]")
        return out
    raise ValueError(
        f"{where} holds a {type(value).__module__}.{type(value).__name__}, which dcp_nvme cannot "
        "store without pickling; use a planner whose planner_data is JSON-like "
        "(dict/list/tuple/str/int/float/bool/None)"
    )


def decode_json(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode_json(v) for v in value["__tuple__"])
        return {k: decode_json(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- manifest


@dataclass
class Manifest:
    """A committed checkpoint as read back: the JSON document and the chunk index."""

    doc: dict[str, Any]
    chunks: list[ChunkRecord]
    _files: dict[str, FileRecord] | None = field(default=None, repr=False)

    @property
    def save_key(self) -> str:
        return self.doc["save_key"]

    @property
    def file_names(self) -> list[str]:
        return [f["name"] for f in self.doc["files"]]

    def to_metadata(self) -> Metadata:
        """DCP's Metadata, rebuilt from data."""
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, ChunkRecord] = {}
        for chunk in self.chunks:
            if chunk.kind == "bytes":
                state[chunk.fqn] = BytesStorageMetadata()
            else:
                entry = state.get(chunk.fqn)
                if entry is None:
                    entry = state[chunk.fqn] = TensorStorageMetadata(
                        TensorProperties(dtype=parse_dtype(chunk.dtype)),
                        torch.Size(chunk.global_shape),
                        [],
                    )
                entry.chunks.append(
                    ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes))
                )
            storage[chunk.index] = chunk
        meta = self.doc.get("storage_meta") or {}
        return Metadata(
            state_dict_metadata=state,
            planner_data=decode_json(self.doc.get("planner_data")),
            storage_data=storage,
            storage_meta=StorageMeta(
                checkpoint_id=meta.get("checkpoint_id"), save_id=meta.get("save_id"),
                modules=[m for m in _list_or_empty(meta.get("modules")) if isinstance(m, str)],
            ),
            version=self.doc.get("dcp_version"),
        )


def _list_or_empty(value: Any) -> list:
    return value if isinstance(value, list) else []


def table_entry(name: str, data: bytes) -> dict[str, Any]:
    return {"name": name, "size": len(data), "crc32c": crc32c.crc32c(data)}


def build_manifest_doc(
    *,
    save_key: str,
    files: Iterable[FileRecord],
    index: dict[str, Any],
    blocks: dict[str, Any],
    world_size: int,
    planner_data: Any,
    dcp_version: str | None,
    storage_meta: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    files = list(files)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "save_key": save_key,
        "world_size": world_size,
        "dcp_version": dcp_version,
        "planner_data": encode_json(planner_data),
        "storage_meta": storage_meta,
        "index": index,
        "blocks": blocks,
        "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in files],
        "total_bytes": sum(f.size for f in files),
        **extra,
    }


def missing_manifest_error(store, location: str) -> CheckpointNotFoundError:
    """Why a directory without a committed manifest cannot be loaded: not committed (our files
    without a manifest), or not ours at all."""
    names = store.names()
    if DCP_METADATA in names:
        return CheckpointNotFoundError(
            f"{location} holds a checkpoint written by DCP's FileSystemWriter (.metadata), "
            "not by dcp_nvme; load it with torch.distributed.checkpoint.FileSystemReader, "
            f"or convert it: dcp-nvme convert {location} OUT --to nvme")
    ours = [n for n in names if save_key_of(n)]
    if ours:
        return CheckpointNotCommittedError(
            f"{location} has {len(ours)} dcp_nvme data file(s) but no committed {MANIFEST}: "
            "the save did not finish (it crashed or is still running), so it cannot be loaded")
    return CheckpointNotFoundError(f"{location} is not a dcp_nvme checkpoint (no {MANIFEST})")


def _load_table(store, entry: dict[str, Any], location: str) -> bytes:
    name = entry["name"]
    try:
        data = store.read(name)
    except FileNotFoundError:
        raise TableError(name, f"{location}: {name} named by {MANIFEST} is missing") from None
    check_table(location, entry, data)
    return data


SELF_CRC = "manifest_crc32c"


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != SELF_CRC}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes, carrying a crc32c of its own canonical form (any edit is caught)."""
    return json.dumps({**doc, SELF_CRC: crc32c.crc32c(_canonical(doc))}, indent=1).encode()


def read_manifest(store, location: str) -> Manifest:
    """Read and validate a committed checkpoint's manifest and chunk index."""
    if not store.exists():
        raise CheckpointNotFoundError(f"checkpoint directory {location} does not exist")
    if not store.has(MANIFEST):
        raise missing_manifest_error(store, location)
    try:
        doc = json.loads(store.read(MANIFEST))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{location}/{MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{location}/{MANIFEST} is not a dcp_nvme manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ManifestError(
            f"{location} uses format version {version!r}; this dcp_nvme reads up to "
            f"{FORMAT_VERSION}: upgrade dcp_nvme"
        )
    if doc.get(SELF_CRC) != crc32c.crc32c(_canonical(doc)):
        raise ManifestError(f"{location}/{MANIFEST} fails its own checksum: the manifest is corrupt "
                            "or was edited after the save")
    for required in ("save_key", "index", "blocks", "files"):
        if required not in doc:
            raise ManifestError(f"{location}/{MANIFEST} lacks {required!r}")
    chunks = parse_chunks(_load_table(store, doc["index"], location), f"{location}/index")
    return Manifest(doc, chunks)


def read_files(store, manifest: Manifest, location: str) -> dict[str, FileRecord]:
    """The per-file checksum table, read once on first use."""
    if manifest._files is None:
        data = _load_table(store, manifest.doc["blocks"], location)
        manifest._files = parse_files(data, f"{location}/blocks")
    return manifest._files
