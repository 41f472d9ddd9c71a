"""``dcp-nvme bench``: dcp_nvme beside the device limit and the usual ways to save, in one run.

One synthetic Llama-shaped state (``dcp_nvme.synthetic``), one directory, one process per rank:

- the device limit: fio sequential O_DIRECT write and read at the plugin's queue depth and block
  size (the plugin's own engine on an aligned buffer when fio is not installed), and a
  memory-copy floor (memmove into prefaulted memory: what staging a copy costs at best);
- dcp_nvme: sync save, cold load, async save (blocking and total), a resharded load;
- peers: DCP's FileSystemWriter (thread_count 1, 2, 4, 8) and FileSystemReader, torch.save and
  torch.load, safetensors save_file and load_file.

Every save goes to a fresh directory (new files, as real checkpoints are; overwriting a big file
costs the filesystem extra). Saves include fsync for every writer, so all are durable. Before a
load the checkpoint's files are evicted from the page cache (fsync + posix_fadvise DONTNEED:
unprivileged, and only those files) and the report says how, and what share of pages a sampled
non-blocking read still found cached. Every save and load runs once untimed on a 1 MiB state
first, so imports and one-time set-up stay out of the rows.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .config import IOConfig, default_tune_file, parse_size, resolve_config
from .memory import aligned_buffer, tensor_bytes
from .synthetic import ModelSpec, build_state, llama_spec, shard_rows
from .tune import cached_fraction, engine_probe, evict_from_page_cache, files_under, machine_info

FS_THREAD_COUNTS = (1, 2, 4, 8)
RESHARD_SPLIT = 4
"""The resharded load needs 1/RESHARD_SPLIT of every saved chunk (see ``_reshard_rows``)."""

TARGETS = (
    # (name, ratio key, threshold, comparison) -- the issue's targets, checked on every run
    ("sync save >= 0.85 x device write limit", "save_vs_device", 0.85, ">="),
    ("sync save >= 3 x FileSystemWriter(thread_count=1)", "save_vs_fs_t1", 3.0, ">="),
    ("sync save >= 1.5 x best FileSystemWriter thread_count", "save_vs_fs_best", 1.5, ">="),
    ("cold load >= 0.85 x device read limit", "load_vs_device", 0.85, ">="),
    ("cold load >= 1.3 x FileSystemReader", "load_vs_fs", 1.3, ">="),
    ("resharded load reads <= 1.15 x the bytes it needs", "reshard_read_amplification", 1.15, "<="),
)



def _safetensors_load_eager(path: str) -> dict[str, torch.Tensor]:
    """safetensors' load_file with every byte read: its default mmap backend maps tensors lazily
    (2 GiB "loaded" at 2.4 GB/s here with 64 page faults, before any data was read)."""
    from safetensors.torch import load_file

    try:
        return load_file(path, backend="pread")
    except TypeError:  # safetensors < 0.8 has no backend choice: touch every page ourselves
        return {name: tensor.clone() for name, tensor in load_file(path).items()}

class Skip(Exception):
    """A row that cannot run here; the message says why and lands in the report."""


@dataclass
class BenchOptions:
    size: int = 512 << 20
    ranks: int = 1
    directory: str = "."
    optim: bool = False
    queue_depth: int | None = None
    block_size: int | None = None
    direct_io: bool | None = None
    repeat: int = 1
    quick: bool = False
    keep: bool = False
    progress: bool = True
    seed: int = 0


@dataclass
class Row:
    """One measured line of the report."""

    key: str
    label: str
    op: str  # write | read | copy | reshard
    role: str  # ours | peer | limit | floor
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    """Set when the row raised (single-rank runs carry on; the report shows the error)."""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.median / 1e9 if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.update(median_seconds=round(self.median, 6), gbps=round(self.gbps, 4),
                   seconds=[round(s, 6) for s in self.seconds])
        return doc


# --------------------------------------------------------------------------- ranks


class _Group:
    """Collectives when there are several ranks, no-ops for one."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    @property
    def is_dist(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.is_dist:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        if not self.is_dist:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Start every rank together; the slowest rank's seconds (the aggregate's wall time)."""
        self.barrier()
        started = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - started
        return max(self.gather(elapsed)), result


def _rchar() -> int | None:
    """Bytes this process asked the kernel to read so far (``/proc/self/io``), or None."""
    try:
        with open("/proc/self/io") as handle:
            for line in handle:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_torch(state: dict[str, torch.Tensor], path: str) -> str:
    torch.save(state, path)
    _fsync(path)
    return path


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
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


# --------------------------------------------------------------------------- fio


def fio_version() -> str | None:
    if not shutil.which("fio"):
        return None
    try:
        return subprocess.run(["fio", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def fio_sequential(directory: str, nbytes_per_job: int, jobs: int, config: IOConfig) -> dict[str, Any]:
    """fio sequential write then read of ``jobs`` new files, libaio at the engine's depth and size."""
    block = config.block_size
    per_job = max(block, -(-nbytes_per_job // block) * block)
    name = f"fio-{uuid.uuid4().hex[:8]}"
    base = ["fio", f"--name={name}", f"--directory={directory}", f"--bs={block}",
            f"--iodepth={config.queue_depth}", "--ioengine=libaio", f"--direct={int(config.direct_io)}",
            f"--size={per_job}", f"--numjobs={jobs}", "--group_reporting", "--output-format=json"]
    results: dict[str, Any] = {}
    try:
        for op, extra in (("write", ["--rw=write", "--end_fsync=1"]), ("read", ["--rw=read"])):
            if op == "read":
                evict_from_page_cache(files_under(directory))
            command = base + extra
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[-300:]}")
            doc = json.loads(done.stdout[done.stdout.index("{"):])
            stats = doc["jobs"][0][op]
            if not stats["bw_bytes"]:
                raise RuntimeError(f"fio reported no {op} bandwidth")
            results[op] = {"bytes": stats["io_bytes"], "seconds": stats["io_bytes"] / stats["bw_bytes"],
                           "command": " ".join(command), "version": doc.get("fio version"),
                           "lat_p50_ms": _fio_percentile(stats, "50.000000"),
                           "lat_p99_ms": _fio_percentile(stats, "99.000000")}
    finally:
        for path in files_under(directory):
            if os.path.basename(path).startswith(name):
                os.unlink(path)
    return results


def _fio_percentile(stats: dict[str, Any], key: str) -> float | None:
    value = stats.get("clat_ns", {}).get("percentile", {}).get(key)
    return round(value / 1e6, 3) if value else None


# --------------------------------------------------------------------------- resharded load


def _reshard_rows(rows: int, world: int) -> int:
    """Rows the resharded load needs: rank 0's block when the saved layout (``world`` row shards)
    is re-split RESHARD_SPLIT times finer, i.e. a quarter of every saved chunk."""
    return shard_rows(rows, 0, world * RESHARD_SPLIT)[1]


def _row_block_planner():
    """A DCP load planner that loads rows [0, n) of every tensor into tensors of that shape.

    The read items are DCP's own (``create_read_items_for_chunk_list``), exactly those a DTensor
    Shard(0) rank would ask for: the storage layer sees a real resharded load.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RowBlockPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn, dest in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * dest.dim()), sizes=dest.shape)
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

    return RowBlockPlanner()


# --------------------------------------------------------------------------- the run


class Bench:
    """The rows of one run, on one rank. Rank 0 keeps the results."""

    def __init__(self, options: BenchOptions, group: _Group, root: str) -> None:
        self.options, self.group, self.root = options, group, root
        self.config = resolve_config(queue_depth=options.queue_depth, block_size=options.block_size,
                                     direct_io=options.direct_io, engine="posix")
        self.io_kwargs = {"queue_depth": self.config.queue_depth, "block_size": self.config.block_size,
                          "direct_io": self.config.direct_io}
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

    # ------------------------------------------------------------ helpers

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
                                                     shape=shape, stride=_contiguous_stride(shape))
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
            seconds, result = self.group.timed(lambda path=path: save(path))
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

    # ------------------------------------------------------------ rows

    def steps(self) -> list[tuple[str, Callable[[], None]]]:
        return [
            ("warm-up", self.warm_up),
            ("memory copy floor", self.memory_floor),
            ("device limit", self.device_limit),
            ("dcp_nvme save", self.ours_save),
            ("dcp_nvme async save", self.ours_async),
            ("FileSystemWriter", self.fs_saves),
            ("torch.save", self.torch_save),
            ("safetensors save", self.safetensors_save),
            ("dcp_nvme load", self.ours_load),
            ("FileSystemReader", self.fs_load),
            ("torch.load", self.torch_load),
            ("safetensors load", self.safetensors_load),
            ("resharded load", self.reshard),
        ]

    def warm_up(self) -> None:
        """Every save and load once on a 1 MiB state, untimed: imports, first-call set-up and the
        engine's bounce buffers (allocated once per process and configuration) are paid here,
        so the rows compare data paths. Their seconds are kept in the results as ``warmup``."""
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        from .reader import NVMeReader
        from .writer import NVMeWriter

        dcp, no_dist = self._dcp(), not self.group.is_dist
        spec = llama_spec(1 << 20)
        local = build_state(spec, self.group.rank, self.group.world, self.options.seed)
        state = self._wrap(local, spec)
        dest = self._wrap({k: torch.zeros_like(v) for k, v in local.items()}, spec)
        wanted = {k: torch.zeros_like(v[: _reshard_rows(t.shape[0], self.group.world)])
                  for (k, v), t in zip(local.items(), spec.tensors)}
        path = self._fresh("warmup")
        ours, fs = os.path.join(path, "dcp_nvme"), os.path.join(path, "fs")
        steps = {
            "dcp_nvme save": lambda: dcp.save(state, storage_writer=NVMeWriter(ours, **self.io_kwargs),
                                              no_dist=no_dist),
            "dcp_nvme load": lambda: dcp.load(dest, storage_reader=NVMeReader(ours, **self.io_kwargs),
                                              no_dist=no_dist),
            "FileSystemWriter": lambda: dcp.save(state, storage_writer=FileSystemWriter(fs), no_dist=no_dist),
            "FileSystemReader": lambda: dcp.load(dest, storage_reader=FileSystemReader(fs), no_dist=no_dist),
            "torch.save/load": lambda: torch.load(_save_torch(local, self._per_rank_file(path, "pt")),
                                                  weights_only=True),
        }
        if importlib.util.find_spec("safetensors") is not None:
            from safetensors.torch import save_file

            target = self._per_rank_file(path, "safetensors")
            steps["safetensors"] = lambda: (save_file(local, target), _safetensors_load_eager(target))
        if self.group.rank == 0:
            steps["resharded load planner"] = lambda: dcp.load(
                wanted, storage_reader=NVMeReader(ours, **self.io_kwargs), planner=_row_block_planner(),
                no_dist=True)
        self.warmup: dict[str, float] = {}
        for name, step in steps.items():
            if name == "resharded load planner":
                started = time.perf_counter()
                step()
                self.warmup[name] = round(time.perf_counter() - started, 6)
            else:
                self.warmup[name] = round(self.group.timed(step)[0], 6)
        self._drop(path)

    def memory_floor(self) -> None:
        row = self.add(Row("memory.copy", "memory copy floor (plain copy into prefaulted memory)", "copy", "floor"))
        arena = aligned_buffer(self.local_bytes, pin=False)
        sources = [tensor_bytes(t) for t in self.local.values()]
        import ctypes

        def by_memmove() -> None:
            base, offset = arena.data_ptr(), 0
            for source in sources:
                ctypes.memmove(base + offset, source.data_ptr(), source.numel())
                offset += source.numel()

        def by_torch() -> None:  # split over torch's intra-op threads
            offset = 0
            for source in sources:
                arena[offset : offset + source.numel()].copy_(source)
                offset += source.numel()

        best = []
        for copy in (by_memmove, by_torch):
            times = [self.group.timed(copy)[0] for _ in range(self.options.repeat)]
            if not best or statistics.median(times) < statistics.median(best):
                best = times
        row.seconds.extend(best)
        row.bytes = self.total_bytes
        row.note = "the faster of memmove and torch's copy_; an async save's blocking copy cannot beat it"

    def device_limit(self) -> None:
        write = self.add(Row("device.write", "device limit: sequential write", "write", "limit"))
        read = self.add(Row("device.read", "device limit: sequential read", "read", "limit"))
        version = fio_version()
        for _ in range(self.options.repeat):
            path = self._fresh("device")
            measured = None
            if version:
                if self.group.rank == 0:
                    try:
                        measured = fio_sequential(path, self.local_bytes, self.group.world, self.config)
                    except (RuntimeError, ValueError, KeyError, OSError, subprocess.SubprocessError) as exc:
                        measured = {"error": str(exc)}
                measured = self.group.gather(measured)[0]
            if measured and "error" not in measured:
                for row, op in ((write, "write"), (read, "read")):
                    row.seconds.append(measured[op]["seconds"])
                    row.bytes = measured[op]["bytes"]
                    row.extra = {k: v for k, v in measured[op].items() if k not in ("bytes", "seconds")}
                how = (f"fio libaio, O_DIRECT={'on' if self.config.direct_io else 'off'}, "
                       f"qd {self.config.queue_depth}, {_fmt_size(self.config.block_size)} requests")
                if self.group.world > 1:
                    how += f", {self.group.world} jobs"
            else:
                self.group.barrier()
                probe = engine_probe(path, self.local_bytes, IOConfig(**self.io_kwargs, engine="posix"))
                seconds = self.group.gather((probe.write_seconds, probe.read_seconds, probe.nbytes))
                write.seconds.append(max(s[0] for s in seconds))
                read.seconds.append(max(s[1] for s in seconds))
                write.bytes = read.bytes = sum(s[2] for s in seconds)
                write.extra, read.extra = {"io": probe.write_io}, {"io": probe.read_io}
                reason = measured["error"] if measured else "fio is not installed"
                how = (f"dcp_nvme PosixEngine on one aligned buffer ({reason}), "
                       f"qd {self.config.queue_depth}, {_fmt_size(self.config.block_size)}")
            write.note = read.note = how
            self._drop(path)

    def ours_save(self) -> None:
        from .writer import NVMeWriter

        row = self.add(Row("dcp_nvme.save", "dcp_nvme save (sync)", "write", "ours"))
        dcp = self._dcp()

        def save(path: str) -> dict[str, Any]:
            writer = NVMeWriter(path, **self.io_kwargs)
            dcp.save(self.state, storage_writer=writer, no_dist=not self.group.is_dist)
            return writer.last_stats or {}

        stats = self._repeat_saves(row, "dcp_nvme", save, keep=True)
        self.dcp_stats["save"] = self.group.gather(stats[-1])
        row.extra = _summarize_ranks(self.dcp_stats["save"], row.median)

    def ours_async(self) -> None:
        blocking = self.add(Row("dcp_nvme.async.blocking", "dcp_nvme async save: blocking", "write", "ours"))
        total = self.add(Row("dcp_nvme.async.total", "dcp_nvme async save: total", "write", "ours"))
        if importlib.util.find_spec("dcp_nvme.staging") is None:
            raise Skip("dcp_nvme.staging (NVMeStager) is not part of this build")
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from .staging import NVMeStager
        from .writer import NVMeWriter

        dcp = self._dcp()
        stager = NVMeStager()
        first: dict[str, float] = {}
        try:
            # one untimed round first: the stager allocates and first-touches its arena once and
            # reuses it, so the steady state is what training sees at every checkpoint after it
            for attempt in range(self.options.repeat + 1):
                path = self._fresh("dcp_nvme_async")
                self.group.barrier()
                started = time.perf_counter()
                response = dcp.async_save(self.state, storage_writer=NVMeWriter(path, **self.io_kwargs),
                                          async_stager=stager, no_dist=not self.group.is_dist)
                if isinstance(response, AsyncSaveResponse):
                    response.staging_completion.result()
                    upload = response.upload_completion
                else:
                    upload = response
                blocked = time.perf_counter() - started
                upload.result()
                finished = time.perf_counter() - started
                blocked, finished = (max(v) for v in zip(*self.group.gather((blocked, finished))))
                if attempt == 0:
                    first = {"first_blocking_seconds": round(blocked, 6), "first_total_seconds": round(finished, 6)}
                else:
                    blocking.seconds.append(blocked)
                    total.seconds.append(finished)
                self._drop(path)
        finally:
            if hasattr(stager, "close"):
                stager.close()
        blocking.bytes = total.bytes = self.total_bytes
        blocking.note = "training is blocked for this long (steady state; arena reused)"
        blocking.extra = dict(first)
        total.note = "until the checkpoint is committed"

    def fs_saves(self) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        dcp = self._dcp()
        best: Row | None = None
        for count in FS_THREAD_COUNTS:
            row = self.add(Row(f"fs.save.t{count}", f"DCP FileSystemWriter thread_count={count}", "write", "peer"))
            if self.options.quick and count != 1:
                row.skipped = "--quick runs thread_count=1 only"
                continue

            def save(path: str, count: int = count) -> None:
                dcp.save(self.state, storage_writer=FileSystemWriter(path, thread_count=count),
                         no_dist=not self.group.is_dist)

            self._repeat_saves(row, "fs", save, keep=count == 1)
            if best is None or row.gbps > best.gbps:
                best = row
        assert best is not None
        count = best.key.rsplit("t", 1)[1]
        self.add(Row("fs.save.best", f"DCP FileSystemWriter best thread_count (={count})", "write", "peer",
                     bytes=best.bytes, seconds=list(best.seconds),
                     note="best of " + ", ".join(str(c) for c in FS_THREAD_COUNTS
                                                  if not (self.options.quick and c != 1))))

    def _per_rank_file(self, path: str, suffix: str) -> str:
        return os.path.join(path, f"rank_{self.group.rank:05d}.{suffix}")

    def torch_save(self) -> None:
        row = self.add(Row("torch.save", "torch.save (+ fsync)", "write", "peer"))
        self._repeat_saves(row, "torch", lambda path: _save_torch(self.local, self._per_rank_file(path, "pt")),
                           keep=True)

    def safetensors_save(self) -> None:
        row = self.add(Row("safetensors.save", "safetensors save_file (+ fsync)", "write", "peer"))
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise Skip(f"safetensors is not installed ({exc})") from None

        def save(path: str) -> None:
            target = self._per_rank_file(path, "safetensors")
            save_file(self.local, target)
            _fsync(target)

        self._repeat_saves(row, "safetensors", save, keep=True)

    def ours_load(self) -> None:
        from .reader import NVMeReader

        row = self.add(Row("dcp_nvme.load", "dcp_nvme load (cold)", "read", "ours"))
        dcp = self._dcp()

        def load(path: str) -> dict[str, Any]:
            reader = NVMeReader(path, **self.io_kwargs)
            dcp.load(dest, storage_reader=reader, no_dist=not self.group.is_dist)
            return reader.last_stats or {}

        dest = self._zero_dest()
        stats = self._repeat_loads(row, "dcp_nvme", load)
        self._check(row, self._dest_local)
        self.dcp_stats["load"] = self.group.gather(stats[-1])
        row.extra.update(_summarize_ranks(self.dcp_stats["load"], row.median))

    def fs_load(self) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        row = self.add(Row("fs.load", "DCP FileSystemReader (cold)", "read", "peer"))
        dcp = self._dcp()
        dest = self._zero_dest()
        self._repeat_loads(row, "fs", lambda path: dcp.load(
            dest, storage_reader=FileSystemReader(path), no_dist=not self.group.is_dist))
        self._check(row, self._dest_local)

    def torch_load(self) -> None:
        row = self.add(Row("torch.load", "torch.load (cold)", "read", "peer"))
        loaded = self._repeat_loads(row, "torch", lambda path: torch.load(
            self._per_rank_file(path, "pt"), map_location="cpu", weights_only=True))
        self._check(row, loaded[-1])
        del loaded

    def safetensors_load(self) -> None:
        row = self.add(Row("safetensors.load", "safetensors load_file (cold)", "read", "peer"))
        if "safetensors" not in self.kept:
            raise Skip("no safetensors checkpoint (its save did not run)")
        loaded = self._repeat_loads(row, "safetensors",
                                    lambda path: _safetensors_load_eager(self._per_rank_file(path, "safetensors")))
        self._check(row, loaded[-1])
        row.note = "backend='pread': the default mmap backend returns lazily mapped tensors, so it times no reading"
        del loaded

    def _check(self, row: Row, loaded: dict[str, torch.Tensor]) -> None:
        identical = all(self.group.gather(_same(self.local, loaded)))
        row.extra["identical"] = identical
        if not identical:
            raise RuntimeError(f"{row.label}: the loaded state differs from the saved one")

    def reshard(self) -> None:
        """Rank 0 loads a quarter of every saved chunk (the first rows of each tensor) from the
        dcp_nvme and the FileSystemWriter checkpoints; bytes read come from /proc/self/io."""
        from torch.distributed.checkpoint import FileSystemReader

        from .reader import NVMeReader

        split = self.group.world * RESHARD_SPLIT
        ours = self.add(Row("reshard.dcp_nvme", f"dcp_nvme resharded load (1/{split} of each tensor)",
                            "reshard", "ours"))
        unverified = self.add(Row("reshard.dcp_nvme.noverify", "dcp_nvme resharded load, verify=False",
                                  "reshard", "ours"))
        peer = self.add(Row("reshard.fs", f"FileSystemReader resharded load (1/{split} of each tensor)",
                            "reshard", "peer"))
        runs = [(ours, "dcp_nvme", lambda p: NVMeReader(p, **self.io_kwargs)),
                (unverified, "dcp_nvme", lambda p: NVMeReader(p, verify=False, **self.io_kwargs)),
                (peer, "fs", FileSystemReader)]
        missing = [k for k in ("dcp_nvme", "fs") if k not in self.kept]
        if missing:
            raise Skip(f"no {' and '.join(missing)} checkpoint to load from")
        dcp = self._dcp()
        if self.group.rank == 0:
            wanted = {k: v[: _reshard_rows(spec.shape[0], self.group.world)]
                      for (k, v), spec in zip(self.local.items(), self.spec.tensors)}
            needed = sum(v.nbytes for v in wanted.values())
            for row, kind, reader in runs:
                path = self.kept[kind]
                for _ in range(self.options.repeat):
                    evict_from_page_cache(files_under(path))
                    dest = {k: torch.zeros_like(v) for k, v in wanted.items()}
                    storage = reader(path)
                    before = _rchar()
                    started = time.perf_counter()
                    dcp.load(dest, storage_reader=storage, planner=_row_block_planner(), no_dist=True)
                    row.seconds.append(time.perf_counter() - started)
                    after = _rchar()
                row.bytes = needed
                row.extra = {"bytes_needed": needed, "checkpoint_bytes": self.total_bytes,
                             "bytes_read": (after - before) if before is not None and after is not None else None,
                             "identical": _same(wanted, dest)}
                if hasattr(storage, "last_stats"):
                    row.extra["reader_stats"] = storage.last_stats
                if not row.extra["identical"]:
                    raise RuntimeError(f"{row.label}: the loaded rows differ from the saved ones")
            note = (f"rank 0 of a {split}-way row split loads rows [0, n/{split}) of every tensor from the "
                    f"{self.group.world}-rank checkpoint (a quarter of each saved chunk); bytes read from "
                    "/proc/self/io rchar")
            for row, _, _ in runs:
                row.note = note
        self.group.barrier()
        if self.group.is_dist:
            for row, _, _ in runs:
                row.bytes, row.seconds, row.extra, row.note = self.group.gather(
                    (row.bytes, row.seconds, row.extra, row.note))[0]

    # ------------------------------------------------------------ driver

    def run(self) -> dict[str, Any]:
        # single-process DCP calls warn that no process group exists; that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        bar = None
        if self.options.progress and self.group.rank == 0:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(self.steps()), file=sys.stderr, leave=False, unit="step")
            except ImportError:
                bar = None
        try:
            for name, step in self.steps():
                if bar is not None:
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
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return self.document()

    def document(self) -> dict[str, Any]:
        options = asdict(self.options)
        fio = fio_version()
        doc = {
            "format": "dcp_nvme.bench", "format_version": 1, "created_unix": time.time(),
            "config": {
                "size_requested": self.options.size, "state_bytes": self.total_bytes,
                "bytes_per_rank": self.group.gather(self.local_bytes), "ranks": self.group.world,
                "optim": self.options.optim, "model": _model_doc(self.spec),
                "io": {**self.io_kwargs, "checksum_block": self.config.checksum_block,
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
        return doc


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= dim
    return tuple(reversed(stride))


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


def _summarize_ranks(per_rank: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The figures a person looks for first, over all ranks: depth reached, requests, latency."""
    ios = [s.get("io", s) for s in per_rank if s]
    if not ios:
        return {}
    summary = {
        "requests": sum(io.get("requests", 0) for io in ios),
        "max_inflight": max(io.get("max_inflight", 0) for io in ios),
        "latency_p50_ms": max(io.get("latency_p50_ms", 0.0) for io in ios),
        "latency_p99_ms": max(io.get("latency_p99_ms", 0.0) for io in ios),
        "copied_bytes": sum(io.get("copied_bytes", 0) for io in ios),
        "io_bytes": sum(io.get("bytes", 0) for io in ios),
        "io_seconds": max(io.get("seconds", 0.0) for io in ios),
        "fsync_seconds": max(io.get("fsync_seconds", 0.0) for io in ios),
        "direct_io": all(io.get("direct_io", False) for io in ios),
    }
    if not any((stats or {}).get("phases") for stats in per_rank):
        # a load: read_data's own span, the rest is the manifest, DCP planning and committing
        summary["outside_read_data_seconds"] = round(max(0.0, seconds - summary["io_seconds"]), 6)
    phases: dict[str, float] = {}
    for stats in per_rank:
        for name, value in (stats or {}).get("phases", {}).items():
            phases[name] = max(phases.get(name, 0.0), value)
    if phases:
        summary["phases"] = phases
        # what the writer did not time: DCP's planning, gathers, metadata, python overhead
        summary["outside_phases_seconds"] = round(max(0.0, seconds - sum(phases.values())), 6)
    return summary


# --------------------------------------------------------------------------- ratios & targets


def compute_ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    by_key = {r["key"]: r for r in rows}

    def gbps(key: str) -> float | None:
        row = by_key.get(key)
        return row["gbps"] if row and not row["skipped"] and row["gbps"] > 0 else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    save, load = gbps("dcp_nvme.save"), gbps("dcp_nvme.load")
    reshard = by_key.get("reshard.dcp_nvme", {}).get("extra", {})
    amplification = None
    if reshard.get("bytes_read") and reshard.get("bytes_needed"):
        amplification = round(reshard["bytes_read"] / reshard["bytes_needed"], 3)
    fs_reshard = by_key.get("reshard.fs", {}).get("extra", {})
    return {
        "save_vs_device": ratio(save, gbps("device.write")),
        "save_vs_fs_t1": ratio(save, gbps("fs.save.t1")),
        "save_vs_fs_best": ratio(save, gbps("fs.save.best")),
        "save_vs_torch_save": ratio(save, gbps("torch.save")),
        "save_vs_safetensors": ratio(save, gbps("safetensors.save")),
        "load_vs_device": ratio(load, gbps("device.read")),
        "load_vs_fs": ratio(load, gbps("fs.load")),
        "load_vs_torch_load": ratio(load, gbps("torch.load")),
        "load_vs_safetensors": ratio(load, gbps("safetensors.load")),
        "reshard_read_amplification": amplification,
        "reshard_fs_read_amplification": (
            round(fs_reshard["bytes_read"] / fs_reshard["bytes_needed"], 3)
            if fs_reshard.get("bytes_read") and fs_reshard.get("bytes_needed") else None),
        "reshard_vs_fs_time": ratio(gbps("reshard.dcp_nvme"), gbps("reshard.fs")),
    }


def check_targets(ratios: dict[str, float | None]) -> list[dict[str, Any]]:
    out = []
    for name, key, threshold, comparison in TARGETS:
        value = ratios.get(key)
        met = None if value is None else (value >= threshold if comparison == ">=" else value <= threshold)
        out.append({"target": name, "ratio": key, "value": value, "threshold": threshold, "met": met})
    return out


# --------------------------------------------------------------------------- report


def _fmt_size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_report(doc: dict[str, Any]) -> str:
    """The table and notes printed at the end of a run."""
    cfg, machine = doc["config"], doc["machine"]
    rows = doc["rows"]
    by_key = {r["key"]: r for r in rows}
    io = cfg["io"]
    lines = [
        f"dcp-nvme bench: {_fmt_size(cfg['state_bytes'])} state over {cfg['ranks']} rank(s) in "
        f"{cfg['directory']} ({machine.get('fstype', '?')} on {machine.get('device', '?')})",
        f"  state: {cfg['model']['description']}",
        f"  dcp_nvme I/O: queue_depth {io['queue_depth']}, block_size {_fmt_size(io['block_size'])}, "
        f"O_DIRECT {'on' if io['direct_io'] else 'off'} (from {io['source']})",
        f"  machine: {machine.get('cpu_count')} CPUs, torch {machine.get('torch')}, "
        f"fio {cfg['fio']['version'] if cfg['fio'] else 'not installed'}; every save is fsynced into a "
        "new directory",
    ]
    if cfg.get("eviction"):
        cached = cfg.get("cached_after_eviction_max")
        lines.append(f"  cold loads: page cache evicted by {cfg['eviction']}"
                     + (f"; at most {cached:.0%} of sampled pages still cached after" if cached is not None else ""))
    lines.append("")
    ours = {"write": by_key.get("dcp_nvme.save"), "read": by_key.get("dcp_nvme.load")}
    limit = {"write": by_key.get("device.write"), "read": by_key.get("device.read")}
    header = f"  {'':<52} {'GB/s':>7} {'seconds':>8} {'÷ device':>9} {'dcp_nvme ÷ this':>16}"
    for op, title in (("write", "SAVE (higher is better)"), ("read", "LOAD (higher is better)")):
        lines.append(title)
        lines.append(header)
        for row in (r for r in rows if r["op"] == op):
            lines.append(_row_line(row, ours[op], limit[op]))
        lines.append("")
    floor = by_key.get("memory.copy")
    if floor and not floor["skipped"]:
        lines.append(f"memory copy floor: {floor['gbps']:.2f} GB/s ({floor['note']})")
    reshard = [r for r in rows if r["op"] == "reshard"]
    if reshard:
        lines.append("RESHARDED LOAD" + (f": {reshard[0]['note']}" if reshard[0]["note"] else ""))
        for row in reshard:
            if row["skipped"] or row.get("error"):
                lines.append(f"  {row['label']:<58} " + (f"skipped: {row['skipped']}" if row["skipped"]
                                                           else "FAILED (see below)"))
                continue
            extra = row["extra"]
            read = extra.get("bytes_read")
            lines.append(f"  {row['label']:<58} read {_fmt_size(read) if read else '?':>9} for "
                         f"{_fmt_size(extra['bytes_needed'])} needed, {row['median_seconds']:.3f} s")
        lines.append("")
    for name, key in (("save", "dcp_nvme.save"), ("load", "dcp_nvme.load")):
        row = by_key.get(key)
        if row and not row["skipped"] and row["extra"].get("requests"):
            lines.append(f"dcp_nvme {name} internals: " + _internals(row["extra"], io))
    lines.append("")
    lines.append("TARGETS (issue 4)")
    for target in doc["targets"]:
        mark = {True: "met", False: "MISSED", None: "not measured"}[target["met"]]
        value = "-" if target["value"] is None else f"{target['value']:.2f}"
        lines.append(f"  {target['target']:<58} {value:>6}  {mark}")
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines.append("")
        lines.append("FAILED")
        for row in failed:
            lines.append(f"  {row['label']}: {row['error']}")
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        lines.append("")
        lines.append("SKIPPED")
        for row in skipped:
            lines.append(f"  {row['label']}: {row['skipped']}")
    return "\n".join(lines)


def _row_line(row: dict[str, Any], ours: dict[str, Any] | None, limit: dict[str, Any] | None) -> str:
    label = row["label"] + (" [ours]" if row["role"] == "ours" else "")
    if row.get("error"):
        return f"  {label:<52} FAILED (see below)"
    if row["skipped"]:
        return f"  {label:<52} skipped: {row['skipped']}"
    versus_device = row["gbps"] / limit["gbps"] if limit and not limit["skipped"] and limit["gbps"] else None
    ours_ratio = None
    if ours and not ours["skipped"] and row["gbps"] and row["role"] != "ours":
        ours_ratio = ours["gbps"] / row["gbps"]
    return (f"  {label:<52} {row['gbps']:>7.2f} {row['median_seconds']:>8.3f} {_x(versus_device):>9} "
            f"{_x(ours_ratio):>16}")


def _internals(extra: dict[str, Any], io: dict[str, Any]) -> str:
    parts = [f"{extra['requests']} requests, depth reached {extra['max_inflight']} of {io['queue_depth']}",
             f"latency p50 {extra['latency_p50_ms']:.1f} ms p99 {extra['latency_p99_ms']:.1f} ms",
             f"O_DIRECT {'on' if extra.get('direct_io') else 'off'}"]
    if extra.get("io_bytes"):
        parts.append(f"{extra.get('copied_bytes', 0) / extra['io_bytes']:.0%} through bounce buffers")
    if extra.get("fsync_seconds"):
        parts.append(f"fsync {extra['fsync_seconds']:.3f} s")
    if "outside_read_data_seconds" in extra:
        parts.append(f"read_data {extra['io_seconds']:.3f} s, outside it (manifest, DCP planning) "
                     f"{extra['outside_read_data_seconds']:.3f} s")
    if extra.get("phases"):
        parts.append("phases " + ", ".join(f"{k} {v:.3f} s" for k, v in extra["phases"].items())
                     + f", outside them (DCP planning etc.) {extra.get('outside_phases_seconds', 0):.3f} s")
    return "; ".join(parts)


def plot(doc: dict[str, Any], path: str) -> None:
    """Two horizontal bar panels (save, load) in GB/s; dcp_nvme highlighted, device limit dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "#1f77b4", "peer": "#9e9e9e", "limit": "#2ca02c", "floor": "#ff7f0e"}
    panels = [("write", "Save"), ("read", "Load (cold)")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, (op, title) in zip(axes, panels):
        rows = [r for r in doc["rows"] if r["op"] == op and not r["skipped"] and r["gbps"] > 0
                and r["role"] != "limit"]
        limit = next((r for r in doc["rows"] if r["key"] == f"device.{op}" and not r["skipped"]), None)
        labels = [r["label"].replace("DCP ", "") for r in rows][::-1]
        values = [r["gbps"] for r in rows][::-1]
        bars = ax.barh(labels, values, color=[colors[r["role"]] for r in rows][::-1])
        for bar, value in zip(bars, values):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f}",
                    va="center", fontsize=8)
        if limit:
            ax.axvline(limit["gbps"], color=colors["limit"], linestyle="--",
                       label=f"device limit {limit['gbps']:.2f} GB/s")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("GB/s (higher is better)")
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlim(0, max(values + [limit["gbps"] if limit else 0.0]) * 1.2 or 1)
    cfg = doc["config"]
    fig.suptitle(f"dcp-nvme bench: {_fmt_size(cfg['state_bytes'])}, {cfg['ranks']} rank(s), "
                 f"{doc['machine'].get('fstype', '?')}, qd {cfg['io']['queue_depth']}, "
                 f"{_fmt_size(cfg['io']['block_size'])} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- entry points


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, options: BenchOptions, root: str, result: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        doc = Bench(options, _Group(rank, world), root).run()
        if rank == 0:
            with open(result, "w") as handle:
                json.dump(doc, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Run every row; return the results document (also what ``--json`` writes)."""
    if options.ranks < 1:
        raise ValueError("--ranks must be at least 1")
    if options.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    os.makedirs(options.directory, exist_ok=True)
    spec = llama_spec(options.size, options.optim)
    # kept at once: 4 checkpoints (dcp_nvme, FileSystemWriter, torch.save, safetensors) + one in flight
    needed = 6 * spec.nbytes
    free = shutil.disk_usage(options.directory).free
    if free < needed:
        raise OSError(f"{options.directory} has {_fmt_size(free)} free; a {_fmt_size(spec.nbytes)} bench "
                      f"needs about {_fmt_size(needed)} (6 copies); use a smaller --size or another --dir")
    root = os.path.join(options.directory, f"dcp-nvme-bench-{uuid.uuid4().hex[:8]}")
    os.makedirs(root)
    try:
        if options.ranks == 1:
            return Bench(options, _Group(0, 1), root).run()
        import torch.multiprocessing as mp

        result = os.path.join(root, "result.json")
        mp.spawn(_rank_entry, args=(options.ranks, _free_port(), options, root, result),
                 nprocs=options.ranks, join=True)
        with open(result) as handle:
            return json.load(handle)
    finally:
        if options.keep:
            print(f"dcp-nvme bench: checkpoints kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure dcp_nvme against the device limit, DCP FileSystemWriter, torch.save, "
                      "safetensors", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("512MiB"),
                        help="total state size, e.g. 512MiB or 2GiB (default 512MiB)")
    parser.add_argument("--ranks", type=int, default=1, help="processes over gloo sharing the disk (default 1)")
    parser.add_argument("--dir", default=".", help="directory on the drive to measure (default: .); "
                        "a temporary sub-directory is created and removed")
    parser.add_argument("--optim", action="store_true", help="add fp32 Adam moments and master weights")
    parser.add_argument("--queue-depth", type=int, default=None, help="dcp_nvme requests in flight per rank")
    parser.add_argument("--block-size", type=parse_size, default=None, help="dcp_nvme bytes per request")
    parser.add_argument("--direct-io", choices=("on", "off"), default=None, help="dcp_nvme O_DIRECT")
    parser.add_argument("--repeat", type=int, default=1, help="runs per row; the median is reported")
    parser.add_argument("--quick", action="store_true", help="FileSystemWriter at thread_count=1 only")
    parser.add_argument("--json", default=None, help="write every figure and the configuration here")
    parser.add_argument("--plot", default=None, help="write a bar chart (PNG) here; needs matplotlib")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--plot needs matplotlib: pip install 'dcp_nvme[bench]'")
    options = BenchOptions(
        size=args.size, ranks=args.ranks, directory=args.dir, optim=args.optim,
        queue_depth=args.queue_depth, block_size=args.block_size,
        direct_io=None if args.direct_io is None else args.direct_io == "on",
        repeat=args.repeat, quick=args.quick, keep=args.keep, progress=not args.no_progress,
    )
    doc = run_bench(options)
    print(format_report(doc))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(doc, handle, indent=1)
        print(f"\nresults: {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"plot: {args.plot}")
    return 0
