"""``convert``: between dcp_nvme checkpoints, DCP's stock layout and a ``torch.save`` file.

    nvme <-> dcp    chunk by chunk through the two StorageReader/StorageWriter classes: the
                    items are cut into groups of at most ``memory_budget`` bytes and each group is
                    read, then written as one "rank" of the output (the output has one data file
                    per group; DCP reshards on load, so this changes nothing for a loader).
                    Peak memory: one group (at least the largest stored chunk). Non-tensor items
                    are copied as the bytes they are, never unpickled.
    hf, safetensors -> any  a Hugging Face model directory or one ``.safetensors`` file, read
                    chunk by chunk as above (``load.foreign.SafetensorsReader``).
    torch -> any    the file is opened with ``torch.load(mmap=True, weights_only=True)``: tensors
                    stay in the page cache and are paged in as they are written; the file may hold
                    tensors and plain Python values only (no pickled classes).
    any -> torch    ``torch.save`` pickles one object graph, so the whole state is held in memory
                    at once (the one conversion that cannot stream). Non-tensor items are read
                    with torch's restricted (``weights_only``) unpickler.

Chunk layout, dtypes and bytes are kept exactly: a round trip is bitwise.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_nvme.config import parse_size
from dcp_nvme.errors import InvalidInputError
from dcp_nvme.format.container import DCP_METADATA, MANIFEST, save_key_of
from dcp_nvme.format.safetensors_files import HF_DIR, SAFETENSORS_FILE, STOCK_DCP, what_is
from dcp_nvme.humanize import progress_bar
from dcp_nvme.load.foreign import SafetensorsReader
from dcp_nvme.load.reader import NVMeReader
from dcp_nvme.save.writer import NVMeWriter
from dcp_nvme.storage.local_dir import is_remote_url

FORMATS = ("nvme", "dcp", "torch")
DEFAULT_MEMORY_BUDGET = 1 << 30
"""Bytes of tensor data held at once by a chunked (nvme <-> dcp) conversion."""


@dataclass
class ConvertResult:
    src: str
    dst: str
    src_format: str
    to: str
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    groups: int = 0
    """Data files written by a chunked conversion (one per memory-budget group)."""
    largest_group_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SOURCE_FORMATS = (*FORMATS, "hf", "safetensors")
"""What ``convert`` reads: also a Hugging Face model directory and a single safetensors file."""


def detect_format(path: str | os.PathLike) -> str:
    """``nvme``, ``dcp``, ``hf``, ``safetensors`` or ``torch``, from what is on disk; a clear
    error for anything else."""
    location = Path(path)
    kind = what_is(location)
    if kind == SAFETENSORS_FILE:
        return "safetensors"
    if location.is_file():
        return "torch"
    if not location.is_dir():
        raise FileNotFoundError(f"{location} does not exist")
    if (location / MANIFEST).is_file():
        return "nvme"
    if kind == STOCK_DCP:
        return "dcp"
    if kind == HF_DIR:
        return "hf"
    ours = [name for name in os.listdir(location) if save_key_of(name)]
    why = (f"; its {len(ours)} dcp_nvme data file(s) have no {MANIFEST}: that save did not finish and "
           "cannot be converted") if ours else ""
    raise InvalidInputError(f"{location} holds no checkpoint: neither a dcp_nvme checkpoint ({MANIFEST}), a stock "
                            f"DCP checkpoint ({DCP_METADATA}), {HF_DIR} (*.safetensors) nor {SAFETENSORS_FILE}"
                            f"{why}")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    *,
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    overwrite: bool = False,
    progress: bool = False,
) -> ConvertResult:
    """Convert the checkpoint at ``src`` into format ``to`` (nvme, dcp or torch) at ``dst``.

    ``dst`` must not exist (or be an empty directory) unless ``overwrite``. ``memory_budget``
    bounds the tensor bytes held at once by an nvme <-> dcp conversion. ``progress`` draws a
    bar on a terminal (``humanize.progress_bar``) as each group is moved.
    """
    started = time.perf_counter()
    if to not in FORMATS:
        raise InvalidInputError(f"unknown target format {to!r}; choose one of {', '.join(FORMATS)}")
    for location in (src, dst):
        if is_remote_url(location):
            raise InvalidInputError(f"convert works on local paths; copy {location} to local disk first")
    src_format = detect_format(src)
    if src_format == to:
        raise InvalidInputError(f"{src} is already a {to} checkpoint; copy it instead")
    budget = parse_size(memory_budget) if isinstance(memory_budget, str) else int(memory_budget)
    if budget <= 0:
        raise InvalidInputError(f"memory budget must be positive, not {memory_budget!r}")
    _refuse_overlap(Path(src), Path(dst))
    _prepare_destination(Path(dst), to, overwrite)
    result = ConvertResult(os.fspath(src), os.fspath(dst), src_format, to)
    if src_format == "torch":
        _from_torch_file(Path(src), Path(dst), to, result)
    elif to == "torch":
        _to_torch_file(_reader_for(src_format, src), Path(dst), budget, result, progress)
    else:
        _copy_chunks(_reader_for(src_format, src), _writer_for(to, dst), budget, result, progress)
    result.seconds = round(time.perf_counter() - started, 6)
    return result


# --------------------------------------------------------------------------- endpoints


def _reader_for(fmt: str, path: str | os.PathLike) -> StorageReader:
    # allow_pickle only makes NVMeReader hand over the stored bytes as they are: _GroupPlanner
    # keeps them as bytes, and --to torch decodes them with the weights-only unpickler itself.
    # A stock checkpoint's .metadata is a pickle: reading it trusts the source, as dcp.load does.
    if fmt in ("hf", "safetensors"):
        return SafetensorsReader(path)
    return NVMeReader(path, allow_pickle=True) if fmt == "nvme" else FileSystemReader(path)


def _writer_for(fmt: str, path: str | os.PathLike) -> StorageWriter:
    # the destination was checked (and cleared, with overwrite) by _prepare_destination
    return NVMeWriter(path) if fmt == "nvme" else FileSystemWriter(path, overwrite=False)


def _refuse_overlap(src: Path, dst: Path) -> None:
    """--overwrite clears the destination first: it must not be, hold or sit inside the source."""
    a, b = src.resolve(), dst.resolve()
    if a == b or a.is_relative_to(b) or b.is_relative_to(a):
        raise InvalidInputError(f"{dst} overlaps {src}: write the converted checkpoint somewhere else")


def _prepare_destination(dst: Path, to: str, overwrite: bool) -> None:
    if to == "torch":
        if dst.is_dir():
            raise IsADirectoryError(f"{dst} is a directory; --to torch writes one file")
        if dst.exists() and not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
        return
    if dst.is_file():
        raise NotADirectoryError(f"{dst} is a file; --to {to} writes a directory")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{dst} is not empty; pass --overwrite to replace its contents")
        shutil.rmtree(dst)


# --------------------------------------------------------------------------- chunked copy


class _GroupPlanner(LoadPlanner, SavePlanner):
    """Holds one group's data: tensors read into fresh buffers, bytes kept raw."""

    def __init__(self) -> None:
        self.tensors: dict[MetadataIndex, torch.Tensor] = {}
        self.raw: dict[str, bytes] = {}

    # LoadPlanner: where each ReadItem lands
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.tensors[read_item.storage_index]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read straight into the buffer resolve_tensor returned

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw[read_item.storage_index.fqn] = value.getvalue()

    # SavePlanner: what each WriteItem holds
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.raw[write_item.index.fqn])
        return self.tensors[write_item.index]

    # the rest of both protocols is DCP's planning, which this converter does itself
    def set_up_planner(self, *args: Any, **kwargs: Any) -> None: ...
    def create_local_plan(self) -> Any: ...
    def create_global_plan(self, plans: Any) -> Any: ...
    def finish_plan(self, plan: Any) -> Any: ...


