"""Rewrite a dcp_nvme checkpoint without the items whose key starts with a prefix.

Megatron's ``dist_checkpointing.remove_sharded_tensors(dir, key_prefix)`` (e.g. dropping the
optimizer state from a checkpoint) lands here through the Megatron load strategy.

How: the kept items are read (every block verified) and saved again to the same path with
``NVMeWriter(overwrite=True)``: the old checkpoint stays loadable until the new ``manifest.json``
commits, and the writer then removes the old files, so the space of the removed items is
reclaimed. Non-tensor items are carried as their stored bytes, never unpickled. The kept tensors
are held in host memory at once (one process, no process group): this is an offline tool for
checkpoints whose kept part fits in RAM.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from dcp_nvme.errors import InvalidInputError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _StoredBytes:
    """A non-tensor item as its stored bytes (a pickle we neither load nor rebuild)."""

    data: bytes = b""


class _RawLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = _StoredBytes(value.read())


class _RawSavePlanner(DefaultSavePlanner):
    def __init__(self, planner_data: Any) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._planner_data = planner_data

    def transform_object(self, write_item, object: Any):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, _StoredBytes):
            return io.BytesIO(object.data)
        return super().transform_object(write_item, object)

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        self.metadata = dataclasses.replace(metadata, planner_data=self._planner_data)
        return plans, self.metadata


def remove_items(path: str | os.PathLike, key_prefix: str, *, reader_factory=None,
                 writer_factory=None) -> list[str]:
    """Remove every item whose key starts with ``key_prefix`` from the dcp_nvme checkpoint at
    ``path``; returns the removed keys (none: the checkpoint is left untouched)."""
    from dcp_nvme import NVMeReader, NVMeWriter

    reader_factory = reader_factory or NVMeReader
    writer_factory = writer_factory or (lambda p: NVMeWriter(p, overwrite=True))
    metadata = reader_factory(path).read_metadata()
    removed = sorted(k for k in metadata.state_dict_metadata if k.startswith(key_prefix))
    if not removed:
        return []
    if len(removed) == len(metadata.state_dict_metadata):
        raise InvalidInputError(f"{path}: every item starts with {key_prefix!r}; remove the checkpoint directory "
                         "instead of emptying it")
    kept: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(key_prefix):
            continue
        if isinstance(entry, TensorStorageMetadata):
            kept[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            kept[key] = _StoredBytes()
    dcp.load(kept, storage_reader=reader_factory(path), planner=_RawLoadPlanner(), no_dist=True)
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):
        planner_data = {k: v for k, v in planner_data.items() if not str(k).startswith(key_prefix)}
    dcp.save(kept, storage_writer=writer_factory(path), planner=_RawSavePlanner(planner_data),
             no_dist=True)
    log.info("dcp_nvme: removed %d item(s) starting with %r from %s", len(removed), key_prefix, path)
    return removed
