"""Surviving a node loss, measured in one run on one machine (loopback stands in for the network).

    python benchmarks/node_loss.py --size 512MiB --json node_loss.json

Saves one rank's checkpoint of --size bytes, marks it as node 1's copy of a node-local save,
and times, on the same bytes:

  replication     pull_replica over the peer byte server (verified, fsynced, marker last)
  socket copy     the same file sent over one plain TCP socket (sendfile) and written + fsynced
  restore local   dcp.load from this node's own directory
  restore peer    dcp.load on a "replacement node" (an empty directory): every byte from the peer server
  restore mirror  the same, from a directory mirror, and from a loopback S3 server (moto)
  plain read      the rank file read sequentially (buffered, 8 MiB reads; page cache dropped first
                  where allowed); one-stream vs ranged S3 GETs of the same object
  loss window     after the local commit, the seconds until a second copy exists: the drain to the
                  mirror at --drain-bandwidth (replicas=0) vs the replica (replicas=1)

Prints its configuration and a table; writes every figure to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from dcp_nvme import NVMeReader, NVMeWriter  # noqa: E402
from dcp_nvme.config import parse_size  # noqa: E402
from dcp_nvme.format.manifest import read_manifest, seal  # noqa: E402
from dcp_nvme.observe.machine import evict_from_page_cache  # noqa: E402
from dcp_nvme.peers import sources
from dcp_nvme.peers.client import PeerSource
from dcp_nvme.peers.replicate import pull_replica
from dcp_nvme.peers.server import PeerServer
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


def socket_copy(src: str, dest: str) -> float:
    """One TCP stream: sendfile on one side, recv + write + fsync on the other."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        conn, _ = listener.accept()
        with conn, open(src, "rb") as f:
            conn.sendfile(f)

    thread = threading.Thread(target=send)
    thread.start()
    began = time.perf_counter()
    buffer = memoryview(bytearray(8 << 20))
    with socket.create_connection(("127.0.0.1", port)) as sock, open(dest, "wb") as out:
        while True:
            n = sock.recv_into(buffer)
            if not n:
                break
            out.write(buffer[:n])
        out.flush()
        os.fsync(out.fileno())
    seconds = time.perf_counter() - began
    thread.join()
    listener.close()
    return seconds


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
              "torch": torch.__version__, "transport": "loopback TCP"}
    print(json.dumps(config, indent=1))
    rows: dict[str, dict] = {}

    def row(name: str, seconds: float, nbytes: int, **extra) -> None:
        rows[name] = {"seconds": round(seconds, 4), "bytes": nbytes, "s_per_gib": round(seconds * GIB / nbytes, 4),
                      "gbps": round(nbytes / seconds / 1e9, 3), **extra}

    state = make_state(size)
    owner = os.path.join(root, "node1", "step_1")
    servers: list[PeerServer] = []
    try:
        save_s, _ = timed(lambda: dcp.save(state, storage_writer=NVMeWriter(owner, block_size=block), no_dist=True))
        as_node_local(owner)
        manifest = read_manifest(LocalStore(owner), owner)
        rank_file, key = manifest.file_names[0], manifest.save_key
        nbytes = os.path.getsize(os.path.join(owner, rank_file))
        row("local commit (save)", save_s, nbytes)

        # --- replication beside a plain socket copy of the same bytes
        holder = os.path.join(root, "node2", "step_1")
        os.makedirs(holder)
        server = PeerServer()
        servers.append(server)
        server.register(owner, served_as=holder)
        drop_dir(owner)
        seconds, copied = timed(lambda: pull_replica(PeerSource(server.info(), holder, "", "1"), holder, "1", key,
                                                     queue_depth=args.queue_depth, block_size=block))
        row("replication (peer server, verified)", seconds, copied)
        drop_dir(owner)
        row("socket copy (1 stream, sendfile)", socket_copy(os.path.join(owner, rank_file),
                                                             os.path.join(root, "socket.copy")), nbytes)
        os.unlink(os.path.join(root, "socket.copy"))

        # --- restores: local, peer, mirror directory, mirror S3; beside a plain read
        drop_dir(owner)
        row("plain read (buffered, 8 MiB)", plain_read(os.path.join(owner, rank_file)), nbytes)
        drop_dir(owner)
        out = empty_like(state)
        seconds, _ = timed(lambda: dcp.load(out, storage_reader=NVMeReader(owner), no_dist=True))
        assert all(torch.equal(out[k], state[k]) for k in state)
        row("restore local", seconds, nbytes)

        replacement = os.path.join(root, "node3", "step_1")
        server.register(owner, served_as=replacement)
        sources.join_peers = lambda p, node: [{**server.info(), "node": "1"}]  # the job's store, in one process
        drop_dir(owner)
        out = empty_like(state)
        reader = NVMeReader(replacement, peers=True, block_size=block, queue_depth=args.queue_depth)
        seconds, _ = timed(lambda: dcp.load(out, storage_reader=reader, no_dist=True))
        assert all(torch.equal(out[k], state[k]) for k in state)
        row("restore peer (replacement node)", seconds, nbytes, sources=reader.last_stats["sources"])
        sources.join_peers = lambda p, node: []

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

        # --- the loss window after the local commit: until a second copy exists
        rows["loss window"] = {"replicas=0 (until mirrored)": round(drain_s, 3),
                               "replicas=1 (until the replica commits)": rows["replication (peer server, verified)"]["seconds"]}

        if not args.no_s3:
            s3_rows(args, root, owner, rank_file, nbytes, state, block, row)
    finally:
        for server in servers:
            server.close()
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
    from s3server import S3Server

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