@dataclass(frozen=True)
class _Entry:
    """One stored chunk (or non-tensor item), as both a ReadItem and a WriteItem."""

    fqn: str
    chunk: ChunkStorageMetadata | None
    meta: TensorStorageMetadata | None

    @property
    def index(self) -> MetadataIndex:
        return MetadataIndex(self.fqn, self.chunk.offsets if self.chunk else None)

    @property
    def tensor(self) -> TensorStorageMetadata:
        """The tensor's metadata (asked only of an entry with a chunk: a tensor's)."""
        assert self.meta is not None  # _entries gives every chunk its tensor's metadata
        return self.meta

    @property
    def nbytes(self) -> int:
        if self.chunk is None:
            return 0
        return _numel(self.chunk.sizes) * torch.empty((), dtype=self.tensor.properties.dtype).element_size()

    def read_item(self) -> ReadItem:
        if self.chunk is None:
            zero = torch.Size([0])
            return ReadItem(LoadItemType.BYTE_IO, self.index, zero, self.index, zero, zero)
        zeros = torch.Size([0] * len(self.chunk.sizes))
        return ReadItem(LoadItemType.TENSOR, self.index, zeros, self.index, zeros, self.chunk.sizes)

    def write_item(self) -> WriteItem:
        if self.chunk is None:
            return WriteItem(self.index, WriteItemType.BYTE_IO)
        whole = tuple(self.chunk.sizes) == tuple(self.tensor.size)
        return WriteItem(self.index, WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                         tensor_data=TensorWriteData(self.chunk, self.tensor.properties, self.tensor.size))


