"""Surviving a node loss in one process: restores from this node's disk and from a mirror.

A directory and a loopback S3 server (moto) stand in for the mirror; one run on one machine.

    python benchmarks/node_loss.py --size 512MiB --json node_loss.json

Saves one rank's checkpoint of --size bytes, marks it as node 1's copy of a node-local save,
and times, on the same bytes:

  restore local   dcp.load from this node's own directory
  drain           the drain to a directory mirror at --drain-bandwidth (replicas=0: until it ends,
                  the step has one copy)
  restore mirror  dcp.load on a "replacement node" (an empty directory), every file from the
                  directory mirror, and from a loopback S3 server (moto)
  plain read      the rank file read sequentially (buffered, 8 MiB reads; page cache dropped first
                  where allowed); one-stream vs ranged S3 GETs of the same object

Replication and restores between nodes go over gloo groups of several processes:
benchmarks/node_local_states.py measures a wiped node's restore that way.

Prints its configuration and a table; writes every figure to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from dcp_nvme import NVMeReader, NVMeWriter  # noqa: E402
from dcp_nvme.config import parse_size  # noqa: E402
from dcp_nvme.format.manifest import read_manifest, seal  # noqa: E402
from dcp_nvme.observe.machine import evict_from_page_cache  # noqa: E402
from dcp_nvme.storage.local_dir import LocalStore  # noqa: E402
from dcp_nvme.tiers import DrainOptions, drain  # noqa: E402

GIB = 1 << 30


def make_state(nbytes: int, tensors: int = 16) -> dict:
    per = nbytes // 4 // tensors
    return {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}


def empty_like(state: dict) -> dict:
    return {k: torch.empty_like(v) for k, v in state.items()}


def drop_dir(directory: str) -> None:
    evict_from_page_cache([os.path.join(directory, name) for name in os.listdir(directory)])


def timed(fn):
    began = time.perf_counter()
    value = fn()
    return time.perf_counter() - began, value


def as_node_local(path: str, node: str = "1") -> None:
    """Mark a one-rank checkpoint as node ``node``'s copy of a node-local save (its manifest's topology)."""
    store = LocalStore(path)
    doc = json.loads(store.read("manifest.json"))
    doc.pop("manifest_crc32c", None)
    doc["topology"] = {"mode": "node-local", "nodes": [node], "rank_nodes": [0]}
    store.write_atomic("manifest.json", seal(doc))
    read_manifest(store, path)


def plain_read(path: str, block: int = 8 << 20) -> float:
    evict_from_page_cache([path])
    began = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(block):
            pass
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--dir", default=None, help="where the node directories go (default: a temp dir)")
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--block-size", default="8MiB")
    parser.add_argument("--drain-bandwidth", default="200MB", help="the drain's cap (bytes/s), as a job sets it")
    parser.add_argument("--no-s3", action="store_true", help="skip the loopback S3 rows (moto)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    size, block = parse_size(args.size), parse_size(args.block_size)
    root = args.dir or tempfile.mkdtemp(prefix="node-loss-")
    os.makedirs(root, exist_ok=True)
    config = {"size_bytes": size, "queue_depth": args.queue_depth, "block_size": block,
              "drain_bandwidth": parse_size(args.drain_bandwidth), "dir": root, "cpus": os.cpu_count(),
              "torch": torch.__version__}
    print(json.dumps(config, indent=1))
    rows: dict[str, dict] = {}

    def row(name: str, seconds: float, nbytes: int, **extra) -> None:
        rows[name] = {"seconds": round(seconds, 4), "bytes": nbytes, "s_per_gib": round(seconds * GIB / nbytes, 4),
                      "gbps": round(nbytes / seconds / 1e9, 3), **extra}

    state = make_state(size)
    owner = os.path.join(root, "node1", "step_1")
    try:
        save_s, _ = timed(lambda: dcp.save(state, storage_writer=NVMeWriter(owner, block_size=block), no_dist=True))
        as_node_local(owner)
        manifest = read_manifest(LocalStore(owner), owner)
        rank_file = manifest.file_names[0]
        nbytes = os.path.getsize(os.path.join(owner, rank_file))
        row("local commit (save)", save_s, nbytes)

        # --- restores: local, mirror directory, mirror S3; beside a plain read
        drop_dir(owner)
        row("plain read (buffered, 8 MiB)", plain_read(os.path.join(owner, rank_file)), nbytes)
        drop_dir(owner)
        out = empty_like(state)
        seconds, _ = timed(lambda: dcp.load(out, storage_reader=NVMeReader(owner), no_dist=True))
        assert all(torch.equal(out[k], state[k]) for k in state)
        row("restore local", seconds, nbytes)

        mirror_root = os.path.join(root, "mirror")
        options = DrainOptions(bandwidth=parse_size(args.drain_bandwidth))
        drain_s, _ = timed(lambda: drain(owner, os.path.join(mirror_root, "step_1"), options=options))
        row(f"drain to mirror dir (cap {args.drain_bandwidth}/s)", drain_s, nbytes)
        fresh = os.path.join(root, "node4", "step_1")
        drop_dir(os.path.join(mirror_root, "step_1"))
        out = empty_like(state)
        reader = NVMeReader(fresh, mirror=mirror_root, block_size=block, queue_depth=args.queue_depth)
        seconds, _ = timed(lambda: dcp.load(out, storage_reader=reader, no_dist=True))
        assert all(torch.equal(out[k], state[k]) for k in state)
        row("restore mirror dir", seconds, nbytes, sources=reader.last_stats["sources"])

        if not args.no_s3:
            s3_rows(args, root, owner, rank_file, nbytes, state, block, row)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'row':<44} {'seconds':>9} {'s/GiB':>8} {'GB/s':>7}")
    for name, r in rows.items():
        if "seconds" in r:
            print(f"{name:<44} {r['seconds']:9.3f} {r['s_per_gib']:8.3f} {r['gbps']:7.3f}")
        else:
            print(f"{name:<44} {json.dumps(r)}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": config, "rows": rows}, handle, indent=1)
    return 0


def s3_rows(args, root, owner, rank_file, nbytes, state, block, row) -> None:
    from dcp_nvme_harness.s3server import S3Server

    srv = S3Server(proxy=False)
    srv.start()
    try:
        storage = srv.storage_options()
        srv.s3fs().mkdir("bench")
        drain(owner, "s3://bench/run/step_1", storage_options=storage)
        fs = srv.s3fs()
        path = f"bench/run/step_1/{rank_file}"
        seconds, _ = timed(lambda: fs.cat_file(path))
        row("plain S3 GET (1 stream)", seconds, nbytes)
        ranges = [(o, min(nbytes, o + block)) for o in range(0, nbytes, block)]
        with ThreadPoolExecutor(args.queue_depth) as pool:
            seconds, _ = timed(lambda: list(pool.map(lambda r: fs.cat_file(path, start=r[0], end=r[1]), ranges)))
        row(f"plain S3 ranged GETs ({args.queue_depth} in flight)", seconds, nbytes)
        fresh = os.path.join(root, "node5", "step_1")
        out = empty_like(state)
        reader = NVMeReader(fresh, mirror="s3://bench/run", mirror_options=storage, block_size=block,
                            queue_depth=args.queue_depth)
        seconds, _ = timed(lambda: dcp.load(out, storage_reader=reader, no_dist=True))
        assert all(torch.equal(out[k], state[k]) for k in state)
        row("restore mirror S3 (moto, loopback)", seconds, nbytes, sources=reader.last_stats["sources"])
    finally:
        srv.close()


if __name__ == "__main__":
    sys.exit(main())
