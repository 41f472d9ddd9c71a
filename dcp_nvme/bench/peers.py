"""The peers' rows: DCP's FileSystemWriter/Reader, torch.save/load, safetensors save_file/load_file."""

from __future__ import annotations

import os

import torch

from dcp_nvme.bench.core import BenchCore
from dcp_nvme.bench.records import Row, Skip

FS_THREAD_COUNTS = (1, 2, 4, 8)


def safetensors_load_eager(path: str) -> dict[str, torch.Tensor]:
    """safetensors' load_file with every byte read: its default mmap backend maps tensors lazily,
    so a timed call returns before any data is read (docs/benchmarks.md, findings)."""
    from safetensors.torch import load_file

    try:
        return load_file(path, backend="pread")
    except TypeError:  # safetensors < 0.8 has no backend choice: touch every page ourselves
        return {name: tensor.clone() for name, tensor in load_file(path).items()}


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_torch(state: dict[str, torch.Tensor], path: str) -> str:
    torch.save(state, path)
    fsync_file(path)
    return path


class PeerRows(BenchCore):
    """The usual ways to save and load, timed the way dcp_nvme is."""

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
        best_count = best.key.rsplit("t", 1)[1]
        self.add(Row("fs.save.best", f"DCP FileSystemWriter best thread_count (={best_count})", "write", "peer",
                     bytes=best.bytes, seconds=list(best.seconds),
                     note="best of " + ", ".join(str(c) for c in FS_THREAD_COUNTS
                                                  if not (self.options.quick and c != 1))))

    def torch_save(self) -> None:
        row = self.add(Row("torch.save", "torch.save (+ fsync)", "write", "peer"))
        self._repeat_saves(row, "torch", lambda path: save_torch(self.local, self._per_rank_file(path, "pt")),
                           keep=True)

    def safetensors_save(self) -> None:
        row = self.add(Row("safetensors.save", "safetensors save_file (+ fsync)", "write", "peer"))
        from safetensors.torch import save_file

        def save(path: str) -> None:
            target = self._per_rank_file(path, "safetensors")
            save_file(self.local, target)
            fsync_file(target)

        self._repeat_saves(row, "safetensors", save, keep=True)

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
                                    lambda path: safetensors_load_eager(self._per_rank_file(path, "safetensors")))
        self._check(row, loaded[-1])
        row.note = "backend='pread': the default mmap backend returns lazily mapped tensors, so it times no reading"
        del loaded
