"""Trainers' states on node-local disks: per-node copies vs DCP's job-wide dedup (issue 39).

    sudo python benchmarks/node_local_states.py --out docs/results/node_local_states.json

Builds 2 simulated nodes x 2 ranks (tests/multinode.py: each node its own disk at one path, its
own host name; torchrun over gloo on loopback; needs root) and, per layout (ddp, hsdp, fsdp2),
one torchrun launch of benchmarks/node_local_states_worker.py that saves the same trained state
of an MLP (--layers x Linear(--hidden, --hidden), AdamW) with a plain NVMeWriter under both
variants, interleaved:

  per-node   dcp_nvme.save.copies.ENABLED = True: each node's disk gets every item its ranks hold
  job-wide   ENABLED = False: DCP's dedup, each item written once in the whole job

and reports, per layout and variant: rank-file bytes on each node's disk and the copies table's
rows; the median (over --reps) seconds of dcp.save and of dcp.async_save with an NVMeStager
(until it returned, until durable), the slowest rank's; and a restart at the same world size with
a plain NVMeReader (seconds, bytes and remote bytes per rank; the job-wide save's error, which
cannot restart from its nodes' own disks). The restart runs in the saving processes: the page
cache holds the files. Prints a markdown table and writes every figure to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from multinode import Cluster, all_records, describe, unshare_unavailable  # noqa: E402

WORKER = HERE / "node_local_states_worker.py"
LAYOUTS = ("ddp", "hsdp", "fsdp2")
MB = 1e6


def rank_bytes_on_disk(cluster: Cluster, node: int, path: str) -> int:
    """The host's view of node ``node``'s disk: bytes of the rank files of a kept directory."""
    step = cluster.node_disk(node) / Path(path).relative_to(cluster.mount)
    return sum(p.stat().st_size for p in step.glob("rank_*.safetensors"))


def run_layout(cluster: Cluster, layout: str, args) -> dict:
    t0 = time.monotonic()
    results = cluster.run(WORKER, layout, f"{cluster.mount}/{layout}", "--hidden", args.hidden,
                          "--layers", args.layers, "--reps", args.reps, timeout=args.timeout, check=False)
    records = all_records(results)
    errors = [r for r in records if r.get("error")]
    summary = next((r["summary"] for r in records if "summary" in r), None)
    if errors or summary is None or not all(r.ok for r in results):
        raise SystemExit(f"{layout} failed: {[r.get('error') for r in errors]}\n{describe(results)}")
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    for variant in summary["variants"].values():  # cross-check the workers' figures from the host
        for node, disk in enumerate(variant["disks"]):
            disk["rank_bytes_host"] = rank_bytes_on_disk(cluster, int(disk["host"].removeprefix("node")),
                                                         variant["dir"])
            assert disk["host"] == cluster.hostname(node), variant["disks"]
    return summary


def table(layouts: list[dict]) -> str:
    head = ("| layout | variant | node0 MB | node1 MB | copies rows | sync s | async blocking "
            "| async durable s | restart s | restart read MB per rank (remote) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in layouts:
        for name, v in s["variants"].items():
            mb = [f"{d['rank_bytes'] / MB:.1f}" for d in v["disks"]]
            rows = sorted({d["copies_rows"] for d in v["disks"]})
            r = v["restart"]
            if r["error"]:
                first = r["error"].split(" | ")[0].split(": ", 1)[-1].replace("DIR: ", "")
                restart, reads = "fails", first if len(first) <= 110 else first[:107] + "..."
            else:
                restart = f"{r['seconds']:.2f}"
                reads = ", ".join(f"{p['bytes'] / MB:.1f} ({p['remote_bytes'] / MB:.0f})" for p in r["per_rank"])
            lines.append(f"| {s['layout']} | {name} | {mb[0]} | {mb[1]} | {'/'.join(map(str, rows))} "
                         f"| {v['sync_median_s']:.2f} | {v['async_blocking_median_s'] * 1e3:.0f} ms "
                         f"| {v['async_durable_median_s']:.2f} | {restart} | {reads} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write every figure here (JSON)")
    parser.add_argument("--hidden", type=int, default=1792, help="the MLP's width (default 1792)")
    parser.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    parser.add_argument("--reps", type=int, default=3, help="saves per variant and mode (default 3)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated (default ddp,hsdp,fsdp2)")
    parser.add_argument("--workdir", default=None, help="where the simulated nodes' disks go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per layout's run")
    parser.add_argument("--keep", action="store_true", help="keep the nodes' disks")
    args = parser.parse_args()
    reason = unshare_unavailable()
    if reason:
        raise SystemExit(f"cannot simulate nodes here: {reason}")
    root = Path(tempfile.mkdtemp(prefix="node_local_states-", dir=args.workdir))
    t0 = time.monotonic()
    summaries = []
    try:
        with Cluster(root / "cluster", nodes=2, ranks_per_node=2) as cluster:
            for layout in args.layouts.split(","):
                summary = run_layout(cluster, layout, args)
                summaries.append(summary)
                print(f"{layout}: state {summary['logical_bytes'] / MB:.1f} MB (one copy of every item), "
                      f"{summary['wall_s']}s", flush=True)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    total = round(time.monotonic() - t0, 1)
    config = {"nodes": 2, "ranks_per_node": 2, "hidden": args.hidden, "layers": args.layers, "reps": args.reps,
              "torch": __import__("torch").__version__, "cpus": os.cpu_count(), "total_s": total,
              "note": "times: slowest rank, median over reps; restart in the saving processes (page cache warm)"}
    print(f"\n2 nodes x 2 ranks, MLP {args.layers} x Linear({args.hidden}, {args.hidden}) + AdamW, "
          f"median of {args.reps}, slowest rank; MB = rank files on each node's disk; {total}s in all\n")
    print(table(summaries))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": config, "layouts": summaries}, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
