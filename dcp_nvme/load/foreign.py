"""Checkpoints dcp_nvme did not write, loaded through NVMeReader and the tools: a Hugging Face
model directory or a single ``.safetensors`` file (``SafetensorsReader``: DCP's planner
reshards it like any checkpoint; chunks torch's HuggingFaceStorageWriter wrote per rank are
placed by their ``DCP_SHARDING_INFO``), and a stock DCP checkpoint (FileSystemWriter's
``.metadata`` is a pickle: read only when the caller allows pickle). What each file says is
checked in ``format.safetensors_files`` before use, the layout as a whole (every tensor tiled
by its chunks) before any data is read. These files carry no checksums: what is read is what is
there. A slice that is one byte range of its chunk and a contiguous destination of its dtype
(the common case: a whole tensor) is read straight into the destination, with no copy between.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_nvme.errors import CheckpointNotFoundError, InvalidInputError, ManifestError
from dcp_nvme.format.container import DCP_METADATA, parse_dtype
from dcp_nvme.format.safetensors_files import (
    HF_DIR,
    SAFETENSORS_FILE,
    STOCK_DCP,
    StoredChunk,
    check_layout,
    hf_files,
    open_shard,
    scan_file,
    what_is,
)


def stock_dcp_refusal(location: str) -> str:
    return (f"{location} is {STOCK_DCP} (FileSystemWriter's {DCP_METADATA}, a pickle): NVMeReader reads it "
            "only with NVMeReader(path, allow_pickle=True), which runs any code that pickle holds; pass it "
            "for a checkpoint you trust, load it with torch's FileSystemReader, or convert it once: "
            f"dcp-nvme convert {location} OUT --to nvme")


def open_foreign(path: str | os.PathLike, allow_pickle: bool) -> StorageReader | None:
    """The reader of what ``path`` holds when it is not a dcp_nvme checkpoint, None otherwise."""
    location = os.fspath(path)
    kind = what_is(location)
    if kind == STOCK_DCP:
        if not allow_pickle:
            # a FileNotFoundError, as before: no checkpoint of ours here
            raise CheckpointNotFoundError(stock_dcp_refusal(location))
        return FileSystemReader(location)
    return SafetensorsReader(location) if kind is not None else None


class SafetensorsReader(StorageReader):
    """DCP's StorageReader over safetensors files: a Hugging Face model directory or one file.

    Tensors only (safetensors holds nothing else); chunks written by torch's
    HuggingFaceStorageWriter(save_distributed=True) are placed by their ``DCP_SHARDING_INFO``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.kind = what_is(self.path)
        if self.kind not in (HF_DIR, SAFETENSORS_FILE):
            raise InvalidInputError(f"{self.path} is neither {HF_DIR} nor {SAFETENSORS_FILE}")
        self.chunks: dict[MetadataIndex, StoredChunk] = {}
        self.load_id = ""

    def files(self) -> list[str]:
        return hf_files(self.path, self.kind)

    def scan(self) -> list[StoredChunk]:
        """Every entry of every file, checked (``scan_file``)."""
        return [chunk for file in self.files() for chunk in scan_file(file)]

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.__init__(checkpoint_id)  # type: ignore[misc]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        chunks = self.scan()
        shapes = check_layout(chunks, self.path)  # the layout as a whole, before any read
        tensors: dict[str, TensorStorageMetadata] = {}
        self.chunks = {}
        for chunk in chunks:
            index = MetadataIndex(chunk.fqn, chunk.offsets)
            self.chunks[index] = chunk  # check_layout refused two chunks at the same offsets
            meta = tensors.get(chunk.fqn)
            if meta is None:
                meta = tensors[chunk.fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=parse_dtype(chunk.dtype, chunk.file)), torch.Size(shapes[chunk.fqn]), [])
            meta.chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.shape)))
        self.load_id = self.load_id or os.urandom(8).hex()
        return Metadata(state_dict_metadata=dict(tensors), storage_meta=StorageMeta(load_id=self.load_id))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self.chunks:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[tuple[ReadItem, StoredChunk]]] = {}
        for item in plan.items:
            chunk = self.chunks.get(item.storage_index)
            if item.type == LoadItemType.BYTE_IO or chunk is None:
                raise InvalidInputError(f"{self.path} holds tensors only; it has no {item.storage_index.fqn!r} "
                                        "as the state dict asks (a non-tensor value, or another checkpoint's name)")
            by_file.setdefault(chunk.file, []).append((item, chunk))
        for file, items in by_file.items():
            fd = open_shard(file)
            try:
                for item, chunk in sorted(items, key=lambda pair: pair[1].start):
                    target = planner.resolve_tensor(item).detach()
                    if tuple(target.shape) != tuple(item.lengths):
                        raise ManifestError(f"{file}: {chunk.fqn!r}: the planner asked for {tuple(target.shape)}, "
                                            f"the slice is {tuple(item.lengths)}")
                    span = _byte_range(chunk, item)
                    dtype = parse_dtype(chunk.dtype, file)
                    if span is not None and target.dtype == dtype and target.device.type == "cpu" \
                            and target.is_contiguous():
                        _read_into(fd, file, chunk, span, _bytes_of(target))  # no buffer between
                    else:
                        data = bytearray(chunk.nbytes)
                        _read_into(fd, file, chunk, (chunk.start, chunk.nbytes), memoryview(data))
                        stored = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                        value = stored.view(dtype).reshape(chunk.shape)
                        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                            value = value.narrow(dim, offset, length)
                        target.copy_(value)
                    planner.commit_tensor(item, target)
            finally:
                os.close(fd)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return what_is(checkpoint_id) in (HF_DIR, SAFETENSORS_FILE)


def _byte_range(chunk: StoredChunk, item: ReadItem) -> tuple[int, int] | None:
    """(file offset, length) of the slice ``item`` asks of ``chunk`` when it is one byte range
    (dims after some dim whole, dims before it of length one); None otherwise."""
    shape, offsets, lengths = chunk.shape, tuple(item.storage_offsets), tuple(item.lengths)
    count = 1
    for n in lengths:
        count *= n
    elements = 1
    for n in shape:
        elements *= n
    itemsize = chunk.nbytes // elements if elements else 0
    dim = len(shape)
    while dim > 0 and offsets[dim - 1] == 0 and lengths[dim - 1] == shape[dim - 1]:
        dim -= 1
    if any(n != 1 for n in lengths[:max(dim - 1, 0)]):
        return None
    start, stride = 0, itemsize
    for d in reversed(range(len(shape))):
        start += offsets[d] * stride
        stride *= shape[d]
    return chunk.start + start, count * itemsize


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.reshape(-1)
    # numpy's buffer stub before 3.12
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(bytearray())  # type: ignore[arg-type]


def _read_into(fd: int, file: str, chunk: StoredChunk, span: tuple[int, int], into: memoryview) -> None:
    offset, length = span
    total = 0
    while total < length:
        got = os.preadv(fd, [into[total:length]], offset + total)
        if got == 0:
            raise ManifestError(f"{file}: {chunk.fqn!r} ends past the end of the file (truncated?)")
        total += got
