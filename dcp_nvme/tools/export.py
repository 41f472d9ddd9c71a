"""``export --to hf``: consolidate a sharded checkpoint into Hugging Face's safetensors layout.

Streaming: each output shard's header is computed up front (every shape and dtype is in the
index), then tensors are assembled and written one at a time. A tensor is assembled in one
buffer of its full size, its chunks read straight into place (verified against the container
checksums), then cast in fixed-size pieces while it is written. Peak memory is the largest
tensor plus a fixed buffer, whatever the size of the model.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dcp_nvme.config import IOConfig, parse_size
from dcp_nvme.engines.host_io import tensor_bytes
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.errors import InvalidInputError
from dcp_nvme.format.container import build_header
from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.format.safetensors_files import HF_DIR, SAFETENSORS_FILE, what_is
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.format.validation import check_container
from dcp_nvme.humanize import progress_bar
from dcp_nvme.load.planning import FileBlocks, plan_reads
from dcp_nvme.storage.local_dir import LocalStore, is_remote_url
from dcp_nvme.tiers.coded import CodedEngine, coded_engine, decoded_view
from dcp_nvme.tools.consolidate import (
    TensorPlan,
    chunk_needs,
    model_selection,
    parse_out_dtype,
    plan_shards,
    select_tensors,
    shard_name,
)

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MAX_CONFIG = 16 << 20
"""Largest model config read (``--config``); a model's is a few KB."""
HEADER_ALIGN = 8
"""safetensors pads its header so the data is 8-byte aligned."""
CAST_BUFFER = 16 << 20
"""Bytes of output cast at once when --dtype changes a tensor's dtype."""
READ_CONFIG = IOConfig(queue_depth=4, block_size=4 << 20, direct_io=False, verify=True)
"""Buffered reads go straight into the tensor being assembled: no bounce buffers to hold."""


