"""What every row needs: the state on this rank, fresh directories, eviction, timed repeats, checks."""

from __future__ import annotations

import functools
import gc
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any, TypedDict

import torch

from dcp_nvme.bench.group import Group
from dcp_nvme.bench.records import BenchOptions, Row, Skip
from dcp_nvme.bench.synthetic import ModelSpec, build_state, llama_spec
from dcp_nvme.config import resolve_config
from dcp_nvme.engines.host_io import tensor_bytes
from dcp_nvme.errors import BenchError
from dcp_nvme.host.job import budgeted
from dcp_nvme.observe.machine import cached_fraction, evict_from_page_cache, files_under


class IOKwargs(TypedDict, total=False):
    """The I/O options the rows hand NVMeWriter/NVMeReader (``read_mode`` is the reader's)."""

    queue_depth: int
    block_size: int
    direct_io: bool
    engine: str
    read_mode: str
    node_queue_depth: int | None
    node_write_order: str


class BenchCore:
    """The state of one run on one rank and the helpers the rows share. Rank 0 keeps the results."""

    def __init__(self, options: BenchOptions, group: Group, root: str) -> None:
        self.options, self.group, self.root = options, group, root
        self.config = resolve_config(queue_depth=options.queue_depth, block_size=options.block_size,
                                     direct_io=options.direct_io, engine="posix",
                                     node_queue_depth=options.node_queue_depth,
                                     node_write_order=options.node_write_order)
        self.io_kwargs: IOKwargs = {"queue_depth": self.config.queue_depth, "block_size": self.config.block_size,
                          "direct_io": self.config.direct_io}
        # every bench rank runs on this node: the node budget splits over all of them
        self.writer_kwargs: IOKwargs = {**self.io_kwargs, "node_queue_depth": self.config.node_queue_depth,
                              "node_write_order": self.config.node_write_order}
        self.device_config = budgeted(self.config, group.world)
        """What each rank of a save keeps in flight; fio's jobs and the engine probe use the same."""
        self.spec: ModelSpec = llama_spec(options.size, options.optim)
        self.local = build_state(self.spec, group.rank, group.world, options.seed)
        self.local_bytes = sum(t.nbytes for t in self.local.values())
        self.total_bytes = sum(group.gather(self.local_bytes))
        self.state = self._wrap(self.local)
        self.rows: list[Row] = []
        self.kept: dict[str, str] = {}  # checkpoint kind -> directory of its last save
        self.dcp_stats: dict[str, Any] = {}
        self.eviction = ""
        self.cached_after_eviction: list[float] = []

    def _wrap(self, local: dict[str, torch.Tensor], spec: ModelSpec | None = None) -> dict[str, Any]:
        """DTensors sharded by rows over all ranks (so DCP writes each shard once), or as is."""
        if not self.group.is_dist:
            return local
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        if not hasattr(self, "_mesh"):
            self._mesh = init_device_mesh("cpu", (self.group.world,))
        wrapped = {}
        for tensor in (spec or self.spec).tensors:
            shape = torch.Size(tensor.shape)
            wrapped[tensor.fqn] = DTensor.from_local(local[tensor.fqn], self._mesh, [Shard(0)], run_check=False,
                                                     shape=shape, stride=contiguous_stride(shape))
        return wrapped

    def _fresh(self, kind: str) -> str:
        path = os.path.join(self.root, f"{kind}-{uuid.uuid4().hex[:6]}" if self.group.rank == 0 else "")
        path = self.group.gather(path)[0]  # every rank uses rank 0's name
        if self.group.rank == 0:
            os.makedirs(path)
        self.group.barrier()
        return path

    def _drop(self, path: str) -> None:
        self.group.barrier()
        if self.group.rank == 0 and os.path.exists(path):
            shutil.rmtree(path)
            os.sync()  # the freed extents are settled before the next timed step
        self.group.barrier()

    def _evict(self, path: str) -> None:
        paths = files_under(path) if os.path.isdir(path) else [path]
        self.group.barrier()
        if self.group.rank == 0:
            self.eviction = evict_from_page_cache(paths)
            fraction = cached_fraction(paths)
            if fraction is not None:
                self.cached_after_eviction.append(fraction)
        self.group.barrier()

    def _dcp(self):
        import torch.distributed.checkpoint as dcp

        return dcp

    def _zero_dest(self) -> dict[str, Any]:
        if not hasattr(self, "_dest_local"):
            self._dest_local = {k: torch.zeros_like(v) for k, v in self.local.items()}
            self._dest = self._wrap(self._dest_local)
        else:
            for value in self._dest_local.values():
                value.zero_()
        return self._dest

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def _repeat_saves(self, row: Row, kind: str, save: Callable[[str], Any], keep: bool) -> list[Any]:
        """Run a save ``repeat`` times, each into a fresh directory; keep the last if asked."""
        results = []
        for attempt in range(self.options.repeat):
            path = self._fresh(kind)
            seconds, result = self.group.timed(functools.partial(save, path))
            row.seconds.append(seconds)
            results.append(result)
            if keep and attempt == self.options.repeat - 1:
                self.kept[kind] = path
            else:
                self._drop(path)
        row.bytes = self.total_bytes
        return results

    def _repeat_loads(self, row: Row, kind: str, load: Callable[[str], Any]) -> list[Any]:
        path = self.kept.get(kind)
        if path is None:
            raise Skip(f"no {kind} checkpoint (its save did not run)")
        results = []
        for _ in range(self.options.repeat):
            self._evict(path)
            seconds, result = self.group.timed(lambda: load(path))
            row.seconds.append(seconds)
            results.append(result)
            gc.collect()
        row.bytes = self.total_bytes
        return results

    def _per_rank_file(self, path: str, suffix: str) -> str:
        return os.path.join(path, f"rank_{self.group.rank:05d}.{suffix}")

    def _check(self, row: Row, loaded: dict[str, torch.Tensor]) -> None:
        identical = all(self.group.gather(same_state(self.local, loaded)))
        row.extra["identical"] = identical
        if not identical:
            raise BenchError(f"{row.label}: the loaded state differs from the saved one")


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical dictionaries (bf16/fp32 compared as their bytes, so NaNs cannot lie)."""
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if hasattr(other, "to_local"):
            other = other.to_local()
        if hasattr(value, "to_local"):
            value = value.to_local()
        if value.shape != other.shape or value.dtype != other.dtype:
            return False
        if value.numel() and not torch.equal(tensor_bytes(value.contiguous()), tensor_bytes(other.contiguous())):
            return False
    return True


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= dim
    return tuple(reversed(stride))
