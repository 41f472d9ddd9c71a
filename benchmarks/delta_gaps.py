"""How much does delta coding gain as checkpoints grow further apart?

Trains the same small byte-level transformer as `dcp-nvme bench --compress` (AdamW, on the
standard library's own sources), keeps the state at the last step and at ``--gaps`` steps
before it, and reports per group (bf16 weights, fp32 exp_avg, fp32 exp_avg_sq) the byte-grouped
codec's full ratio and its XOR-delta ratio against each earlier state (each round trip checked
bit for bit), so the curve over the step gap is measured in one run.

With ``--drain`` it also saves the state per tensor (the model's bf16 weights and AdamW's two
moments, one tensor per parameter) at each gap's earlier step and at the last one, twice: from
tensors updated in place between the saves, as a training loop does, and from fresh tensors at
every save (``{k: v.clone()}``, as ``get_state_dict(..., cpu_offload=True)`` or a trainer that
rebuilds its state dict gives), then drains both checkpoints to a directory with
``compress="delta"`` (the earlier one coded full, the later one a delta against it) and reports
the whole checkpoint's delta ratio for both, how many tensors the fresh save placed at other
offsets than its base, and loads the reallocated delta back bit for bit.

    python benchmarks/delta_gaps.py --steps 300 --gaps 1,5,20,50,100 --dim 512 --layers 8 \
        --seq 64 --batch 4 --drain --json gaps.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
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
from dcp_nvme.tiers import codec


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


def per_tensor(groups: dict[str, torch.Tensor], shapes: list[tuple[str, torch.Size]]) -> dict[str, torch.Tensor]:
    """The flat groups cut back into one tensor per parameter (views, in the model's order)."""
    out, at = {}, 0
    for name, shape in shapes:
        n = shape.numel()
        out[f"model.{name}"] = groups["weights_bf16"][at: at + n].view(shape)
        out[f"optim.{name}.exp_avg"] = groups["exp_avg_fp32"][at: at + n].view(shape)
        out[f"optim.{name}.exp_avg_sq"] = groups["exp_avg_sq_fp32"][at: at + n].view(shape)
        at += n
    return out


def _offsets(path: str) -> dict[str, int]:
    from dcp_nvme.format.manifest import read_manifest
    from dcp_nvme.storage.local_dir import LocalStore

    return {c.fqn: c.byte_offset for c in read_manifest(LocalStore(path), path).chunks}


def drain_pair(base: dict[str, torch.Tensor], late: dict[str, torch.Tensor], root: str, in_place: bool,
               level: int, threads: int, check: bool) -> dict:
    """Save ``base`` then ``late`` as step_1 and step_2 of a run directory (in place, or fresh
    tensors at each save), drain both with compress="delta"; the delta's figures."""
    import torch.distributed.checkpoint as dcp

    from dcp_nvme import NVMeReader, NVMeWriter
    from dcp_nvme.tiers import DrainOptions, drain

    options = DrainOptions(compress="delta", level=level, codec_threads=threads, retries=0)
    live = {k: v.clone() for k, v in base.items()}
    rows = []
    for step, state in ((1, base), (2, late)):
        if in_place:
            for key, value in state.items():
                live[key].copy_(value)
        else:
            live = {k: v.clone() for k, v in state.items()}  # fresh tensors, wherever the allocator puts them
        local = os.path.join(root, "run", f"step_{step}")
        dcp.save(live, storage_writer=NVMeWriter(local), no_dist=True)
        started = time.perf_counter()
        result = drain(local, os.path.join(root, "pfs", f"step_{step}"), options=options)
        rows.append({**result.compression, "seconds": time.perf_counter() - started})
    first, second = (os.path.join(root, "run", f"step_{i}") for i in (1, 2))
    before, after = _offsets(first), _offsets(second)
    delta = rows[1].get("delta", {})
    row = {"full_ratio": rows[0]["ratio"], "ratio": rows[1]["ratio"], "stored_bytes": rows[1]["stored_bytes"],
           "bytes": rows[1]["bytes"], "delta_fraction": delta.get("fraction"), "full_items": delta.get("full_items"),
           "tensors": len(after), "moved": sum(after[k] != before.get(k) for k in after),
           "encode_seconds": rows[1]["encode_seconds"]}
    if check:
        out = {k: torch.zeros_like(v) for k, v in late.items()}
        dcp.load(out, storage_reader=NVMeReader(os.path.join(root, "pfs", "step_2")), no_dist=True)
        row["bitwise_equal"] = all(torch.equal(out[k].view(torch.uint8), late[k].contiguous().view(torch.uint8))
                                   for k in late)
    return row


def drain_gaps(snapshots: dict[int, dict[str, torch.Tensor]], gaps: list[int], shapes, level: int,
               threads: int, directory: str | None) -> dict:
    """Per gap: the whole checkpoint's delta drained, saved in place and from fresh tensors."""
    out: dict = {"in_place": {}, "reallocated": {}}
    late = per_tensor(snapshots[0], shapes)
    for gap in gaps:
        base = per_tensor(snapshots[gap], shapes)
        for kind in out:
            root = tempfile.mkdtemp(prefix="dcp-nvme-gaps-", dir=directory)
            try:
                out[kind][gap] = drain_pair(base, late, root, kind == "in_place", level, threads,
                                            check=kind == "reallocated" and gap == gaps[0])
            finally:
                shutil.rmtree(root, ignore_errors=True)
    return out


def model_shapes(dim: int, layers: int, seq: int) -> list[tuple[str, torch.Size]]:
    from dcp_nvme.bench.compression import TinyLM

    return [(name, p.shape) for name, p in TinyLM(dim, layers, seq).named_parameters()]


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
    parser.add_argument("--drain", action="store_true",
                        help="also save and drain the state per tensor, in place and reallocated")
    parser.add_argument("--directory", help="where --drain saves and drains (default: a temp dir)")
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
    if args.drain:
        drained = drain_gaps(snapshots, gaps, model_shapes(args.dim, args.layers, args.seq), args.level,
                             args.threads, args.directory)
        doc["drain"] = drained
        print("drained checkpoints (compress='delta', whole state, per tensor):")
        print(f"{'saved':<13}{'full':>8}" + "".join(f"{'gap ' + str(g):>10}" for g in gaps) + "   tensors moved")
        for kind, rows in drained.items():
            first = rows[gaps[0]]
            print(f"{kind:<13}{first['full_ratio']:>7.3f}x" + "".join(f"{rows[g]['ratio']:>9.3f}x" for g in gaps)
                  + f"   {'/'.join(str(rows[g]['moved']) for g in gaps)} of {first['tensors']}")
        ratios = [drained["reallocated"][g]["stored_bytes"] / drained["in_place"][g]["stored_bytes"] for g in gaps]
        print("reallocated / in place stored bytes: " + ", ".join(f"{r:.4f}" for r in ratios))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(doc, handle, indent=1)
        print("wrote", args.json)
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
