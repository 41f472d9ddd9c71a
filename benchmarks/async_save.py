"""How long does dcp.async_save block the training thread?

Figures from one run, on one synthetic state (float32 tensors, a few odd sizes):

- floor: one plain copy of the same tensors into prefaulted, page-aligned memory (the faster of
  memmove and torch's multi-threaded copy_)
- nvme: dcp.async_save with NVMeWriter + one persistent NVMeStager
- dcp_best: dcp.async_save with FileSystemWriter + one persistent DefaultStager with async
  staging (pinned memory and non-blocking copies where CUDA is present): DCP's best set-up
- dcp_default: dcp.async_save with FileSystemWriter and no stager (DCP's default)

For each: seconds until async_save returned (the caller has its thread back), until staged
(``staging_completion``: the caller may mutate its tensors) and until durable; 2nd and later
saves (warm buffers), the three set-ups taking turns. Each save's upload is awaited before the
next, and its directory removed after.

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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from dcp_nvme import NVMeStager, NVMeWriter
from dcp_nvme.config import parse_size
from dcp_nvme.engines.host_io import aligned_buffer


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


def timed_async_save(state, path, **kwargs) -> tuple[float, float, float]:
    """(seconds until async_save returned, until staged, until durable)."""
    started = time.perf_counter()
    resp = dcp.async_save(state, no_dist=True, **kwargs)
    returned = time.perf_counter() - started
    if hasattr(resp, "staging_completion"):
        resp.staging_completion.result()
        staged = time.perf_counter() - started
        resp.upload_completion.result()
    else:
        staged = returned
        resp.result()
    total = time.perf_counter() - started
    shutil.rmtree(path, ignore_errors=True)
    return returned, staged, total


def dcp_best_options() -> StagingOptions:
    """DCP's best stager for the THREAD checkpointer: async staging, pinned memory and
    non-blocking copies where CUDA is there (DCP refuses them without), no shared memory (it
    only serves the PROCESS checkpointer)."""
    cuda = torch.cuda.is_available()
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                          use_non_blocking_copy=cuda)


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

    # the three set-ups take turns, save by save, so a change in the machine's load hits all alike
    stager, best = NVMeStager(), DefaultStager(dcp_best_options())
    methods = {
        "nvme": lambda path: dict(storage_writer=NVMeWriter(path, block_size=args.block_size,
                                                            queue_depth=args.queue_depth), async_stager=stager),
        "dcp_best": lambda path: dict(storage_writer=FileSystemWriter(path), async_stager=best),
        "dcp_default": lambda path: dict(storage_writer=FileSystemWriter(path)),
    }
    times: dict[str, dict[str, list[float]]] = {m: {"returned": [], "staged": [], "durable": []} for m in methods}
    nvme_copy: list[float] = []
    order = list(methods)
    for i in range(args.saves):
        for name in order[i % len(order):] + order[: i % len(order)]:
            path = os.path.join(root, f"{name}_{i}")
            returned, staged, durable = timed_async_save(state, path, **methods[name](path))
            for key, value in (("returned", returned), ("staged", staged), ("durable", durable)):
                times[name][key].append(value)
            if name == "nvme":
                nvme_copy.append(stager.stats()["last_copy_seconds"])
    stager_stats = stager.stats()
    stager.close()
    best.close()

    floor_s = statistics.median(floor[1:])
    med = {m: {k: statistics.median(v[1:]) for k, v in t.items()} for m, t in times.items()}
    ours, peer = med["nvme"], med["dcp_best"]
    results = {
        "config": config,
        "floor_copy": summary(floor[1:]),
        "dcp_best_stager": dict(vars(dcp_best_options())),
        **{f"{m}_{k}": summary(v[1:]) for m, t in times.items() for k, v in t.items()},
        **{f"{m}_first_staged_s": round(t["staged"][0], 6) for m, t in times.items()},
        "nvme_copy_only": summary(nvme_copy[1:]),
        "nvme_staged_vs_floor": round(ours["staged"] / floor_s, 3),
        "dcp_best_staged_vs_nvme": round(peer["staged"] / ours["staged"], 3),
        "dcp_default_staged_vs_nvme": round(med["dcp_default"]["staged"] / ours["staged"], 3),
        "goal_met": {"returns_no_later_than_dcp_best": ours["returned"] <= peer["returned"],
                     "staged_no_later_than_dcp_best": ours["staged"] <= peer["staged"]},
        "stager": stager_stats,
    }
    gb = nbytes / 1e9
    print(f"state: {gb:.3f} GB in {len(tensors(state))} tensors; medians of saves 2..{args.saves}, "
          "interleaved; returned = async_save gave the thread back, staged = staging_completion")
    print(f"  floor (plain copy)            {floor_s * 1e3:9.1f} ms  {gb / floor_s:6.2f} GB/s")
    for name, label in (("nvme", "NVMeStager"), ("dcp_best", "DCP DefaultStager (async)"),
                        ("dcp_default", "DCP default stager")):
        m = med[name]
        print(f"  {label:<28} returned {m['returned'] * 1e3:8.2f} ms  staged {m['staged'] * 1e3:8.1f} ms "
              f"({m['staged'] / floor_s:4.2f}x floor)  durable {m['durable']:.3f} s")
    print(f"    NVMeStager's copy alone {statistics.median(nvme_copy[1:]) * 1e3:6.1f} ms (staging thread, one core)")
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
