"""NVMeLoadPlanner: DCP's DefaultLoadPlanner, finding each local shard's saved chunks through
an interval index instead of scanning every chunk of every tensor.

Under FSDP a tensor saved by N ranks has N chunks and each rank loads one shard of it, so
DefaultLoadPlanner looks at every chunk of every tensor on every rank (all N x tensors of them).
Here each tensor's chunks are sorted once by their start along the most-cut dimension
(``format.metadata_view.ChunkIndex``): a shard finds those that meet it by binary search and a
filter of the few in between. Over a dcp_nvme checkpoint the index is built from the index
columns, so no ChunkStorageMetadata is made for a chunk the rank does not load; over any other
Metadata (e.g. FileSystemReader's) it is built from the chunk lists. The plan holds the same
ReadItems as DefaultLoadPlanner's."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from dcp_nvme.compat import resolve
from dcp_nvme.format.metadata_view import ChunkIndex, IndexedTensorMetadata
from dcp_nvme.format.tables import gc_paused

# DefaultLoadPlanner's own helpers (private to torch: listed in compat.PRIVATE_NAMES)
_HELPERS = "torch.distributed.checkpoint.planner_helpers"
_create_chunk_list = resolve(f"{_HELPERS}._create_chunk_list")
_create_read_item_for_tensor = resolve(f"{_HELPERS}._create_read_item_for_tensor")
_create_read_items = resolve(f"{_HELPERS}._create_read_items")
flatten_state_dict = resolve("torch.distributed.checkpoint._nested_dict.flatten_state_dict")
_version = resolve("torch.distributed.checkpoint._version")


class NVMeLoadPlanner(DefaultLoadPlanner):
    """A drop-in for ``DefaultLoadPlanner`` (same arguments, same plan), for any storage reader:
    ``dcp.load(state_dict, storage_reader=NVMeReader(path), planner=NVMeLoadPlanner())``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._indexes: dict[int, tuple[TensorStorageMetadata, ChunkIndex]] = {}

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("self.metadata is not None")
        if self.flatten_state_dict:
            self._use_old_keys_if_needed()
        with gc_paused():
            return LoadPlan(self._read_items(not self.allow_partial_load))

    def _use_old_keys_if_needed(self) -> None:
        """DefaultLoadPlanner's rule for checkpoints saved before torch 2.4 (their keys)."""
        assert self.metadata is not None  # create_local_plan checked it
        missing = set(self.metadata.state_dict_metadata) - set(self.state_dict)
        if missing:
            _version._derived_version = "2_3"
            old_state_dict, old_mappings = flatten_state_dict(self.original_state_dict)
            if set(old_state_dict) & missing:
                self.state_dict, self.mappings = old_state_dict, old_mappings
            _version._derived_version = None

    def _read_items(self, strict: bool) -> list[ReadItem]:
        """``create_default_local_load_plan``, with the saved chunks found by index."""
        assert self.metadata is not None  # create_local_plan checked it
        requests: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            if fqn not in self.metadata.state_dict_metadata:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None \
                    and md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # this rank is not in the tensor's mesh
            if isinstance(md, TensorStorageMetadata):
                requests += self._tensor_reads(fqn, md, obj)
            else:
                requests += _create_read_items(fqn, md, obj)
        return requests

    def _index(self, md: TensorStorageMetadata) -> ChunkIndex:
        if isinstance(md, IndexedTensorMetadata):
            return md.index()
        got = self._indexes.get(id(md))
        if got is None or got[0] is not md:
            got = self._indexes[id(md)] = (md, ChunkIndex.from_chunks(md.chunks, len(md.size)))
        return got[1]

    def _tensor_reads(self, fqn: str, md: TensorStorageMetadata, obj: Any) -> list[ReadItem]:
        try:
            local_chunks = _create_chunk_list(obj)
        except ValueError as ex:
            raise ValueError(f"Invalid checkpoint metadata for {fqn}, "
                             f"expected BytesStorageMetadata but found {type(md)}") from ex
        index = self._index(md)
        if not local_chunks or not index.count:
            return []
        items = []
        for local_idx, local in enumerate(local_chunks):
            l_off, l_size = tuple(local.offsets), tuple(local.sizes)
            positions = index.meeting(l_off, l_size)
            offsets, sizes = (b.tolist() for b in index.box(positions)) if index.dims else ([()] * len(positions),) * 2
            for position, s_off, s_size in zip(positions.tolist(), offsets, sizes):
                storage_offsets, dest_offsets, lengths = [], [], []
                for lo_l, n_l, lo_s, n_s in zip(l_off, l_size, s_off, s_size):
                    lo = max(lo_l, lo_s)
                    storage_offsets.append(lo - lo_s)
                    dest_offsets.append(lo - lo_l)
                    lengths.append(min(lo_l + n_l, lo_s + n_s) - lo)
                items.append(_create_read_item_for_tensor(
                    dest_index=MetadataIndex(fqn, local.offsets, local_idx), dest_offsets=dest_offsets,
                    storage_index=MetadataIndex(fqn, torch.Size(s_off), position),
                    storage_offsets=storage_offsets, lengths=lengths))
        return items