@dataclass
class ExportResult:
    out: str
    shards: list[str] = field(default_factory=list)
    tensors: int = 0
    total_size: int = 0
    """Bytes of tensor data written (the index's ``metadata.total_size``)."""
    skipped_objects: list[str] = field(default_factory=list)
    """Non-tensor items of the selection (DCP's BYTE_IO), which have no place in an HF model."""
    largest_tensor: int = 0
    seconds: float = 0.0
    left_out: dict[str, int] = field(default_factory=dict)
    """Training state a model export leaves out: top-level key -> its tensors (``include_optimizer``)."""
    config: str | None = None
    """The ``config.json`` written beside the weights (from ``config``), or None."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    keys: Sequence[str] | str | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
    include_optimizer: bool = False,
    config: str | os.PathLike | None = None,
) -> ExportResult:
    """Write ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` to ``out``.

    By default the model's weights, under the names Hugging Face expects: the tensors under a
    ``model`` (``state_dict``, ``module``) key with that prefix removed, else every tensor except
    optimizer and training state (``tools.consolidate.model_selection``); ``include_optimizer``
    exports every tensor as named in the checkpoint. ``keys``: globs on the checkpoint's names
    (e.g. ``"model.*"``) instead; ``strip_prefix`` is removed from the names that start with it;
    ``dtype`` casts floating-point tensors. ``config``: a model's ``config.json`` (a JSON object)
    copied beside the weights, which transformers' ``from_pretrained`` needs; the checkpoint holds
    none. The output appears whole or not at all (written to a temporary sibling, then renamed).
    """
    started = time.perf_counter()
    config_bytes = None if config is None else read_config(config)
    if is_remote_url(checkpoint):
        raise InvalidInputError(f"export reads local checkpoints; copy {checkpoint} to local disk first")
    location = os.fspath(checkpoint)
    if what_is(location) in (HF_DIR, SAFETENSORS_FILE):
        # its headers checked and its chunks placed once (convert), then exported as ours are
        from dcp_nvme.tools.convert import convert

        out_parent = Path(out).resolve().parent
        out_parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_parent, prefix=".export-source-") as scratch:
            converted = os.path.join(scratch, "checkpoint")
            convert(location, converted, "nvme")
            return export_hf(converted, out, keys=keys, strip_prefix=strip_prefix, dtype=dtype,
                             max_shard_size=max_shard_size, overwrite=overwrite, progress=progress,
                             include_optimizer=include_optimizer, config=config)
    if isinstance(keys, str):
        keys = [keys]
    out_dtype = parse_out_dtype(dtype)
    limit = parse_size(max_shard_size)
    out_path = Path(out)
    _refuse_overlap(location, out_path)
    _check_out(out_path, overwrite)
    raw = LocalStore(location)
    store = decoded_view(raw)  # a compressed mirror reads as its plain files
    manifest = read_manifest(store, location)
    left_out: dict[str, int] = {}
    if keys is None and not include_optimizer:
        chosen = model_selection(list(dict.fromkeys(c.fqn for c in manifest.chunks if c.kind == "tensor")))
        keys, left_out = chosen.keys, chosen.left_out
        strip_prefix = chosen.strip_prefix if strip_prefix is None else strip_prefix
    tensors = select_tensors(manifest.chunks, keys=keys, strip_prefix=strip_prefix, dtype=out_dtype,
                             location=location)
    files = read_files(store, manifest, location)
    for name in sorted({c.file for t in tensors for c in t.chunks}):
        check_container(store, files[name], manifest, location)
    shards = plan_shards(tensors, limit)
    result = ExportResult(str(out_path), tensors=len(tensors), total_size=sum(t.nbytes for t in tensors),
                          largest_tensor=max(t.stored_nbytes for t in tensors), left_out=left_out)
    result.skipped_objects = sorted({c.fqn for c in manifest.chunks if c.kind == "bytes"
                                     and (not keys or any(_match(c.fqn, k) for k in keys))})
    temp = out_path.with_name(f".{out_path.name}.partial-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    engine = coded_engine(raw, manifest, location, READ_CONFIG) or PosixEngine(READ_CONFIG)  # .dcz mirror
    bar = progress_bar(result.total_size, progress, "export")
    try:
        weight_map = {}
        for index, shard in enumerate(shards):
            name = shard_name(index, len(shards))
            _write_shard(temp / name, shard, location, files, engine, bar)
            weight_map.update({t.name: name for t in shard})
            result.shards.append(name)
        index_doc = {"metadata": {"total_size": result.total_size}, "weight_map": weight_map}
        (temp / INDEX_NAME).write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")
        if config_bytes is not None:
            (temp / CONFIG_NAME).write_bytes(config_bytes)
            result.config = str(out_path / CONFIG_NAME)
        _publish(temp, out_path)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        engine.close()
        bar.close()
    result.seconds = time.perf_counter() - started
    return result


def read_config(path: str | os.PathLike) -> bytes:
    """The bytes of a model config file, checked before the export starts: a regular file of at
    most ``MAX_CONFIG`` bytes holding a JSON object."""
    from dcp_nvme.host.files import read_regular

    where = os.fspath(path)
    try:
        data = read_regular(where, MAX_CONFIG)
        doc = json.loads(data)
    except FileNotFoundError:
        raise InvalidInputError(f"--config {where}: no such file; pass the model's config.json") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"--config {where} is not a readable JSON file ({exc}); pass the model's "
                                "config.json") from None
    if not isinstance(doc, dict):
        raise InvalidInputError(f"--config {where} holds {type(doc).__name__}, not a JSON object as a model's "
                                "config.json does")
    return data


def _match(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def _refuse_overlap(checkpoint: str, out: Path) -> None:
    """An export onto the checkpoint it reads (or into it, or around it) would replace it."""
    from dcp_nvme.tiers.transfer import overlap

    why = overlap(os.path.realpath(checkpoint), os.path.realpath(out))
    if why is not None:
        raise InvalidInputError(f"refusing to export: {why.replace('target', 'output')}; choose an output "
                         "directory outside the checkpoint")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        if not out.is_dir() or any(out.iterdir()):
            raise FileExistsError(f"{out} already exists; choose a new output directory or pass --overwrite")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the parent directory of {out} does not exist")


def _publish(temp: Path, out: Path) -> None:
    """Rename the finished export into place; a replaced export is removed only afterwards."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty directory the user made for us
    if out.exists():  # only with overwrite (checked up front)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        temp.rename(out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        temp.rename(out)


def _write_shard(path: Path, shard: list[TensorPlan], location: str, files: dict[str, FileRecord],
                 engine: CodedEngine | PosixEngine, bar: tqdm) -> None:
    header, _ = build_header([t.entry for t in shard], {"format": "pt"}, HEADER_ALIGN)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, memoryview(header))
        for tensor in shard:
            full = assemble(tensor, location, files, engine)
            _write_tensor(fd, full, tensor.out)
            del full
            bar.update(tensor.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def assemble(tensor: TensorPlan, location: str, files: dict[str, FileRecord],
             engine: CodedEngine | PosixEngine) -> torch.Tensor:
    """The full tensor in the stored dtype, read chunk by chunk straight into place."""
    full = torch.empty(tensor.shape, dtype=tensor.stored)
    dests = [tensor_bytes(full)]
    itemsize = tensor.stored.itemsize
    for chunk in tensor.chunks:
        record = files.get(chunk.file)
        if record is None:
            raise FileNotFoundError(f"{location}: {chunk.file} (holding {chunk.fqn}) is not in the blocks table")
        blocks = FileBlocks(record.data_start, record.data_size, record.checksum_block, record.crcs)
        path = os.path.join(location, chunk.file)
        for needs in chunk_needs(chunk, itemsize, 0):
            requests = plan_reads(path, needs, max_request=READ_CONFIG.block_size, blocks=blocks)
            engine.read(requests, dests)
    return full


def _write_tensor(fd: int, full: torch.Tensor, out: torch.dtype) -> None:
    flat = full.reshape(-1)
    if out == full.dtype:
        if flat.numel():
            _write_all(fd, tensor_bytes(flat).numpy().data)
        return
    step = max(1, CAST_BUFFER // max(out.itemsize, full.dtype.itemsize))
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step].to(out)
        _write_all(fd, tensor_bytes(piece).numpy().data)


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view):]
