"""Data-path rows: the threads and io_uring engines side by side with their CPU cost, and cold
loads in each read mode. CPU is the process's user+sys time (``getrusage``) over the timed
call, summed over ranks, per GB moved: what a checkpoint takes from the training job's cores."""

from __future__ import annotations

import resource
import time
from typing import Any

from dcp_nvme.bench.core import BenchCore, IOKwargs
from dcp_nvme.bench.records import Row, Skip
from dcp_nvme.engines.uring import uring_unavailable_reason

ENGINES = (("threads", "posix"), ("uring", "uring"))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class DataPathRows(BenchCore):
    def _cpu_timed(self, row: Row, call) -> Any:
        """Time ``call`` on every rank; record seconds and the CPU seconds all ranks spent."""
        before = cpu_seconds()
        seconds, result = self.group.timed(call)
        spent = sum(self.group.gather(cpu_seconds() - before))
        row.seconds.append(seconds)
        row.extra.setdefault("cpu_seconds", []).append(round(spent, 6))
        return result

    @staticmethod
    def _cpu_per_gb(row: Row) -> None:
        spent = sorted(row.extra.get("cpu_seconds", []))
        if spent and row.bytes:
            row.extra["cpu_seconds_per_gb"] = round(spent[len(spent) // 2] / (row.bytes / 1e9), 4)

    def engines_cpu(self) -> None:
        """Sync save and cold load with each host engine, CPU seconds per GB beside GB/s."""
        from dcp_nvme.load.reader import NVMeReader
        from dcp_nvme.save.writer import NVMeWriter

        dcp, no_dist = self._dcp(), not self.group.is_dist
        reason = uring_unavailable_reason()
        for label, engine in ENGINES:
            save = self.add(Row(f"engine.{label}.save", f"dcp_nvme save, {label} engine", "write", "ours"))
            load = self.add(Row(f"engine.{label}.load", f"dcp_nvme load (cold), {label} engine", "read", "ours"))
            if engine == "uring" and reason is not None:
                save.skipped = load.skipped = f"io_uring unavailable: {reason}"
                continue
            kwargs: IOKwargs = {**self.io_kwargs, "engine": engine}
            self._warm(kwargs)
            for _ in range(self.options.repeat):
                path = self._fresh(f"engine_{label}")
                writer = NVMeWriter(path, **kwargs)
                self._cpu_timed(save, lambda w=writer: dcp.save(self.state, storage_writer=w, no_dist=no_dist))
                self._evict(path)
                dest = self._zero_dest()
                reader = NVMeReader(path, **kwargs)
                self._cpu_timed(load, lambda d=dest, r=reader: dcp.load(d, storage_reader=r, no_dist=no_dist))
                self._check(load, self._dest_local)
                self._drop(path)
            save.bytes = load.bytes = self.total_bytes
            self._bounce_share(load, reader.last_stats or {})
            for row in (save, load):
                self._cpu_per_gb(row)
                row.note = "cpu_seconds_per_gb: user+sys of the saving/loading processes per GB"

    def _warm(self, kwargs: IOKwargs) -> None:
        """One untimed tiny save and load with these options: the engine for them (its bounce
        buffers, its ring) is created once per process and configuration, not in a timed row."""
        import torch

        from dcp_nvme.load.reader import NVMeReader
        from dcp_nvme.save.writer import NVMeWriter

        dcp, path = self._dcp(), self._fresh("engine_warm")
        mine = f"{path}/rank{self.group.rank}"  # every rank warms its own process's engine
        writer_kwargs = kwargs.copy()
        writer_kwargs.pop("read_mode", None)  # a reader option
        dcp.save({"w": torch.zeros(1024)}, storage_writer=NVMeWriter(mine, **writer_kwargs), no_dist=True)
        dcp.load({"w": torch.empty(1024)}, storage_reader=NVMeReader(mine, **kwargs), no_dist=True)
        self._drop(path)

    def read_modes(self) -> None:
        """Cold loads of the kept dcp_nvme checkpoint with O_DIRECT and with buffered readahead."""
        from dcp_nvme.load.reader import NVMeReader

        path = self.kept.get("dcp_nvme")
        if path is None:
            raise Skip("no dcp_nvme checkpoint (its save did not run)")
        dcp, no_dist = self._dcp(), not self.group.is_dist
        for mode in ("direct", "buffered"):
            reader_kwargs: IOKwargs = {**self.io_kwargs, "read_mode": mode}
            self._warm(reader_kwargs)
            row = self.add(Row(f"dcp_nvme.load.{mode}", f"dcp_nvme load (cold), read_mode={mode}",
                               "read", "ours"))
            for _ in range(self.options.repeat):
                self._evict(path)
                dest = self._zero_dest()
                reader = NVMeReader(path, **reader_kwargs)
                self._cpu_timed(row, lambda d=dest, r=reader: dcp.load(d, storage_reader=r, no_dist=no_dist))
                self._check(row, self._dest_local)
            row.bytes = self.total_bytes
            self._cpu_per_gb(row)
            self._bounce_share(row, reader.last_stats or {})
            row.note = ("O_DIRECT straight into tensors congruent to the file, the rest via bounce buffers"
                        if mode == "direct" else
                        "page cache, POSIX_FADV_SEQUENTIAL readahead, block_size preads into the tensors")

    def _bounce_share(self, row: Row, stats: dict[str, Any]) -> None:
        """The share of the bytes the last load read that it copied out of bounce buffers,
        over all ranks."""
        copied, read = (sum(values) for values in zip(*self.group.gather(
            (stats.get("copied_bytes", 0), stats.get("bytes", 0)))))
        if read:
            row.extra["bounce_share"] = round(copied / read, 4)

    def bounded_async(self) -> None:
        """Async save with ``NVMeStager(max_bytes=half the rank's state)``: what bounding host
        memory costs in blocking time (the head of the state is written while training waits)."""
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from dcp_nvme.save.stager import NVMeStager
        from dcp_nvme.save.writer import NVMeWriter

        blocking = self.add(Row("dcp_nvme.async.half.blocking",
                                "dcp_nvme async save, max_bytes=half: blocking", "write", "ours"))
        total = self.add(Row("dcp_nvme.async.half.total",
                             "dcp_nvme async save, max_bytes=half: total", "write", "ours"))
        dcp = self._dcp()
        stager = NVMeStager(max_bytes=self.local_bytes // 2)
        live = []
        try:
            for attempt in range(self.options.repeat + 1):  # the first round allocates the arena
                path = self._fresh("dcp_nvme_async_half")
                self.group.barrier()
                started = time.perf_counter()
                response = dcp.async_save(self.state, storage_writer=NVMeWriter(path, **self.io_kwargs),
                                          async_stager=stager, no_dist=not self.group.is_dist)
                assert isinstance(response, AsyncSaveResponse)
                response.staging_completion.result()
                blocked = time.perf_counter() - started
                response.upload_completion.result()
                finished = time.perf_counter() - started
                blocked, finished = (max(v) for v in zip(*self.group.gather((blocked, finished))))
                if attempt:
                    blocking.seconds.append(blocked)
                    total.seconds.append(finished)
                    live.append(stager.stats()["last_live_bytes"])
                self._drop(path)
            peak_arena = max(self.group.gather(stager.arena_bytes))
        finally:
            stager.close()
        blocking.bytes = total.bytes = self.total_bytes
        blocking.extra = {"max_bytes_per_rank": self.local_bytes // 2, "arena_bytes_max": peak_arena,
                          "live_bytes_rank0": live[-1] if live else 0}
        blocking.note = ("training waits for a copy of the staged tail plus the write of the head "
                         "(docs/async.md)")
        total.note = "until the checkpoint is committed"
