"""How much does delta coding gain as checkpoints grow further apart?

Trains the same small byte-level transformer as `dcp-nvme bench --compress` (AdamW, on the
standard library's own sources), keeps the state at the last step and at ``--gaps`` steps
before it, and reports per group (bf16 weights, fp32 exp_avg, fp32 exp_avg_sq) the byte-grouped
codec's full ratio and its XOR-delta ratio against each earlier state (each round trip checked
bit for bit), so the curve over the step gap is measured in one run.

    python benchmarks/delta_gaps.py --steps 300 --gaps 1,5,20,50,100 --dim 512 --layers 8 \
        --seq 64 --batch 4 --json gaps.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from dcp_nvme.bench.compression import (
    GROUPS,
    CompressOptions,
    _bytes,
    group_dtype,
    measure_group,
    train_snapshots,
)
from dcp_nvme.format import codec


def parse_gaps(text: str, steps: int) -> list[int]:
    gaps = sorted({int(g) for g in text.split(",") if g.strip()})
    if not gaps or gaps[0] < 1 or gaps[-1] >= steps:
        raise SystemExit(f"--gaps: whole numbers from 1 to {steps - 1} (--steps - 1), got {text!r}")
    return gaps


def train_with_snapshots(steps: int, gaps: list[int], dim: int, layers: int, seq: int, batch: int,
                         seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """The groups' state at the last step (gap 0) and ``gap`` steps before it."""
    options = CompressOptions(steps=steps, dim=dim, layers=layers, seq=seq, batch=batch, seed=seed)
    snapshots, _ = train_snapshots(options, {steps - g for g in [0, *gaps]})
    return {g: snapshots[steps - g] for g in [0, *gaps]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--gaps", default="1,5,20,50,100")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--level", type=int, default=codec.DEFAULT_LEVEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise SystemExit("--steps: at least 2")
    gaps = parse_gaps(args.gaps, args.steps)
    config = {"steps": args.steps, "gaps": gaps, "dim": args.dim, "layers": args.layers, "seq": args.seq,
              "batch": args.batch, "level": args.level, "threads": args.threads, "torch": torch.__version__,
              "python": platform.python_version()}
    print("configuration:", json.dumps(config), flush=True)
    started = time.perf_counter()
    snapshots = train_with_snapshots(args.steps, gaps, args.dim, args.layers, args.seq, args.batch)
    config["train_seconds"] = round(time.perf_counter() - started, 2)
    late = snapshots[0]
    results: dict[str, dict] = {}
    for group in GROUPS:
        dtype = group_dtype(group)
        data = _bytes(late[group])
        full = measure_group(data, dtype, args.level, args.threads)["bytegroup_ratio"]
        deltas = {g: measure_group(data, dtype, args.level, args.threads, base=_bytes(snapshots[g][group]))
                  ["bytegroup_ratio"] for g in gaps}
        results[group] = {"bytes": len(data), "full": full, "delta": deltas}
    print(f"{'group':<17}{'full':>8}" + "".join(f"{'gap ' + str(g):>10}" for g in gaps))
    for group, row in results.items():
        print(f"{group:<17}{row['full']:>7.3f}x" + "".join(f"{row['delta'][g]:>9.3f}x" for g in gaps))
    total = sum(r["bytes"] for r in results.values())
    whole = {g: total / sum(r["bytes"] / r["delta"][g] for r in results.values()) for g in gaps}
    whole_full = total / sum(r["bytes"] / r["full"] for r in results.values())
    print(f"{'whole state':<17}{whole_full:>7.3f}x" + "".join(f"{whole[g]:>9.3f}x" for g in gaps))
    doc = {"configuration": config, "groups": results, "whole": {"full": whole_full, "delta": whole}}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(doc, handle, indent=1)
        print("wrote", args.json)
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
