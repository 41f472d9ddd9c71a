"""Safetensors files dcp_nvme did not write, as sources (no torch; unlike the rest of ``format``
it reads files): what a path holds (``what_is``: a Hugging Face model directory, a single
``.safetensors`` file, a stock DCP checkpoint), the files of a Hugging Face directory (``model.safetensors.index.json``'s, else
every top-level ``*.safetensors``) and each file's entries (``scan_file``).

Every name and number read from these files is checked here, before it is used: the header by
``container.parse_header`` (length cap, dtypes, shapes, non-overlapping offsets), each item
inside the file, the index's file names bare names of regular files beside it, torch's
``DCP_SHARDING_INFO`` offsets counts of the tensor's rank; every shard a regular file (a FIFO
is refused, never opened blocking) inside the directory (a link may lead only to the Hugging
Face cache's ``blobs/`` of the same model); the chunks of each tensor tiling it exactly
(``check_layout``), before a byte of data is read. ``load.foreign`` reads them.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.container import (
    DCP_METADATA,
    MANIFEST,
    MAX_HEADER,
    SHARDING_INFO,
    ST_NAMES,
    header_length,
    parse_header,
    save_key_of,
)
from dcp_nvme.host.files import file_kind, open_regular, read_regular

HF_INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"
MAX_INDEX = 64 << 20
"""Largest ``model.safetensors.index.json`` read (a 10k-shard model's is a few MB)."""

HF_DIR, SAFETENSORS_FILE, STOCK_DCP = "a Hugging Face model directory", "a single safetensors file", \
    "a stock DCP checkpoint"

_ST_TORCH = {st: name for name, st in ST_NAMES.items()}
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,250}\.safetensors$")


def what_is(path: str | os.PathLike) -> str | None:
    """``HF_DIR``, ``SAFETENSORS_FILE`` or ``STOCK_DCP`` for a local path that holds one (and no
    dcp_nvme manifest or data file); None for anything else."""
    location = os.fspath(path)
    if os.path.isfile(location):
        if save_key_of(os.path.basename(location)) and os.path.isfile(os.path.join(os.path.dirname(location), MANIFEST)):
            return None  # a rank file of one of our checkpoints: the checkpoint is what to open
        return SAFETENSORS_FILE if location.endswith(SUFFIX) else None
    if not os.path.isdir(location) or os.path.isfile(os.path.join(location, MANIFEST)):
        return None
    if os.path.isfile(os.path.join(location, DCP_METADATA)):
        return STOCK_DCP
    names = os.listdir(location)
    if any(save_key_of(n) for n in names):
        return None  # our files without a manifest: a save that did not finish, not theirs
    if HF_INDEX in names or any(n.endswith(SUFFIX) and _FILE_NAME.match(n) for n in names):
        return HF_DIR
    return None


@dataclass(frozen=True)
class StoredChunk:
    """One safetensors entry, checked: where its bytes are and what they are."""

    fqn: str
    file: str
    start: int
    """Byte offset in the file."""
    nbytes: int
    dtype: str
    """torch's name of it (``float32``)."""
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    """Where the chunk sits in its tensor (torch's ``DCP_SHARDING_INFO``; zeros without it)."""


def hf_files(path: str, kind: str | None) -> list[str]:
    """The files of a Hugging Face model directory (its index's, else every top-level
    ``*.safetensors``, by name), each checked by ``_check_shard``, or the single file."""
    if kind == SAFETENSORS_FILE:
        return [path]
    index = os.path.join(path, HF_INDEX)
    if os.path.lexists(index):
        names = _weight_map(index, path)
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX) and _FILE_NAME.match(n))
    return [_check_shard(path, name, index if os.path.lexists(index) else None) for name in names]


def _check_shard(directory: str, name: str, index: str | None) -> str:
    """``directory/name`` if it is a regular file there, or a link to one that stays inside the
    directory (or, in the Hugging Face cache's ``snapshots/<revision>/``, inside that model's
    ``blobs/``): a FIFO would hang the first read, a link elsewhere reads what is not the model."""
    path = os.path.join(directory, name)
    named = f"{index} names {name}, which" if index else f"{path}"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise ManifestError(f"{named} is not in {directory}; put the missing shard back (or download "
                            "the model again)") from None
    if stat.S_ISLNK(mode):
        real, roots = os.path.realpath(path), [os.path.realpath(directory)]
        parent = os.path.dirname(roots[0])
        if os.path.basename(parent) == "snapshots":
            roots.append(os.path.join(os.path.dirname(parent), "blobs"))
        if not any(os.path.commonpath([real, root]) == root for root in roots):
            raise ManifestError(f"{path} is a symbolic link to {real}, outside {directory}; a model's shards are "
                                "read only from its own directory, so it is refused: copy the file there")
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ManifestError(f"{path} is a link to {real}, which cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ManifestError(f"{named} is {file_kind(mode)}; a model's shards must be regular files, so it is "
                            "refused: replace it with the shard file")
    return path


