"""``inspect``: what a checkpoint holds, from its manifest and index only (no data read)."""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_nvme.errors import CheckpointNotFoundError, InvalidInputError
from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.safetensors_files import (
    HF_DIR,
    SAFETENSORS_FILE,
    check_layout,
    hf_files,
    scan_file,
    what_is,
)
from dcp_nvme.format.validation import read_header
from dcp_nvme.storage.fsspec_dir import open_store
from dcp_nvme.storage.local_dir import Store, is_remote_url
from dcp_nvme.tiers.coded import decoded_view
from dcp_nvme.tools.status import FOREIGN, MISSING, NOT_A_CHECKPOINT, CheckpointState, checkpoint_state


@dataclass
class TensorInfo:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    shards: int
    nbytes: int
    files: tuple[str, ...]


@dataclass
class ObjectInfo:
    """A non-tensor item (DCP's BYTE_IO: pickled by DCP's planner, opaque bytes to us)."""

    fqn: str
    nbytes: int
    files: tuple[str, ...]


@dataclass
class Inspection:
    location: str
    state: str
    reason: str = ""
    world_size: int | None = None
    save_key: str | None = None
    created_unix: float | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    tensors: list[TensorInfo] = field(default_factory=list)
    objects: list[ObjectInfo] = field(default_factory=list)
    by_dtype: dict[str, int] = field(default_factory=dict)
    by_top_key: dict[str, int] = field(default_factory=dict)
    partial: dict[str, Any] = field(default_factory=dict)
    """For a checkpoint without a usable manifest: each data file's safetensors header items."""
    topology: dict[str, Any] | None = None
    """Where the ranks' files were written (``mode`` shared or node-local, ``nodes``, ``rank_nodes``)."""
    elsewhere: list[str] = field(default_factory=list)
    """Of a node-local checkpoint: the nodes whose files are on their own disks, not here."""

    @property
    def ok(self) -> bool:
        return self.state in ("committed", HF_DIR, SAFETENSORS_FILE)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + sum(o.nbytes for o in self.objects)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["total_bytes"] = self.total_bytes
        return out


def top_key(fqn: str) -> str:
    """The first component of a name: ``model`` of ``model.layers.0.weight``."""
    return fqn.split(".", 1)[0]


def inspect_checkpoint(location: str | os.PathLike, filter: str | None = None,
                       storage_options: dict[str, Any] | None = None) -> Inspection:
    """Describe a checkpoint; an unfinished or damaged one is described (``state``, ``reason``).
    ``storage_options``: for a URL, its filesystem's options.

    Raises CheckpointNotFoundError when there is no dcp_nvme checkpoint at all (missing path,
    another tool's files). ``filter`` is a glob on names; matching nothing is a ValueError.
    """
    if what_is_local(location) in (HF_DIR, SAFETENSORS_FILE):
        return _inspect_safetensors(os.fspath(location), filter)
    source = decoded_view(open_store(location, storage_options))  # a compressed mirror reads as its plain files
    found = checkpoint_state(source)
    if found.state in (MISSING, NOT_A_CHECKPOINT, FOREIGN):
        raise CheckpointNotFoundError(found.reason)
    result = Inspection(source.location, found.state, found.reason)
    if found.manifest is None:
        result.partial = _partial(source, found)
        return result
    doc = found.manifest.doc
    result.world_size = doc.get("world_size")
    result.save_key = doc.get("save_key")
    result.created_unix = doc.get("created_unix")
    result.files = [dict(f) for f in doc.get("files", []) if isinstance(f, dict)]
    result.topology, result.elsewhere = doc.get("topology"), found.elsewhere
    _summarise(result, found.manifest, filter)
    return result


def what_is_local(location: str | os.PathLike) -> str | None:
    """``format.safetensors_files.what_is`` of a local path; None for a URL (those sources are local only)."""
    return None if is_remote_url(location) else what_is(location)


