"""One bench run: the steps in order on every rank, the results document, and the processes."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from dcp_nvme.bench.datapath import DataPathRows
from dcp_nvme.bench.device import fio_version
from dcp_nvme.bench.group import Group, free_port
from dcp_nvme.bench.layers import LayerRows
from dcp_nvme.bench.peers import PeerRows
from dcp_nvme.bench.records import BenchOptions, Row, Skip
from dcp_nvme.bench.rows import OursRows
from dcp_nvme.bench.synthetic import ModelSpec, llama_spec
from dcp_nvme.bench.targets import check_targets, compute_ratios
from dcp_nvme.config import default_tune_file
from dcp_nvme.errors import InvalidInputError, StorageError
from dcp_nvme.humanize import format_size, progress_bar
from dcp_nvme.observe.machine import machine_info


class Bench(OursRows, DataPathRows, PeerRows, LayerRows):
    """The rows of one run, on one rank. Rank 0 keeps the results."""

    def steps(self) -> list[tuple[str, Callable[[], None]]]:
        budget = [("dcp_nvme save, per-rank depth", self.per_rank_depth_save),
                  ("dcp_nvme save, the other write order", self.other_order_save)] if (
            self.config.node_queue_depth is not None and self.group.world > 1) else []
        return [
            ("warm-up", self.warm_up),
            ("memory copy floor", self.memory_floor),
            ("device limit", self.device_limit),
            ("dcp_nvme save", self.ours_save),
            *budget,
            ("dcp_nvme async save", self.ours_async),
            ("dcp_nvme async save, max_bytes=half", self.bounded_async),
            ("FileSystemWriter", self.fs_saves),
            ("torch.save", self.torch_save),
            ("safetensors save", self.safetensors_save),
            ("dcp_nvme load", self.ours_load),
            ("read modes", self.read_modes),
            ("engines: threads vs io_uring", self.engines_cpu),
            ("FileSystemReader", self.fs_load),
            ("torch.load", self.torch_load),
            ("safetensors load", self.safetensors_load),
            ("resharded load", self.reshard),
        ]

    def run(self) -> dict[str, Any]:
        # single-process DCP calls warn that no process group exists; that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self.start_layers()
        bar = progress_bar(len(self.steps()), self.options.progress and self.group.rank == 0, unit="step")
        try:
            for name, step in self.steps():
                bar.set_description(f"bench: {name}")
                count = len(self.rows)
                try:
                    step()
                except Skip as skip:
                    for row in self.rows[count:]:
                        if not row.seconds and not row.skipped:
                            row.skipped = str(skip)
                except Exception as exc:  # one broken row must not lose the others
                    if self.group.is_dist:
                        raise  # the other ranks would wait in a collective forever
                    for row in self.rows[count:] or [self.add(Row(f"error.{name}", name, "error", "peer"))]:
                        row.error = f"{type(exc).__name__}: {exc}"
                gc.collect()
                bar.update(1)
        finally:
            bar.close()
        return self.document()

    def document(self) -> dict[str, Any]:
        options = asdict(self.options)
        fio = fio_version()
        doc: dict[str, Any] = {
            "format": "dcp_nvme.bench", "format_version": 1, "created_unix": time.time(),
            "config": {
                "size_requested": self.options.size, "state_bytes": self.total_bytes,
                "bytes_per_rank": self.group.gather(self.local_bytes), "ranks": self.group.world,
                "optim": self.options.optim, "model": _model_doc(self.spec),
                "io": {**self.io_kwargs, "checksum_block": self.config.checksum_block,
                       "node_queue_depth": self.config.node_queue_depth,
                       "per_rank_depth": self.device_config.queue_depth,
                       "source": _config_source(self.options)},
                "repeat": self.options.repeat, "quick": self.options.quick,
                "directory": os.path.abspath(self.options.directory),
                "fio": {"path": shutil.which("fio"), "version": fio} if fio else None,
                "eviction": self.eviction or None,
                "cached_after_eviction_max": max(self.cached_after_eviction) if self.cached_after_eviction else None,
                "options": options,
            },
            "machine": machine_info(self.options.directory),
            "rows": [row.to_dict() for row in self.rows],
            "warmup_seconds": getattr(self, "warmup", {}),
            "dcp_nvme_stats": self.dcp_stats,
        }
        doc["ratios"] = compute_ratios(doc["rows"])
        doc["targets"] = check_targets(doc["ratios"])
        doc["layers"] = self.layers_document(doc["rows"], doc["ratios"])
        return doc


def _config_source(options: BenchOptions) -> str:
    if all(v is not None for v in (options.queue_depth, options.block_size, options.direct_io)):
        return "arguments"
    if any(os.environ.get(f"DCP_NVME_{k}") for k in ("QUEUE_DEPTH", "BLOCK_SIZE", "DIRECT_IO")):
        return "arguments/environment"
    if default_tune_file().is_file():
        return f"tune file {default_tune_file()}"
    return "built-in defaults"


def _model_doc(spec: ModelSpec) -> dict[str, Any]:
    return {"description": spec.describe(), "hidden": spec.hidden, "intermediate": spec.intermediate,
            "layers": spec.layers, "vocab": spec.vocab, "params": spec.params, "tensors": len(spec.tensors),
            "bytes": spec.nbytes}


def _rank_entry(rank: int, world: int, port: int, options: BenchOptions, root: str, result: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        doc = Bench(options, Group(rank, world), root).run()
        if rank == 0:
            with open(result, "w") as handle:
                json.dump(doc, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Run every row; return the results document (also what ``--json`` writes)."""
    if options.ranks < 1:
        raise InvalidInputError("--ranks must be at least 1")
    if options.repeat < 1:
        raise InvalidInputError("--repeat must be at least 1")
    os.makedirs(options.directory, exist_ok=True)
    spec = llama_spec(options.size, options.optim)
    # kept at once: 4 checkpoints (dcp_nvme, FileSystemWriter, torch.save, safetensors) + one in flight
    needed = 6 * spec.nbytes
    free = shutil.disk_usage(options.directory).free
    if free < needed:
        raise StorageError(f"{options.directory} has {format_size(free)} free; a {format_size(spec.nbytes)} bench "
                      f"needs about {format_size(needed)} (6 copies); use a smaller --size or another --dir")
    root = os.path.join(options.directory, f"dcp-nvme-bench-{uuid.uuid4().hex[:8]}")
    os.makedirs(root)
    try:
        if options.ranks == 1:
            return Bench(options, Group(0, 1), root).run()
        import multiprocessing

        import torch.multiprocessing as mp

        result = os.path.join(root, "result.json")
        # each rank forked from a server that imported torch and the bench once, not a fresh
        # interpreter per rank: fresh processes all the same (no state of this one), started at once
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed.checkpoint", __name__])
        mp.start_processes(_rank_entry, args=(options.ranks, free_port(), options, root, result),
                           nprocs=options.ranks, join=True, start_method="forkserver")
        with open(result) as handle:
            return json.load(handle)
    finally:
        if options.keep:
            print(f"dcp-nvme bench: checkpoints kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
