"""Checkpoints dcp_nvme did not write, loaded through NVMeReader and the tools: a Hugging Face
model directory or a single ``.safetensors`` file (``SafetensorsReader``: DCP's planner
reshards it like any checkpoint; chunks torch's HuggingFaceStorageWriter wrote per rank are
placed by their ``DCP_SHARDING_INFO``), and a stock DCP checkpoint (FileSystemWriter's
``.metadata`` is a pickle: read only when the caller allows pickle). What each file says is
checked in ``format.safetensors_files`` before use. These files carry no checksums: what is
read is what is there.
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
    hf_files,
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
        tensors: dict[str, TensorStorageMetadata] = {}
        self.chunks = {}
        for chunk in self.scan():
            index = MetadataIndex(chunk.fqn, chunk.offsets)
            if index in self.chunks:
                raise ManifestError(f"{self.path}: {chunk.fqn!r} at offsets {list(chunk.offsets)} is in both "
                                    f"{self.chunks[index].file} and {chunk.file}")
            self.chunks[index] = chunk
            dtype = parse_dtype(chunk.dtype, chunk.file)
            meta = tensors.get(chunk.fqn)
            if meta is None:
                meta = tensors[chunk.fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype),
                                                                  torch.Size(chunk.shape), [])
            elif meta.properties.dtype != dtype or len(meta.size) != len(chunk.shape):
                raise ManifestError(f"{chunk.file}: {chunk.fqn!r} is {chunk.dtype} of {len(chunk.shape)} dims "
                                    f"here, {meta.properties.dtype} of {len(meta.size)} dims in another file")
            meta.chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.shape)))
            meta.size = torch.Size(max(s, o + n) for s, o, n in zip(meta.size, chunk.offsets, chunk.shape))
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
            with open(file, "rb") as f:
                for item, chunk in sorted(items, key=lambda pair: pair[1].start):
                    f.seek(chunk.start)
                    data = bytearray(f.read(chunk.nbytes))
                    if len(data) != chunk.nbytes:
                        raise ManifestError(f"{file}: {chunk.fqn!r} ends past the end of the file (truncated?)")
                    stored = (torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8))
                    value = stored.view(parse_dtype(chunk.dtype, file)).reshape(chunk.shape)
                    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        value = value.narrow(dim, offset, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != value.shape:
                        raise ManifestError(f"{file}: {chunk.fqn!r}: the planner asked for {tuple(target.shape)}, "
                                            f"the slice is {tuple(value.shape)}")
                    target.copy_(value)
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return what_is(checkpoint_id) in (HF_DIR, SAFETENSORS_FILE)