def _inspect_safetensors(location: str, pattern: str | None) -> Inspection:
    """A Hugging Face model directory or safetensors file, from its headers (each checked)."""
    kind = what_is(location)
    assert kind is not None  # the caller asked
    files = hf_files(location, kind)
    result = Inspection(location, kind, "its own format: no checksums, no non-tensor items")
    result.files = [{"name": os.path.basename(f), "size": os.path.getsize(f)} for f in files]
    tensors: dict[str, TensorInfo] = {}
    chunks = [c for file in files for c in scan_file(file)]
    check_layout(chunks, location)  # a missing shard or overlapping chunks: refused, not summed
    for chunk in chunks:
        if pattern is not None and not fnmatch.fnmatchcase(chunk.fqn, pattern):
            continue
        name = os.path.basename(chunk.file)
        info = tensors.setdefault(chunk.fqn, TensorInfo(chunk.fqn, chunk.dtype, chunk.shape, 0, 0, ()))
        info.shape = tuple(max(s, o + n) for s, o, n in zip(info.shape, chunk.offsets, chunk.shape))
        info.shards += 1
        info.nbytes += chunk.nbytes
        info.files = _add(info.files, name)
    if pattern is not None and not tensors:
        raise InvalidInputError(f"no item of {location} matches the filter {pattern!r}")
    by_dtype: dict[str, int] = defaultdict(int)
    by_top: dict[str, int] = defaultdict(int)
    for info in tensors.values():
        by_dtype[info.dtype] += info.nbytes
        by_top[top_key(info.fqn)] += info.nbytes
    result.tensors, result.by_dtype, result.by_top_key = list(tensors.values()), dict(by_dtype), dict(by_top)
    return result


def _summarise(result: Inspection, manifest: Manifest, pattern: str | None) -> None:
    chunks = manifest.chunks
    if pattern is not None:
        chunks = [c for c in chunks if fnmatch.fnmatchcase(c.fqn, pattern)]
        if not chunks:
            raise InvalidInputError(f"no item of {result.location} matches the filter {pattern!r}")
    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, ObjectInfo] = {}
    for chunk in chunks:
        if chunk.kind == "bytes":
            entry = objects.setdefault(chunk.fqn, ObjectInfo(chunk.fqn, 0, ()))
            entry.nbytes += chunk.length
            entry.files = _add(entry.files, chunk.file)
            continue
        info = tensors.setdefault(chunk.fqn, TensorInfo(chunk.fqn, chunk.dtype, tuple(chunk.global_shape), 0, 0, ()))
        info.shards += 1
        info.nbytes += chunk.length
        info.files = _add(info.files, chunk.file)
    by_dtype: dict[str, int] = defaultdict(int)
    by_top: dict[str, int] = defaultdict(int)
    for info in tensors.values():
        by_dtype[info.dtype] += info.nbytes
        by_top[top_key(info.fqn)] += info.nbytes
    for obj in objects.values():
        by_dtype["(object)"] += obj.nbytes
        by_top[top_key(obj.fqn)] += obj.nbytes
    result.tensors, result.objects = list(tensors.values()), list(objects.values())
    result.by_dtype, result.by_top_key = dict(by_dtype), dict(by_top)


def _add(files: tuple[str, ...], name: str) -> tuple[str, ...]:
    return files if name in files else (*files, name)


def _partial(source: Store, found: CheckpointState) -> dict[str, Any]:
    """What the data files of an unfinished or unreadable save say about themselves."""
    out: dict[str, Any] = {}
    for name in found.data_files:
        try:
            header = read_safetensors_header(source, name)
        except (OSError, ValueError) as exc:
            out[name] = {"error": str(exc)}
            continue
        items = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
        out[name] = {
            "size": source.size(name),
            "items": len(items),
            "bytes": sum(_span(v) for v in items.values()),
            "metadata": header.get("__metadata__", {}),
        }
    return out


def _span(entry: dict[str, Any]) -> int:
    try:
        start, end = entry["data_offsets"]
        return int(end) - int(start)
    except (KeyError, TypeError, ValueError):
        return 0


def read_safetensors_header(source: Store, name: str) -> dict[str, Any]:
    """A safetensors file's header as ``{key: entry, "__metadata__": ...}``, reading only the
    header bytes; a header longer than the cap or the file is refused before any allocation."""
    metadata, items, _, _ = read_header(source, name)
    header: dict[str, Any] = {"__metadata__": metadata}
    for item in items:
        header[item.key] = {"dtype": item.st_dtype, "shape": list(item.shape),
                            "data_offsets": [item.start, item.end]}
    return header
