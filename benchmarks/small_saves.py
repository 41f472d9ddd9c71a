"""Fixed costs of small saves: dcp.save/dcp.load through NVMeWriter/NVMeReader against DCP's
FileSystemWriter/FileSystemReader, one process, no process group.

Two states: "small", 1 MiB in 8 float32 tensors and a step; "many", ``--many`` tensors of 1 KiB
each. The set-ups take turns within each round (interleaved), so a shared, noisy machine slows
both alike; the figures are medians over ``--rounds`` rounds after ``--warmup`` rounds not
counted. Each save goes to a fresh directory, removed after its load.

    python benchmarks/small_saves.py --dir /nvme/bench --rounds 20 --json out.json
"""

from __future__ import annotations

import argparse
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
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_nvme import NVMeReader, NVMeWriter


def small_state() -> dict:
    """1 MiB in 8 float32 tensors, and a step."""
    return {"model": {f"layer{i}.weight": torch.randn(32768) for i in range(8)}, "step": 7}


def many_state(count: int) -> dict:
    """``count`` float32 tensors of 1 KiB each."""
    return {"model": {f"t{i:05d}": torch.randn(256) for i in range(count)}}


def empty_like_state(state: dict) -> dict:
    return {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, **(
        {"step": 0} if "step" in state else {})}


SETUPS = {
    "nvme": (NVMeWriter, NVMeReader),
    "dcp_fs": (FileSystemWriter, FileSystemReader),
}


def one_round(setup: str, state: dict, root: str, n: int) -> tuple[float, float]:
    writer_cls, reader_cls = SETUPS[setup]
    path = os.path.join(root, f"{setup}_{n}")
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=writer_cls(path), no_dist=True)
    t1 = time.perf_counter()
    dest = empty_like_state(state)
    dcp.load(dest, storage_reader=reader_cls(path), no_dist=True)
    t2 = time.perf_counter()
    for key, tensor in state["model"].items():
        if not torch.equal(dest["model"][key], tensor):
            raise SystemExit(f"{setup}: {key} read back differs from what was saved")
    shutil.rmtree(path)
    return t1 - t0, t2 - t1


def measure(state: dict, root: str, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    times: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": []} for s in SETUPS}
    n = 0
    for r in range(warmup + rounds):
        order = list(SETUPS) if r % 2 == 0 else list(reversed(SETUPS))
        for setup in order:
            n += 1
            save_s, load_s = one_round(setup, state, root, n)
            if r >= warmup:
                times[setup]["save"].append(save_s)
                times[setup]["load"].append(load_s)
    return {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory by default)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--many", type=int, default=2000, help="tensors in the many-small state")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    root = tempfile.mkdtemp(prefix="small_saves_", dir=args.dir)
    try:
        results = {
            "small": measure(small_state(), root, args.rounds, args.warmup),
            "many": measure(many_state(args.many), root, max(args.rounds // 2, 5), 1),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "rounds": args.rounds,
        "many": args.many,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "results": results,
    }
    print(f"{'state':<7}{'op':<6}{'nvme ms':>10}{'dcp_fs ms':>11}{'ratio':>8}")
    for state, rows in results.items():
        for op in ("save", "load"):
            ours, theirs = rows["nvme"][op], rows["dcp_fs"][op]
            print(f"{state:<7}{op:<6}{ours * 1e3:>10.1f}{theirs * 1e3:>11.1f}{ours / theirs:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