def open_shard(file: str) -> int:
    """A read fd of a shard checked by ``hf_files`` (or a single file): its link, if any, resolved
    once, and opened non-blocking first, so that a FIFO swapped in since is refused, not waited on."""
    return open_regular(os.path.realpath(file))


def _weight_map(index: str, directory: str) -> list[str]:
    """The shard files ``model.safetensors.index.json`` names: bare ``.safetensors`` names, each
    once, in first-use order (``_check_shard`` checks the files)."""
    doc_bytes = read_regular(index, MAX_INDEX)
    try:
        doc = json.loads(doc_bytes)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"{index} is not valid JSON ({exc})") from None
    weights = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weights, dict) or not weights:
        raise ManifestError(f"{index} has no weight_map (a JSON object of tensor name -> file name)")
    names: list[str] = []
    for fqn, name in weights.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise ManifestError(f"{index}: {fqn!r} is in {name!r}, not the bare name of a .safetensors file "
                                "beside the index")
        if name not in names:
            names.append(name)
    return names


def scan_file(file: str) -> list[StoredChunk]:
    """A safetensors file's entries, each checked: the header (``parse_header``), the data inside
    the file, a dtype torch has, ``DCP_SHARDING_INFO`` offsets (when there) of the tensor's rank."""
    with os.fdopen(open_shard(file), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = header_length(f.read(8), size, file)
        f.seek(0)
        prefix = f.read(8 + min(length, MAX_HEADER))
    metadata, items, data_start = parse_header(prefix, file)
    sharding = _sharding_info(metadata, file)
    chunks = []
    for item in items:
        if data_start + item.end > size:
            raise ManifestError(f"{file}: item {item.key!r} ends at byte {data_start + item.end}, past the "
                                f"file's {size} (truncated?)")
        offsets: tuple[int, ...] = (0,) * len(item.shape)
        if sharding is not None:
            given = sharding.get(item.key, {}).get("saved_offsets") if isinstance(sharding.get(item.key), dict) else None
            if not (isinstance(given, list) and len(given) == len(item.shape)
                    and all(type(v) is int and v >= 0 for v in given)):
                raise ManifestError(f"{file}: {SHARDING_INFO} gives item {item.key!r} no offsets of its "
                                    f"{len(item.shape)} dims ({str(given)[:100]})")
            offsets = tuple(given)
        dtype = _ST_TORCH[item.st_dtype]  # parse_header admits only the dtypes of ST_NAMES
        chunks.append(StoredChunk(item.key, file, data_start + item.start, item.nbytes, dtype, item.shape, offsets))
    return chunks


def _sharding_info(metadata: dict[str, object], file: str) -> dict[str, Any] | None:
    text = metadata.get(SHARDING_INFO)
    if text is None:
        return None
    try:
        info = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        info = None
    if not isinstance(info, dict):
        raise ManifestError(f"{file}: the header's {SHARDING_INFO} is not a JSON object")
    return info


def check_layout(chunks: list[StoredChunk], location: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape (the chunks' extent), once its chunks agree on dtype and rank and tile
    it exactly: no two overlap and together they cover every element. A shard file missing or
    two chunks at overlapping offsets would otherwise leave elements at the destination's old
    values or mix two chunks. Checked before any data is read."""
    by_fqn: dict[str, list[StoredChunk]] = {}
    for chunk in chunks:
        first = by_fqn.setdefault(chunk.fqn, [chunk])[0]
        if chunk is not first:
            if (chunk.dtype, len(chunk.shape)) != (first.dtype, len(first.shape)):
                raise ManifestError(f"{chunk.file}: {chunk.fqn!r} is {chunk.dtype} of {len(chunk.shape)} dims "
                                    f"here, {first.dtype} of {len(first.shape)} dims in {first.file}")
            by_fqn[chunk.fqn].append(chunk)
    shapes: dict[str, tuple[int, ...]] = {}
    for fqn, group in by_fqn.items():
        shape = tuple(max(o + n for o, n in pair) for pair in zip(*[list(zip(c.offsets, c.shape)) for c in group])) \
            if group[0].shape else ()
        # sorted by the first dim's start: only chunks whose first-dim ranges meet can overlap
        ordered = sorted(group, key=lambda c: c.offsets[:1])
        for i, a in enumerate(ordered):
            for b in ordered[i + 1:]:
                if a.shape and b.offsets[0] >= a.offsets[0] + a.shape[0]:
                    break
                if all(bo < ao + an and ao < bo + bn for ao, an, bo, bn in zip(a.offsets, a.shape, b.offsets, b.shape)):
                    raise ManifestError(f"{location}: {fqn!r}'s chunk at offsets {list(a.offsets)} in {a.file} "
                                        f"overlaps the one at {list(b.offsets)} in {b.file}; the model's files do "
                                        "not belong together")
        covered = sum(_volume(c.shape) for c in group)
        if covered != _volume(shape):
            raise ManifestError(f"{location}: {fqn!r}'s chunks cover {covered} of the {_volume(shape)} elements of "
                                f"its shape {list(shape)}: a shard file is missing (its files: "
                                f"{sorted({os.path.basename(c.file) for c in group})}); put it back")
        shapes[fqn] = shape
    return shapes


def _volume(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total
