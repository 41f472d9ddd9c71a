"""Trainers' states on node-local disks: per-node copies vs DCP's job-wide dedup.

    sudo python benchmarks/node_local_states.py --out docs/results/node_local_states.json

Builds 2 simulated nodes x 2 ranks (harness/dcp_nvme_harness/multinode.py: each node its own disk at one path, its
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

Wiped node restore (--wiped, default ddp,hsdp; per-node copies only): after a layout's bench
launch, the host removes node 1's copy of the kept per-node step directory, then a second torchrun
launch (both nodes, fresh processes, worker ``--action restore``) loads it on every rank with
``NVMeReader(path, peers=True)``: node 1 gets what its disk lacks from node 0 over a gloo group.
Per rank: load seconds, remote bytes, sources, and a bitwise check against the state the bench
launch kept in each node's TMPDIR. Right after it, the host copies the same number of bytes
(node 1's ranks' remote bytes, summed) from node 0's rank files (in order, again from the first
when that is more than they hold) to a scratch directory on node 1's disk with sendfile, as
``shutil.copyfile`` does, then fsyncs each file and ``os.sync()``: the restore's seconds beside
the plain copy's. Both "disks" are directories of one drive here, and node 0's files are in the
page cache (written by the bench launch, read by its restart and by the restore) for both. Then
one more restore launch: the healed node's next restart (its seconds and remote bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from dcp_nvme_harness.multinode import Cluster, all_records, describe, unshare_unavailable  # noqa: E402

WORKER = HERE / "node_local_states_worker.py"
LAYOUTS = ("ddp", "hsdp", "fsdp2")
WIPED = ("ddp", "hsdp")
MB = 1e6


def rank_bytes_on_disk(cluster: Cluster, node: int, path: str) -> int:
    """The host's view of node ``node``'s disk: bytes of the rank files of a kept directory."""
    step = cluster.node_disk(node) / Path(path).relative_to(cluster.mount)
    return sum(p.stat().st_size for p in step.glob("rank_*.safetensors"))


def run_layout(cluster: Cluster, layout: str, args) -> dict:
    t0 = time.monotonic()
    keep = ["--expected"] if layout in args.wiped else []
    results = cluster.run(WORKER, layout, f"{cluster.mount}/{layout}", "--hidden", args.hidden,
                          "--layers", args.layers, "--reps", args.reps, *keep, timeout=args.timeout, check=False)
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


def copy_bytes(sources: list[Path], scratch: Path, total: int) -> dict:
    """Copy ``total`` bytes of ``sources`` (in order, cycling; the last one cut short) into
    ``scratch`` with sendfile, as shutil.copyfile does on Linux; then fsync every file, and sync."""
    scratch.mkdir(parents=True)
    left, n, written = total, 0, []
    t0 = time.perf_counter()
    while left > 0:
        src = sources[n % len(sources)]
        count = min(left, src.stat().st_size)
        dst = scratch / f"{n:03d}_{src.name}"
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            done = 0
            while done < count:
                sent = os.sendfile(fout.fileno(), fin.fileno(), done, count - done)
                if sent == 0:
                    raise OSError(f"sendfile: {src} ended at {done} of {count}")
                done += sent
        written.append(dst)
        left, n = left - count, n + 1
    t_written = time.perf_counter()
    for dst in written:
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.sync()
    t_durable = time.perf_counter()
    return {"bytes": total, "files": len(written), "written_s": round(t_written - t0, 4),
            "durable_s": round(t_durable - t0, 4)}


def wiped_restore(cluster: Cluster, summary: dict, args) -> dict:
    """Wipe node 1's per-node step, restore it on every rank with peers=True (a fresh launch),
    then copy as many bytes as node 1 fetched, node 0's disk to node 1's, and time both."""
    layout, path = summary["layout"], summary["variants"]["per-node"]["dir"]
    rel = Path(path).relative_to(cluster.mount)
    wiped = cluster.node_disk(1) / rel
    wiped_bytes = sum(p.stat().st_size for p in wiped.rglob("*") if p.is_file())
    shutil.rmtree(wiped)
    t0 = time.monotonic()
    per_rank = restore_launch(cluster, layout, path, args)
    wall = round(time.monotonic() - t0, 1)
    node_of = {p["rank"]: int(p["host"].removeprefix("node")) for p in per_rank}
    by_node = {n: [p for p in per_rank if node_of[p["rank"]] == n] for n in range(cluster.nodes)}
    fetched = sum(p["remote_bytes"] for p in by_node[1])
    after = sorted(p.name for p in wiped.iterdir()) if wiped.exists() else []
    sources = sorted((cluster.node_disk(0) / rel).glob("rank_*.safetensors"))
    copy = copy_bytes(sources, cluster.node_disk(1) / "copy_scratch" / layout, fetched)
    shutil.rmtree(cluster.node_disk(1) / "copy_scratch")
    restore_s = max(p["seconds_rank"] for p in by_node[1])
    again = restore_launch(cluster, layout, path, args)  # the healed node's next start: its own disk
    again_node1 = [p for p in again if node_of[p["rank"]] == 1]
    return {"layout": layout, "variant": "per-node", "dir": path, "wiped_node": 1, "wiped_bytes": wiped_bytes,
            "launch_wall_s": wall, "per_rank": per_rank,
            "node1_restore_max_s": restore_s, "node0_restore_max_s": max(p["seconds_rank"] for p in by_node[0]),
            "node1_remote_bytes": fetched, "node0_remote_bytes": sum(p["remote_bytes"] for p in by_node[0]),
            "bitwise": all(p["bitwise"] for p in per_rank), "node1_files_after": after,
            "copy": {**copy, "sources": [p.name for p in sources],
                     "source_bytes": sum(p.stat().st_size for p in sources)},
            "next_restart": {"per_rank": again, "node1_max_s": max(p["seconds_rank"] for p in again_node1),
                             "remote_bytes": sum(p["remote_bytes"] for p in again),
                             "bitwise": all(p["bitwise"] for p in again)},
            "restore_over_copy_durable": round(restore_s / copy["durable_s"], 2),
            "restore_over_copy_written": round(restore_s / copy["written_s"], 2)}


def restore_launch(cluster: Cluster, layout: str, path: str, args) -> list[dict]:
    """One fresh launch that loads ``path`` on every rank with peers=True: each rank's figures."""
    results = cluster.run(WORKER, layout, f"{cluster.mount}/{layout}", "--action", "restore", "--restore-dir", path,
                          "--hidden", args.hidden, "--layers", args.layers, timeout=args.timeout, check=False)
    records = [r for r in all_records(results) if "rank" in r]
    errors = [r.get("error") for r in records if r.get("error")]
    if errors or len(records) != cluster.nodes * cluster.ranks_per_node or not all(r.ok for r in results):
        raise SystemExit(f"{layout} restore failed: {errors}\n{describe(results)}")
    return [{"rank": r["rank"], "host": r["host"], **r["restore"]} for r in records]


