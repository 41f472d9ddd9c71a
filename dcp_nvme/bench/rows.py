"""dcp_nvme's rows and what they are measured against: warm-up, memory-copy floor, device limit,
sync save, async save, cold load and the resharded load."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader

from dcp_nvme.bench.core import BenchCore, same_state
from dcp_nvme.bench.device import fio_sequential, fio_version
from dcp_nvme.bench.peers import safetensors_load_eager, save_torch
from dcp_nvme.bench.records import Row, Skip
from dcp_nvme.bench.reshard import RESHARD_SPLIT, rchar, reshard_rows, row_block_planner
from dcp_nvme.bench.synthetic import build_state, llama_spec
from dcp_nvme.engines.host_io import aligned_buffer, tensor_bytes
from dcp_nvme.errors import BenchError
from dcp_nvme.humanize import format_size
from dcp_nvme.observe.machine import evict_from_page_cache, files_under
from dcp_nvme.tune.probe import engine_probe


class OursRows(BenchCore):
    """The dcp_nvme rows, the warm-up before them and the limits beside them."""

    def warm_up(self) -> None:
        """Every save and load once on a 1 MiB state, untimed: imports, first-call set-up and the
        engine's bounce buffers (allocated once per process and configuration) are paid here,
        so the rows compare data paths. Their seconds are kept in the results as ``warmup``."""
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        from dcp_nvme.load.reader import NVMeReader
        from dcp_nvme.save.writer import NVMeWriter

        dcp, no_dist = self._dcp(), not self.group.is_dist
        spec = llama_spec(1 << 20)
        local = build_state(spec, self.group.rank, self.group.world, self.options.seed)
        state = self._wrap(local, spec)
        dest = self._wrap({k: torch.zeros_like(v) for k, v in local.items()}, spec)
        wanted = {k: torch.zeros_like(v[: reshard_rows(t.shape[0], self.group.world)])
                  for (k, v), t in zip(local.items(), spec.tensors)}
        path = self._fresh("warmup")
        ours, fs = os.path.join(path, "dcp_nvme"), os.path.join(path, "fs")
        steps = {
            "dcp_nvme save": lambda: dcp.save(state, storage_writer=NVMeWriter(ours, **self.writer_kwargs),
                                              no_dist=no_dist),
            "dcp_nvme load": lambda: dcp.load(dest, storage_reader=NVMeReader(ours, **self.io_kwargs),
                                              no_dist=no_dist),
            "FileSystemWriter": lambda: dcp.save(state, storage_writer=FileSystemWriter(fs), no_dist=no_dist),
            "FileSystemReader": lambda: dcp.load(dest, storage_reader=FileSystemReader(fs), no_dist=no_dist),
            "torch.save/load": lambda: torch.load(save_torch(local, self._per_rank_file(path, "pt")),
                                                  weights_only=True),
        }
        from safetensors.torch import save_file

        target = self._per_rank_file(path, "safetensors")
        steps["safetensors"] = lambda: (save_file(local, target), safetensors_load_eager(target))
        if self.group.rank == 0:
            steps["resharded load planner"] = lambda: dcp.load(
                wanted, storage_reader=NVMeReader(ours, **self.io_kwargs), planner=row_block_planner(),
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

        best: list[float] = []
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
                        measured = fio_sequential(path, self.local_bytes, self.group.world, self.device_config)
                    except (RuntimeError, ValueError, KeyError, OSError, subprocess.SubprocessError) as exc:
                        measured = {"error": str(exc)}
                measured = self.group.gather(measured)[0]
            if measured and "error" not in measured:
                for row, op in ((write, "write"), (read, "read")):
                    row.seconds.append(measured[op]["seconds"])
                    row.bytes = measured[op]["bytes"]
                    row.extra = {k: v for k, v in measured[op].items() if k not in ("bytes", "seconds")}
                how = (f"fio libaio, O_DIRECT={'on' if self.config.direct_io else 'off'}, "
                       f"qd {self.device_config.queue_depth}, {format_size(self.config.block_size)} requests")
                if self.group.world > 1:
                    how += f", {self.group.world} jobs"
            else:
                self.group.barrier()
                probe = engine_probe(path, self.local_bytes, self.device_config)
                seconds = self.group.gather((probe.write_seconds, probe.read_seconds, probe.nbytes))
                write.seconds.append(max(s[0] for s in seconds))
                read.seconds.append(max(s[1] for s in seconds))
                write.bytes = read.bytes = sum(s[2] for s in seconds)
                # our own engine, not an independent measure: no ratio is taken to it
                write.extra = {"io": probe.write_io, "device_limit": False}
                read.extra = {"io": probe.read_io, "device_limit": False}
                write.label, read.label = ("engine probe: sequential write (no fio: not the device limit)",
                                           "engine probe: sequential read (no fio: not the device limit)")
                reason = measured["error"] if measured else "fio is not installed"
                how = (f"dcp_nvme PosixEngine on one aligned buffer ({reason}), "
                       f"qd {self.device_config.queue_depth}, {format_size(self.config.block_size)}")
            write.note = read.note = how
            self._drop(path)

    def ours_save(self) -> None:
        from dcp_nvme.save.writer import NVMeWriter

        row = self.add(Row("dcp_nvme.save", "dcp_nvme save (sync)", "write", "ours"))
        dcp = self._dcp()

        def save(path: str) -> dict[str, Any]:
            writer = NVMeWriter(path, **self.writer_kwargs)
            dcp.save(self.state, storage_writer=writer, no_dist=not self.group.is_dist)
            return writer.last_stats or {}

        stats = self._repeat_saves(row, "dcp_nvme", save, keep=True)
        self.dcp_stats["save"] = self.group.gather(stats[-1])
        row.extra = summarize_ranks(self.dcp_stats["save"], row.median)

    def ours_async(self) -> None:
        blocking = self.add(Row("dcp_nvme.async.blocking", "dcp_nvme async save: blocking", "write", "ours"))
        total = self.add(Row("dcp_nvme.async.total", "dcp_nvme async save: total", "write", "ours"))
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from dcp_nvme.save.stager import NVMeStager
        from dcp_nvme.save.writer import NVMeWriter

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
                response = dcp.async_save(self.state, storage_writer=NVMeWriter(path, **self.writer_kwargs),
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

    def ours_load(self) -> None:
        from dcp_nvme.load.reader import NVMeReader

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
        row.extra.update(summarize_ranks(self.dcp_stats["load"], row.median))

    def reshard(self) -> None:
        """Rank 0 loads a quarter of every saved chunk (the first rows of each tensor) from the
        dcp_nvme and the FileSystemWriter checkpoints; bytes read come from /proc/self/io."""
        from torch.distributed.checkpoint import FileSystemReader

        from dcp_nvme.load.reader import NVMeReader

        split = self.group.world * RESHARD_SPLIT
        ours = self.add(Row("reshard.dcp_nvme", f"dcp_nvme resharded load (1/{split} of each tensor)",
                            "reshard", "ours"))
        unverified = self.add(Row("reshard.dcp_nvme.noverify", "dcp_nvme resharded load, verify=False",
                                  "reshard", "ours"))
        peer = self.add(Row("reshard.fs", f"FileSystemReader resharded load (1/{split} of each tensor)",
                            "reshard", "peer"))
        runs: list[tuple[Row, str, Callable[[str], StorageReader]]] = [(ours, "dcp_nvme", lambda p: NVMeReader(p, **self.io_kwargs)),
                (unverified, "dcp_nvme", lambda p: NVMeReader(p, verify=False, **self.io_kwargs)),
                (peer, "fs", FileSystemReader)]
        missing = [k for k in ("dcp_nvme", "fs") if k not in self.kept]
        if missing:
            raise Skip(f"no {' and '.join(missing)} checkpoint to load from")
        dcp = self._dcp()
        if self.group.rank == 0:
            wanted = {k: v[: reshard_rows(spec.shape[0], self.group.world)]
                      for (k, v), spec in zip(self.local.items(), self.spec.tensors)}
            needed = sum(v.nbytes for v in wanted.values())
            for row, kind, reader in runs:
                path = self.kept[kind]
                for _ in range(self.options.repeat):
                    evict_from_page_cache(files_under(path))
                    dest = {k: torch.zeros_like(v) for k, v in wanted.items()}
                    storage = reader(path)
                    before = rchar()
                    started = time.perf_counter()
                    dcp.load(dest, storage_reader=storage, planner=row_block_planner(), no_dist=True)
                    row.seconds.append(time.perf_counter() - started)
                    after = rchar()
                row.bytes = needed
                row.extra = {"bytes_needed": needed, "checkpoint_bytes": self.total_bytes,
                             "bytes_read": (after - before) if before is not None and after is not None else None,
                             "identical": same_state(wanted, dest)}
                if hasattr(storage, "last_stats"):
                    row.extra["reader_stats"] = storage.last_stats
                if not row.extra["identical"]:
                    raise BenchError(f"{row.label}: the loaded rows differ from the saved ones")
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


def summarize_ranks(per_rank: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
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
    if summary["io_bytes"]:  # share of the bytes that went through a bounce buffer (a memcpy)
        summary["bounce_share"] = round(summary["copied_bytes"] / summary["io_bytes"], 4)
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