def _numel(sizes: Sequence[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _entries(metadata: Metadata) -> list[_Entry]:
    entries = []
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            entries.append(_Entry(fqn, None, None))
        else:
            entries.extend(_Entry(fqn, chunk, meta) for chunk in meta.chunks)
    return entries


def _groups(entries: list[_Entry], budget: int) -> Iterator[list[_Entry]]:
    """Consecutive entries whose tensor bytes stay within ``budget`` (a bigger chunk goes alone)."""
    group: list[_Entry] = []
    held = 0
    for entry in entries:
        if group and held + entry.nbytes > budget:
            yield group
            group, held = [], 0
        group.append(entry)
        held += entry.nbytes
    if group:
        yield group


def _read_group(reader: StorageReader, group: list[_Entry]) -> _GroupPlanner:
    planner = _GroupPlanner()
    for entry in group:
        if entry.chunk is not None:
            planner.tensors[entry.index] = torch.empty(tuple(entry.chunk.sizes), dtype=entry.tensor.properties.dtype)
    reader.read_data(LoadPlan([entry.read_item() for entry in group]), planner).wait()
    return planner


def _open_reader(reader: StorageReader) -> Metadata:
    reader.reset()
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    return metadata


def _bar(entries: list[_Entry], progress: bool) -> Any:
    return progress_bar(sum(e.nbytes for e in entries), progress, "convert")


def _copy_chunks(reader: StorageReader, writer: StorageWriter, budget: int, result: ConvertResult,
                 progress: bool = False) -> None:
    """Drive both storage classes as DCP would, each memory-budget group acting as one rank."""
    metadata = _open_reader(reader)
    entries = _entries(metadata)
    groups = list(_groups(entries, budget)) or [[]]  # an empty checkpoint: one empty rank
    with _bar(entries, progress) as bar:
        results = _write_groups(reader, writer, groups, result, bar)
    out = Metadata(state_dict_metadata=metadata.state_dict_metadata, planner_data=metadata.planner_data,
                   version=metadata.version)
    writer.finish(out, results)
    result.groups = len(groups)
    result.tensors = sum(isinstance(m, TensorStorageMetadata) for m in metadata.state_dict_metadata.values())
    result.objects = len(metadata.state_dict_metadata) - result.tensors


def _write_groups(reader: StorageReader, writer: StorageWriter, groups: list[list[_Entry]],
                  result: ConvertResult, bar: Any) -> list[Any]:
    """Each group read, then written as one rank's plan; the writers' results, per group."""
    writer.reset()
    writer.set_up_storage_writer(True)
    plans = [writer.prepare_local_plan(SavePlan([e.write_item() for e in group])) for group in groups]
    plans = writer.prepare_global_plan(plans)
    results = []
    for group, plan in zip(groups, plans):
        planner = _read_group(reader, group)
        results.append(writer.write_data(plan, planner).wait())
        group_bytes = sum(e.nbytes for e in group)
        result.largest_group_bytes = max(result.largest_group_bytes, group_bytes)
        result.tensor_bytes += group_bytes
        bar.update(group_bytes)
        del planner  # this group's buffers go before the next group's are allocated
    return results


# --------------------------------------------------------------------------- torch.save files


def _from_torch_file(src: Path, dst: Path, to: str, result: ConvertResult) -> None:
    try:
        state = torch.load(src, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError... for a file it refuses
        raise InvalidInputError(f"{src}: cannot open as a torch.save file of tensors and plain values "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                         "files holding pickled classes are not converted") from None
    if not isinstance(state, dict):
        raise InvalidInputError(f"{src} holds a {type(state).__name__}, not a state dict (a dict)")
    writer = _writer_for(to, dst)
    dcp.save(state, storage_writer=writer, no_dist=True)  # DCP's own flattening: dcp.load finds the keys
    metadata = _open_reader(_reader_for(to, dst))
    _count(metadata, result)
    result.groups = 1


def _to_torch_file(reader: StorageReader, dst: Path, budget: int, result: ConvertResult,
                   progress: bool = False) -> None:
    metadata = _open_reader(reader)
    entries = _entries(metadata)
    full: dict[str, Any] = {
        fqn: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)
    }
    with _bar(entries, progress) as bar:
        for group in _groups(entries, budget):  # chunks read a group at a time, then placed
            planner = _read_group(reader, group)
            for entry in group:
                if entry.chunk is None:
                    full[entry.fqn] = _unpickle_plain(entry.fqn, planner.raw[entry.fqn])
                else:
                    _region(full[entry.fqn], entry.chunk).copy_(planner.tensors[entry.index])
            bar.update(sum(e.nbytes for e in group))
    state = _nest(full, metadata.planner_data)
    temp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        torch.save(state, temp)
        os.replace(temp, dst)  # the file appears whole or not at all
    finally:
        temp.unlink(missing_ok=True)
    _count(metadata, result)
    result.groups = 1
    result.largest_group_bytes = result.tensor_bytes  # torch.save holds the whole state at once


def _region(tensor: torch.Tensor, chunk: ChunkStorageMetadata) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
        tensor = tensor.narrow(dim, offset, size)
    return tensor


def _unpickle_plain(fqn: str, raw: bytes) -> Any:
    """A non-tensor item's value, through torch's restricted unpickler only."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise InvalidInputError(f"item {fqn!r} is a pickled object that torch's restricted unpickler refuses "
                         f"({type(exc).__name__}); only tensors and plain Python values convert to a "
                         "torch.save file (convert to dcp or nvme to keep it as bytes)") from None


def _nest(flat: dict[str, Any], planner_data: Any) -> dict[str, Any]:
    """The state dict as it was saved: DCP's flattening mappings (fqn -> path) undone."""
    if not isinstance(planner_data, dict) or not planner_data:
        return flat
    nested: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = planner_data.get(fqn)
        if not isinstance(path, (tuple, list)) or not path:
            nested[fqn] = value
            continue
        _set_path(nested, list(path), value)
    return nested


def _set_path(root: dict[str, Any], path: list[Any], value: Any) -> None:
    node: Any = root
    for key, next_key in zip(path, path[1:]):
        empty: Any = [] if isinstance(next_key, int) else {}
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = empty
            node = node[key]
        else:
            node = node.setdefault(key, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _count(metadata: Metadata, result: ConvertResult) -> None:
    tensors = [m for m in metadata.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
    result.tensors = len(tensors)
    result.objects = len(metadata.state_dict_metadata) - len(tensors)
    if not result.tensor_bytes:
        result.tensor_bytes = sum(
            _numel(m.size) * torch.empty((), dtype=m.properties.dtype).element_size() for m in tensors)