def wiped_table(rows: list[dict]) -> str:
    head = ("| layout | node1 fetched MB (per rank) | restore s node1 / node0 (max) | bitwise | copy MB (files) "
            "| copy s written / +fsync | restore / copy (written, +fsync) | next restart s node1 (remote MB) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for w in rows:
        mine = [p for p in w["per_rank"] if p["host"] == "node1"]
        c, each = w["copy"], ", ".join(f"{p['remote_bytes'] / MB:.1f}" for p in mine)
        nxt = w.get("next_restart") or {"node1_max_s": float("nan"), "remote_bytes": float("nan")}
        lines.append(f"| {w['layout']} | {w['node1_remote_bytes'] / MB:.1f} ({each}) "
                     f"| {w['node1_restore_max_s']:.2f} / {w['node0_restore_max_s']:.2f} | {w['bitwise']} "
                     f"| {c['bytes'] / MB:.1f} ({c['files']}) | {c['written_s']:.2f} / {c['durable_s']:.2f} "
                     f"| {w['restore_over_copy_written']:.1f}x, {w['restore_over_copy_durable']:.1f}x "
                     f"| {nxt['node1_max_s']:.2f} ({nxt['remote_bytes'] / MB:.1f}) |")
    return "\n".join(lines)


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
    parser.add_argument("--wiped", default=",".join(WIPED),
                        help="layouts to also restore with node 1's step wiped (default ddp,hsdp; '' for none)")
    args = parser.parse_args()
    args.wiped = [x for x in args.wiped.split(",") if x]
    reason = unshare_unavailable()
    if reason:
        raise SystemExit(f"cannot simulate nodes here: {reason}")
    root = Path(tempfile.mkdtemp(prefix="node_local_states-", dir=args.workdir))
    t0 = time.monotonic()
    summaries, wiped = [], []
    try:
        with Cluster(root / "cluster", nodes=2, ranks_per_node=2) as cluster:
            for layout in args.layouts.split(","):
                summary = run_layout(cluster, layout, args)
                summaries.append(summary)
                print(f"{layout}: state {summary['logical_bytes'] / MB:.1f} MB (one copy of every item), "
                      f"{summary['wall_s']}s", flush=True)
                if layout in args.wiped:
                    wiped.append(wiped_restore(cluster, summary, args))
                    print(f"{layout}: wiped node 1, restored with peers=True, {wiped[-1]['launch_wall_s']}s",
                          flush=True)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    total = round(time.monotonic() - t0, 1)
    config = {"nodes": 2, "ranks_per_node": 2, "hidden": args.hidden, "layers": args.layers, "reps": args.reps,
              "torch": __import__("torch").__version__, "cpus": os.cpu_count(), "total_s": total,
              "note": "times: slowest rank, median over reps; restart in the saving processes (page cache warm)",
              "wiped_note": "wiped_restore: node 1's per-node step removed, then a fresh launch loads it with "
                            "NVMeReader(path, peers=True) on every rank; copy: the same bytes as node 1 fetched, "
                            "from node 0's rank files to node 1's disk (sendfile, then fsync + os.sync), right "
                            "after; both nodes' disks are directories of one virtual drive, and node 0's files "
                            "are in the page cache for both"}
    print(f"\n2 nodes x 2 ranks, MLP {args.layers} x Linear({args.hidden}, {args.hidden}) + AdamW, "
          f"median of {args.reps}, slowest rank; MB = rank files on each node's disk; {total}s in all\n")
    print(table(summaries))
    if wiped:
        print("\nWiped node restore (per-node copies): node 1's step removed; a fresh launch, every rank "
              "NVMeReader(peers=True); copy: as many bytes, node 0's disk -> node 1's (one drive; page cache warm)\n")
        print(wiped_table(wiped))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        doc = {"config": config, "layouts": summaries, "wiped_restore": wiped}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
