"""The resharded load's geometry and planner, and the byte counter it is judged by."""

from __future__ import annotations

import torch

from dcp_nvme.bench.synthetic import shard_rows
from dcp_nvme.errors import BenchError

RESHARD_SPLIT = 4
"""The resharded load needs 1/RESHARD_SPLIT of every saved chunk (see ``reshard_rows``)."""


def reshard_rows(rows: int, world: int) -> int:
    """Rows the resharded load needs: rank 0's block when the saved layout (``world`` row shards)
    is re-split RESHARD_SPLIT times finer, i.e. a quarter of every saved chunk."""
    return shard_rows(rows, 0, world * RESHARD_SPLIT)[1]


def row_block_planner():
    """A DCP load planner that loads rows [0, n) of every tensor into tensors of that shape.

    The read items are DCP's own (``create_read_items_for_chunk_list``), exactly those a DTensor
    Shard(0) rank would ask for: the storage layer sees a real resharded load.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RowBlockPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            assert self.metadata is not None  # set_up_planner gave it
            items = []
            for fqn, dest in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * dest.dim()), sizes=dest.shape)
                saved = self.metadata.state_dict_metadata[fqn]
                if not isinstance(saved, TensorStorageMetadata):
                    raise BenchError(f"reshard planner: {fqn} is saved as {type(saved).__name__}, not a "
                                     "tensor; load only tensors with it")
                items += create_read_items_for_chunk_list(fqn, saved, [chunk])
            return LoadPlan(items)

    return RowBlockPlanner()


def rchar() -> int | None:
    """Bytes this process asked the kernel to read so far (``/proc/self/io``), or None."""
    try:
        with open("/proc/self/io") as handle:
            for line in handle:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
