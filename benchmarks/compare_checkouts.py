"""Save and load throughput of two checkouts of dcp_nvme, interleaved round by round.

    git worktree add /tmp/old <commit>
    python benchmarks/compare_checkouts.py /tmp/old . --size 1GiB --rounds 5 --dir /nvme/bench

Each round runs one fresh process per checkout (the order alternates between rounds), and each
process saves a Llama-shaped bf16 state with NVMeWriter (O_DIRECT, fsynced) and loads it back
with NVMeReader (every block verified) into preallocated tensors. The figures are ratios within
one run: the machine's own drift hits both checkouts alike. Prints one JSON line per process and
a summary (median GB/s per checkout, new/old, and the median of the rounds' new/old ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch, torch.distributed.checkpoint as dcp
import dcp_nvme
from dcp_nvme import NVMeReader, NVMeWriter
size, path = int(sys.argv[1]), sys.argv[2]
rows = max(1, size // (4096 * 2 * 8))
state = {f"layers.{i}.w": torch.randn(rows, 4096).to(torch.bfloat16) for i in range(8)}
nbytes = sum(t.numel() * t.element_size() for t in state.values())
started = time.perf_counter()
dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
saved = time.perf_counter() - started
out = {k: torch.empty_like(v) for k, v in state.items()}
started = time.perf_counter()
dcp.load(out, storage_reader=NVMeReader(path), no_dist=True)
loaded = time.perf_counter() - started
assert all(torch.equal(out[k], state[k]) for k in state)
print(json.dumps({"package": dcp_nvme.__file__, "bytes": nbytes, "save_gbps": nbytes / saved / 1e9,
                  "load_gbps": nbytes / loaded / 1e9}))
"""


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def run_one(root: str, size: int, directory: str) -> dict:
    path = tempfile.mkdtemp(dir=directory)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
    try:
        # run from the scratch directory: `python -c` puts the working directory first on sys.path
        done = subprocess.run([sys.executable, "-c", CHILD, str(size), os.path.join(path, "ckpt")],
                              env=env, cwd=path, capture_output=True, text=True, check=True)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if not row["package"].startswith(os.path.abspath(root) + os.sep):
        raise SystemExit(f"the child imported {row['package']}, not the checkout at {root}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    args = parser.parse_args()
    size = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)  # the README's command names a folder that may not exist yet
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for index in range(args.rounds):
        order = ("old", "new") if index % 2 == 0 else ("new", "old")
        for name in order:
            row = run_one(getattr(args, name), size, args.dir)
            results[name].append(row)
            print(json.dumps({"round": index, "checkout": name, **row}), flush=True)
    summary = {name: {key: statistics.median(r[key] for r in rows) for key in ("save_gbps", "load_gbps")}
               for name, rows in results.items()}
    summary["new_over_old"] = {key: summary["new"][key] / summary["old"][key] for key in ("save_gbps", "load_gbps")}
    # each round's pair ran back to back: the median of their ratios is the least drift-prone figure
    summary["paired_median"] = {key: statistics.median(n[key] / o[key] for n, o in zip(results["new"], results["old"]))
                                for key in ("save_gbps", "load_gbps")}
    print(json.dumps({"summary": summary, "rounds": args.rounds, "bytes": results["new"][0]["bytes"]}))


if __name__ == "__main__":
    main()
