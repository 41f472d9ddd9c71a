"""How long does dcp.async_save block the training thread?

Three figures from one run, on one synthetic state (float32 tensors, a few odd sizes):

- floor: one plain copy of the same tensors into prefaulted, page-aligned memory (the faster of
  memmove and torch's multi-threaded copy_)
- nvme: dcp.async_save with NVMeWriter + NVMeStager (2nd and later saves: the arena is warm)
- dcp: dcp.async_save with DCP's default stager and FileSystemWriter (2nd and later saves)

Blocking = from the call until staging is complete (the point where the caller may mutate its
tensors). Each save's upload is awaited before the next, and its directory removed after.

    python benchmarks/async_save.py --size 1GiB --dir /nvme/bench --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_nvme import NVMeStager, NVMeWriter
from dcp_nvme.config import parse_size
from dcp_nvme.engines.buffers import aligned_buffer


def make_state(total: int, count: int) -> dict[str, dict[str, torch.Tensor]]:
    """``count`` float32 tensors of about ``total`` bytes under one "model" key, as training
    scripts pass them (DCP wraps every top-level key in a logging decorator, ~0.3 ms each);
    every 4th tensor has an odd size."""
    per = max(total // count // 4, 1)
    model = {}
    for i in range(count):
        numel = per - (i % 4 == 3) * 3  # odd sizes: the packing must not need alignment
        model[f"layer{i:03d}.weight"] = torch.randn(numel)
    return {"model": model}


def tensors(state: dict) -> list[torch.Tensor]:
    return list(state["model"].values())


def floor_copy(state: dict[str, torch.Tensor], buffer: torch.Tensor, method: str) -> float:
    """One plain copy of every tensor into the prefaulted buffer, by memmove (one thread) or by
    torch's copy_ (split over the intra-op threads); the floor is the faster of the two."""
    started = time.perf_counter()
    address, base = buffer.data_ptr(), 0
    for tensor in tensors(state):
        nbytes = tensor.numel() * tensor.element_size()
        if method == "memmove":
            ctypes.memmove(address + base, tensor.data_ptr(), nbytes)
        else:
            buffer[base : base + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        base += nbytes
    return time.perf_counter() - started


def timed_async_save(state, path, **kwargs) -> tuple[float, float]:
    """(blocking seconds, seconds until durable)."""
    started = time.perf_counter()
    resp = dcp.async_save(state, no_dist=True, **kwargs)
    if hasattr(resp, "staging_completion"):
        resp.staging_completion.result()
        blocking = time.perf_counter() - started
        resp.upload_completion.result()
    else:
        blocking = time.perf_counter() - started
        resp.result()
    total = time.perf_counter() - started
    shutil.rmtree(path, ignore_errors=True)
    return blocking, total


def summary(values: list[float]) -> dict[str, float]:
    return {"median_s": round(statistics.median(values), 6), "min_s": round(min(values), 6),
            "max_s": round(max(values), 6), "runs": len(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="state size (default 1GiB)")
    parser.add_argument("--tensors", type=int, default=64, help="number of tensors")
    parser.add_argument("--saves", type=int, default=4, help="saves per method (>= 2)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--block-size", default=None, help="NVMeWriter block size")
    parser.add_argument("--queue-depth", type=int, default=None, help="NVMeWriter queue depth")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.saves < 2:
        parser.error("--saves must be >= 2: the first save warms the arena and is reported apart")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    size = parse_size(args.size)
    root = args.dir or tempfile.mkdtemp(prefix="dcp_nvme_async_")
    os.makedirs(root, exist_ok=True)
    state = make_state(size, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors(state))
    config = {"size_bytes": nbytes, "tensors": len(tensors(state)), "saves": args.saves, "dir": root,
              "block_size": args.block_size, "queue_depth": args.queue_depth,
              "torch": torch.__version__, "python": platform.python_version(),
              "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "cuda": torch.cuda.is_available()}
    print("configuration:", json.dumps(config))

    buffer = aligned_buffer(nbytes, pin=False)  # prefaulted by aligned_buffer
    floor_by_method = {m: [floor_copy(state, buffer, m) for _ in range(max(args.saves, 8))]
                       for m in ("memmove", "torch.copy_")}
    floor = min(floor_by_method.values(), key=lambda times: statistics.median(times[1:]))
    del buffer

    stager = NVMeStager()
    nvme_block, nvme_total, nvme_stage = [], [], []
    for i in range(args.saves):
        path = os.path.join(root, f"nvme_{i}")
        writer = NVMeWriter(path, block_size=args.block_size, queue_depth=args.queue_depth)
        b, t = timed_async_save(state, path, storage_writer=writer, async_stager=stager)
        nvme_block.append(b)
        nvme_total.append(t)
        nvme_stage.append(stager.stats()["last_stage_seconds"])
    stager_stats = stager.stats()
    stager.close()

    dcp_block, dcp_total = [], []
    for i in range(args.saves):
        path = os.path.join(root, f"dcp_{i}")
        b, t = timed_async_save(state, path, storage_writer=FileSystemWriter(path))
        dcp_block.append(b)
        dcp_total.append(t)

    floor_s = statistics.median(floor[1:])
    nvme_s = statistics.median(nvme_block[1:])
    dcp_s = statistics.median(dcp_block[1:])
    results = {
        "config": config,
        "floor_copy": summary(floor[1:]),
        "nvme_blocking": summary(nvme_block[1:]), "nvme_first_blocking_s": round(nvme_block[0], 6),
        "nvme_until_durable": summary(nvme_total[1:]),
        "nvme_stage_only": summary(nvme_stage[1:]),
        "dcp_blocking": summary(dcp_block[1:]), "dcp_first_blocking_s": round(dcp_block[0], 6),
        "dcp_until_durable": summary(dcp_total[1:]),
        "nvme_vs_floor": round(nvme_s / floor_s, 3),
        "dcp_vs_nvme": round(dcp_s / nvme_s, 3),
        "goal_met": {"blocking_le_1.2x_floor": nvme_s <= 1.2 * floor_s,
                     "3x_shorter_than_dcp": dcp_s >= 3 * nvme_s},
        "stager": stager_stats,
    }
    gb = nbytes / 1e9
    print(f"state: {gb:.3f} GB in {len(tensors(state))} tensors; medians of saves 2..{args.saves}")
    print(f"  floor (plain copy)        {floor_s * 1e3:9.1f} ms  {gb / floor_s:6.2f} GB/s")
    print(f"  NVMeStager blocking       {nvme_s * 1e3:9.1f} ms  {nvme_s / floor_s:5.2f}x floor")
    print(f"    of which the stager's copy {statistics.median(nvme_stage[1:]) * 1e3:6.1f} ms "
          "(the rest is dcp.async_save's own work)")
    print(f"  DCP default blocking      {dcp_s * 1e3:9.1f} ms  {dcp_s / nvme_s:5.2f}x NVMeStager")
    print(f"  until durable: NVMe {statistics.median(nvme_total[1:]):.3f} s, "
          f"DCP {statistics.median(dcp_total[1:]):.3f} s")
    print(f"  arena {stager_stats['arena_bytes']} bytes, pinned {stager_stats['pinned_bytes']} bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", args.json)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
