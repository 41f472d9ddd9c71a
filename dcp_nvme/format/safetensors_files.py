"""Safetensors files dcp_nvme did not write, as sources (no torch; unlike the rest of ``format``
it reads files): what a path holds (``what_is``: a Hugging Face model directory, a single
``.safetensors`` file, a stock DCP checkpoint), the files of a Hugging Face directory (``model.safetensors.index.json``'s, else
every top-level ``*.safetensors``) and each file's entries (``scan_file``).

Every name and number read from these files is checked here, before it is used: the header by
``container.parse_header`` (length cap, dtypes, shapes, non-overlapping offsets), each item
inside the file, the index's file names bare names of regular files beside it, torch's
``DCP_SHARDING_INFO`` offsets counts of the tensor's rank. ``load.foreign`` reads them.
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
    ``*.safetensors``, by name), or the single file."""
    if kind == SAFETENSORS_FILE:
        return [path]
    index = os.path.join(path, HF_INDEX)
    if os.path.isfile(index):
        return [os.path.join(path, name) for name in _weight_map(index, path)]
    names = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX) and _FILE_NAME.match(n))
    return [os.path.join(path, n) for n in names]


def _weight_map(index: str, directory: str) -> list[str]:
    """The shard files ``model.safetensors.index.json`` names: bare ``.safetensors`` names of
    regular files in its directory, each once, in first-use order."""
    size = os.stat(index).st_size
    if size > MAX_INDEX:
        raise ManifestError(f"{index} is {size} bytes, more than the {MAX_INDEX} read")
    with open(index, "rb") as f:
        try:
            doc = json.loads(f.read(MAX_INDEX))
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
    for name in names:
        try:
            mode = os.lstat(os.path.join(directory, name)).st_mode
        except FileNotFoundError:
            raise ManifestError(f"{index} names {name}, which is not in {directory}") from None
        if not stat.S_ISREG(mode):
            raise ManifestError(f"{index} names {name}, which is not a regular file")
    return names


def scan_file(file: str) -> list[StoredChunk]:
    """A safetensors file's entries, each checked: the header (``parse_header``), the data inside
    the file, a dtype torch has, ``DCP_SHARDING_INFO`` offsets (when there) of the tensor's rank."""
    with open(file, "rb") as f:
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
