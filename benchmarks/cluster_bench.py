"""Checkpoint transfers between nodes against the link they cross.

    sudo .venv/bin/python benchmarks/cluster_bench.py --out docs/results/cluster_bench.json

Builds a private network of shaped links (harness/dcp_nvme_harness/netns.py: a namespace per node, veth to a
switch, tbf at --rate on both ends of each link, netem delay where the kernel has it), three
simulated nodes of one rank each on it (harness/dcp_nvme_harness/multinode.py: own disk, own host name, torchrun
over gloo on eth0) and SeaweedFS on a node of its own (harness/dcp_nvme_harness/seaweed.py: S3, and its filer as a
FUSE file system through one ``weed mount`` per node, run on that node's network: the
"filesystem node"). Then, in one run, on --size bytes of state (16 matrices of --cols columns,
each rank a third of their rows):

  replication      a node-local save with replicas=2: every node pulls both others' files
  restore 1 holder node 2 wiped, its files' replica on node 1 only: NVMeReader(peers=True)
  restore 2 holders node 2 wiped, replicas on nodes 0 and 1: the exchange takes ranges of both;
                   with symmetric links, and again with node 2's downlink at --fat-factor x rate
  drain to FS      every node drains its files to a directory on its weed mount, all at once
  drain to S3      the same to SeaweedFS's S3
  restore from S3  node 2's copy removed: NVMeReader(mirror=s3://...) on all ranks (the exchange: what no node holds comes from the mirror)
  (whole spans)    with --whole-spans: the same restore with each span from the mirror checked and
                   kept whole (as before mirror_reads.KEEP_PIECE), just before it
  (before)         with --mirror-before (default): the same restore with the exchange's mirror
                   reads as the exchange made them before its ranged reads (a span at a time, one read each)
  drain cap        node 0 drains a third of the state at --cap-fraction x rate while every rank
                   runs gloo all-reduces over the same links; the all-reduces alone before

each beside a plain copy of the same bytes over the same links in the same run (one TCP stream
per sender, python sockets; a plain write into the weed mount; boto3 multipart uploads and
ranged GETs with as many in flight as the drain and the reader use), and as a fraction of what
the links allow. Prints the link, whether its delay is shaped, and a markdown table; writes
every figure to --out, with node 2's seconds in each step of the exchange (``profile``). --only
picks the rows after the link and replication ones (``--only ""``: those two alone, the smoke
test's). Needs root (namespaces, tc, FUSE); nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from dcp_nvme_harness.multinode import Cluster, all_records, describe, unshare_unavailable  # noqa: E402
from dcp_nvme_harness.netns import Network, network_unavailable, parse_rate  # noqa: E402
from dcp_nvme_harness.seaweed import SeaweedFS, fuse_unavailable  # noqa: E402

from dcp_nvme.config import parse_size  # noqa: E402

WORKER = HERE / "cluster_bench_worker.py"
PY = sys.executable
NODES = 3
BUCKET = "bench"
QUEUE_DEPTH = 8  # the reader's default requests in flight (IOConfig), for the ranged-GET reference
BLOCK = 8 << 20  # and its default block size
MAX_TRANSFERS = 4  # DrainOptions' default pieces in flight, for the upload reference


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.root = Path(args.dir or tempfile.mkdtemp(prefix="cluster-bench-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.link = parse_rate(args.rate)
        self.rows: list[dict] = []
        self.runs: dict[str, dict] = {}
        self.net: Network | None = None
        self.srv: SeaweedFS | None = None
        self.cluster: Cluster | None = None
        self.mounts: list = []

    # -- set-up --------------------------------------------------------------------------
    def start(self) -> None:
        self.net = Network(rate=self.args.rate, delay_ms=self.args.delay_ms, mtu=self.args.mtu)
        self.srv = SeaweedFS(self.root / "s3", network=self.net, name="s3").start()
        self.srv.s3fs().mkdir(BUCKET)
        self.cluster = Cluster(self.root / "cluster", nodes=NODES, ranks_per_node=1, network=self.net)
        for i in range(NODES):  # each node's own weed mount, on its own link
            self.mounts.append(self.srv.mount(self.root / f"pfs{i}", via=self.node(i)))

    def node(self, i: int):
        return self.net.nodes[self.cluster.hostname(i)]

    def close(self) -> None:
        for m in self.mounts:
            m.close()
        for thing in (self.cluster, self.srv, self.net):
            if thing is not None:
                thing.close()

    # -- running things --------------------------------------------------------------------
    def torchrun(self, phase: str, *extra, env_per_node=None, timeout: float = 300) -> list[dict]:
        env = {"S3_ROOT": f"s3://{BUCKET}", "S3_OPTIONS": json.dumps(self.srv.storage_options(node=True))}
        t0 = time.monotonic()
        results = self.cluster.run(WORKER, phase, f"{self.cluster.mount}/bench", "--size", self.args.size_bytes,
                                   "--cols", self.args.cols, *extra, env=env, env_per_node=env_per_node,
                                   timeout=timeout, check=False)
        records = all_records(results)
        if not all(r.ok for r in results) or any("error" in r for r in records) or len(records) != NODES:
            raise SystemExit(f"phase {phase} failed: {[r.get('error') for r in records]}\n{describe(results)}")
        self.runs[phase + "".join(f" {e}" for e in extra)] = {"wall_s": round(time.monotonic() - t0, 1)}
        return records

    def in_node(self, i: int | str, *argv) -> subprocess.Popen:
        node = self.node(i) if isinstance(i, int) else self.net.nodes[i]
        return subprocess.Popen([*self.net.enter(node), PY, str(WORKER), *map(str, argv)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)

    @staticmethod
    def result_of(proc: subprocess.Popen, timeout: float = 300) -> dict:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"plain reference failed ({proc.returncode}): {err.strip()[-1500:]}")
        return json.loads(out.strip().splitlines()[-1])

    def plain_streams(self, senders: list[int], receiver: int | str, nbytes: int, port: int = 7100) -> dict:
        """One TCP stream from each sender to ``receiver``, ``nbytes`` each, at once: seconds and bytes."""
        recv_node = self.node(receiver) if isinstance(receiver, int) else self.net.nodes[receiver]
        recv = self.in_node(receiver, "plain-recv", port, nbytes, len(senders))
        assert recv.stdout.readline().strip() == "ready"
        sends = [self.in_node(s, "plain-send", recv_node.addr, port, nbytes) for s in senders]
        for s in sends:
            s.communicate(timeout=300)
        return self.result_of(recv)

    def set_downlink(self, i: int, rate: str) -> None:
        """The switch port's egress towards node ``i`` (its downlink) at ``rate``."""
        assert self.net is not None
        self.net.set_downlink(self.node(i), rate)

    # -- the host's view of node disks -------------------------------------------------------
    def step(self, i: int, name: str) -> Path:
        return self.cluster.node_disk(i) / "bench" / name

    def wipe(self, i: int, name: str) -> None:
        shutil.rmtree(self.step(i, name), ignore_errors=True)

    def rank_file_bytes(self, i: int, name: str) -> int:
        return sum(p.stat().st_size for p in self.step(i, name).glob("rank_*.safetensors"))

    # -- figures --------------------------------------------------------------------------------
    def row(self, name: str, nbytes: int, seconds: float, *, limit: float, plain: dict | None = None,
            note: str = "", **extra) -> dict:
        """A measured transfer: its rate, as a fraction of ``limit`` (what the links allow, bytes/s)
        and of the plain copy's rate."""
        rate = nbytes / seconds
        r = {"row": name, "bytes": nbytes, "seconds": round(seconds, 3), "gbps": round(rate / 1e9, 4),
             "limit_gbps": round(limit / 1e9, 4), "x_limit": round(rate / limit, 3), "note": note, **extra}
        if plain is not None:
            prate = plain["bytes"] / plain["seconds"]
            r.update(plain_gbps=round(prate / 1e9, 4), plain_x_limit=round(prate / limit, 3),
                     x_plain=round(rate / prate, 3), plain=plain)
        self.rows.append(r)
        print(f"  {name}: {rate / 1e6:.1f} MB/s = {rate / limit:.2f}x its limit"
              + (f", {r['x_plain']:.2f}x plain ({prate / 1e6:.1f} MB/s)" if plain else ""), flush=True)
        return r

    # -- the phases ----------------------------------------------------------------------------
    def run(self) -> None:
        a, link = self.args, self.link
        third = a.size_bytes // NODES
        print("plain reference: one stream node0 -> node1", flush=True)
        one = self.plain_streams([0], 1, third)
        self.row("plain copy, one TCP stream (node0 -> node1)", one["bytes"], one["seconds"], limit=link,
                 note="the link reference")

        print("save + replication (replicas=2)", flush=True)
        recs = self.torchrun("save", "--replicas", 2, timeout=a.timeout)
        rep = [r["replication"] for r in recs]
        pulled = sum(r["bytes"] for r in rep)
        seconds = max(r["seconds"] for r in rep)
        # each node pulls both others' files over its own downlink: NODES links work at once
        self.row("replication (replicas=2, every node pulls 2 others' files)", pulled, seconds, limit=NODES * link,
                 plain=None, note=f"{NODES} downlinks at once; per node {pulled / NODES / seconds / 1e6:.1f} MB/s",
                 per_node=rep, save_seconds=[round(r["save_seconds"], 3) for r in recs])
        self.rows[-1]["x_plain"] = round(pulled / NODES / seconds / (one["bytes"] / one["seconds"]), 3)
        self.rows[-1]["plain_gbps"] = round(one["bytes"] / one["seconds"] / 1e9, 4)

        # node identities are "0", "1", "2" here (dcp_nvme.host.job.node_identity)
        if "restore" not in a.only:
            self.after_restores(link)
            return
        rep0, aside = self.step(0, "rep") / ".replicas" / "2", self.step(0, "aside-node2")
        # restore from one holder: node 2 wiped; node 0's replica of it moved aside
        self.wipe(2, "rep")
        rep0.rename(aside)
        print("restore from one holder (node 1)", flush=True)
        r1 = self.restore_row("restore of wiped node 2 from one holder (node 1)", link, one)
        aside.rename(rep0)

        print("plain reference: two streams node0, node1 -> node2", flush=True)
        two = self.plain_streams([0, 1], 2, third // 2)
        self.wipe(2, "rep")
        print("restore from two holders (symmetric links)", flush=True)
        self.restore_row("restore of wiped node 2 from two holders (nodes 0, 1)", link, two,
                         note="node 2's downlink caps it at 1x")
        fat = a.fat_factor * link
        self.set_downlink(2, f"{int(fat * 8)}bit")
        try:
            print(f"plain reference: two streams -> node2 at a {a.fat_factor}x downlink", flush=True)
            two_fat = self.plain_streams([0, 1], 2, third // 2)
            self.wipe(2, "rep")
            print("restore from two holders (fat downlink)", flush=True)
            self.restore_row(f"restore from two holders, node 2's downlink {a.fat_factor:g}x", 2 * link, two_fat,
                             note=f"limit: the two holders' uplinks (2x); {r1['x_limit']:.2f}x from one holder",
                             x_one_link=None)
            self.rows[-1]["x_one_link"] = round(self.rows[-1]["gbps"] * 1e9 / link, 3)
        finally:
            self.set_downlink(2, a.rate)
        self.after_restores(link)

    def after_restores(self, link: float) -> None:
        a, third = self.args, self.args.size_bytes // NODES
        if "drain" in a.only:
            self.drains(third, link)
        if "s3restore" in a.only:
            if "drain" not in a.only:
                raise SystemExit("--only s3restore needs drain (the mirror it restores from)")
            self.s3_restore(link)
        if "cap" in a.only:
            self.cap(link)

    def restore_row(self, name: str, limit: float, plain: dict, note: str = "", **extra) -> dict:
        recs = self.torchrun("restore", timeout=self.args.timeout)
        r2 = recs[2]
        assert all(r["equal"] for r in recs), recs
        print(f"  node 2's seconds in the exchange: {r2.get('profile')}; in the load: {r2.get('phases')}", flush=True)
        for r in recs:
            print(f"  rank {r['rank']}: {r['seconds']:.2f} s, steps began/ended {r.get('marks')}, load {r.get('phases')}",
                  flush=True)
        extra["per_rank"] = [{k: r.get(k) for k in ("rank", "seconds", "marks", "phases")} for r in recs]
        marks = r2.get("marks") or {}
        if "read_metadata" in marks and "prepare_local_plan" in marks:
            # DCP's own planning, between read_metadata and prepare_local_plan: the same with any
            # storage reader (a replacement node's own files come meanwhile)
            planning = marks["prepare_local_plan"][0] - marks["read_metadata"][1]
            note = "; ".join(filter(None, [note, f"DCP's planning {planning:.2f} s of it"]))
            extra.update(dcp_planning_seconds=round(planning, 3))
        fetch = (r2.get("profile") or {}).get("fetch")
        if fetch:  # the exchange alone (peers.exchange.move_ranges): the rest of the load reads the kept copy
            rate = r2["remote_bytes"] / fetch
            note = "; ".join(filter(None, [note, f"its exchange alone {fetch:.2f} s: {rate / limit:.2f}x limit, "
                                                 f"{rate * plain['seconds'] / plain['bytes']:.2f}x plain"]))
            extra.update(exchange_seconds=round(fetch, 3), exchange_x_limit=round(rate / limit, 3),
                         exchange_x_plain=round(rate * plain["seconds"] / plain["bytes"], 3))
        return self.row(name, r2["remote_bytes"], r2["seconds"], limit=limit, plain=plain, note=note,
                        sources=r2["sources"], profile=r2.get("profile"), phases=r2.get("phases"), **extra)

    def drains(self, third: int, link: float) -> None:
        a = self.args
        s3_node = self.srv.node.name
        print("plain reference: three streams -> the s3 node", flush=True)
        streams = self.plain_streams([0, 1, 2], s3_node, third)
        print("plain reference: a file written into each node's weed mount, at once", flush=True)
        writes = [self.in_node(i, "fuse-write", self.root / f"pfs{i}" / f"plain-{i}.bin", third) for i in range(NODES)]
        got = [self.result_of(p) for p in writes]
        fuse_plain = {"bytes": sum(g["bytes"] for g in got), "seconds": max(g["seconds"] for g in got)}
        print("plain reference: boto3 multipart uploads from every node, at once", flush=True)
        puts = [self.in_node(i, "s3-put", self.srv.node_endpoint_url, BUCKET, f"plain/put-{i}", third, 64 << 20,
                             MAX_TRANSFERS) for i in range(NODES)]
        got = [self.result_of(p) for p in puts]
        s3_plain = {"bytes": sum(g["bytes"] for g in got), "seconds": max(g["seconds"] for g in got)}

        print("drains to the weed mount and to S3", flush=True)
        env = {i: {"FUSE_ROOT": str(self.root / f"pfs{i}" / "mirror")} for i in range(NODES)}
        recs = self.torchrun("drain", "--tag", "plain", env_per_node=env, timeout=a.timeout)
        for kind, name, plain in (("fuse", "drain to a directory on the weed mount (FS node)", fuse_plain),
                                  ("s3", "drain to SeaweedFS S3", s3_plain)):
            nbytes = sum(r[kind]["bytes"] for r in recs)
            began = min(r[kind]["began"] for r in recs)
            ended = max(r[kind]["began"] + r[kind]["seconds"] for r in recs)
            self.row(name, nbytes, ended - began, limit=link, plain=plain,
                     note="3 nodes at once into the s3 node's one link",
                     per_node=[{k: round(v, 3) for k, v in r[kind].items()} for r in recs])
        self.plain_refs = {"three_streams_to_s3_node": streams, "fuse_write": fuse_plain, "s3_put": s3_plain}
        self.row("plain copy, three TCP streams into the s3 node", streams["bytes"], streams["seconds"], limit=link,
                 note="what the s3 node's link takes from three senders")

    def s3_restore(self, link: float) -> None:
        print("restore of node 2 from S3 (and boto3 ranged GETs of its file)", flush=True)
        before = None
        if self.args.mirror_before:  # the exchange's mirror reads as they were: a span at a time
            seq = self.torchrun("s3restore", "--tag", "plain", timeout=self.args.timeout,
                                env_per_node={i: {"MIRROR_SEQUENTIAL": "1"} for i in range(NODES)})
            assert all(r["equal"] for r in seq), seq
            before = seq[2]
        whole = None
        if self.args.whole_spans:  # each span from the mirror checked and kept whole, after its last byte
            kept = self.torchrun("s3restore", "--tag", "plain", timeout=self.args.timeout,
                                 env_per_node={i: {"MIRROR_WHOLE_SPANS": "1"} for i in range(NODES)})
            assert all(r["equal"] for r in kept), kept
            whole = kept[2]
        recs = self.torchrun("s3restore", "--tag", "plain", timeout=self.args.timeout)
        assert all(r["equal"] for r in recs), recs
        r2 = recs[2]
        rank_file = next(iter(self.srv.s3fs().glob(f"{BUCKET}/plain/rank_*2*.safetensors")), None)
        plain = None
        if rank_file:
            key = rank_file.split("/", 1)[1]
            plain = self.result_of(self.in_node(2, "s3-get", self.srv.node_endpoint_url, BUCKET, key, BLOCK,
                                                QUEUE_DEPTH))
        nbytes = r2["remote_bytes"] or r2["bytes_needed"]
        print(f"  node 2's seconds in the exchange: {r2.get('profile')}; in the load: {r2.get('phases')}", flush=True)
        for r in recs:
            print(f"  rank {r['rank']}: {r['seconds']:.2f} s, steps began/ended {r.get('marks')}, "
                  f"load {r.get('phases')}", flush=True)
        self.row("restore of node 2 from SeaweedFS S3 (mirror)", nbytes, r2["seconds"], limit=link, plain=plain,
                 note=f"plain: boto3 ranged GETs, {QUEUE_DEPTH} x {BLOCK >> 20} MiB in flight", sources=r2["sources"],
                 profile=r2.get("profile"), phases=r2.get("phases"),
                 per_rank=[{k: r.get(k) for k in ("rank", "seconds", "marks", "phases")} for r in recs])
        if whole is not None:
            self.row("the same, each span kept whole (the code before pieces of KEEP_PIECE)",
                     whole["remote_bytes"] or whole["bytes_needed"], whole["seconds"], limit=link, plain=plain,
                     note="the same launch of the bench, just before", profile=whole.get("profile"))
        if before is not None:
            self.row("the same, mirror spans read one at a time (the code before ranged mirror reads)",
                     before["remote_bytes"] or before["bytes_needed"], before["seconds"], limit=link, plain=plain,
                     note="the same launch of the bench, just before", profile=before.get("profile"))

    def cap(self, link: float) -> None:
        a = self.args
        cap = a.cap_fraction * link
        print(f"drain at a cap of {cap / 1e6:.1f} MB/s under all-reduces", flush=True)
        recs = self.torchrun("cap", "--tag", "solo", "--cap", cap, "--ar-bytes", a.ar_bytes, "--iters", a.ar_iters,
                             "--part-size", 8 << 20, timeout=a.timeout)
        d = recs[0]["drain"]
        alone = max(r["allreduce_alone"] for r in recs)
        shared = max(r["allreduce_with_drain"] for r in recs)
        after = d["after_rate"]
        r = self.row(f"drain to S3 capped at {a.cap_fraction:g}x link, while all-reduces run", d["overlap_bytes"],
                     d["overlap_seconds"], limit=cap,
                     note=(f"limit: the cap; after the all-reduces {after / cap:.2f}x the cap; all-reduces "
                           f"{shared / alone:.2f}x slower ({alone:.2f} -> {shared:.2f} s)") if after else
                     f"limit: the cap; all-reduces {shared / alone:.2f}x slower ({alone:.2f} -> {shared:.2f} s)",
                     drain=d)
        r.update(after_x_cap=round(after / cap, 3) if after else None, allreduce_alone_s=round(alone, 3),
                 allreduce_with_drain_s=round(shared, 3), allreduce_slowdown=round(shared / alone, 3),
                 allreduce_bytes=a.ar_bytes, allreduce_iters=a.ar_iters)
        print(f"  all-reduces: {alone:.2f} s alone, {shared:.2f} s beside the drain ({shared / alone:.2f}x)", flush=True)


def table(rows: list[dict]) -> str:
    out = ["| transfer | bytes | s | GB/s | limit GB/s | x limit | plain GB/s | x plain | note |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        plain = f"{r['plain_gbps']:.3f}" if "plain_gbps" in r else ""
        xp = f"{r['x_plain']:.2f}" if "x_plain" in r else ""
        out.append(f"| {r['row']} | {r['bytes'] / 1e6:.0f} MB | {r['seconds']:.2f} | {r['gbps']:.3f} | "
                   f"{r['limit_gbps']:.3f} | {r['x_limit']:.2f} | {plain} | {xp} | {r['note']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="every link's rate, tc spelling")
    parser.add_argument("--delay-ms", type=float, default=0.2, help="one-way delay between nodes (netem, if any)")
    parser.add_argument("--size", default="1GiB", help="the whole state; each of the 3 ranks saves a third")
    parser.add_argument("--mtu", type=int, default=1500,
                        help="every link's MTU (9000: jumbo frames, as cluster fabrics run; the rate counts headers)")
    parser.add_argument("--cols", type=int, default=1024,
                        help="columns of each matrix of the state (1: the flat tensors of earlier runs, for which "
                             "DCP's planning builds an index per element)")
    parser.add_argument("--fat-factor", type=float, default=3.0, help="node 2's downlink for the two-holder row")
    parser.add_argument("--cap-fraction", type=float, default=0.25,
                        help="the drain's cap, x the link rate (below what SeaweedFS takes here)")
    parser.add_argument("--only", default="restore,drain,s3restore,cap",
                        help="the rows after the link and replication ones (comma list)")
    parser.add_argument("--ar-bytes", default="32MiB", help="each all-reduce's tensor")
    parser.add_argument("--ar-iters", type=int, default=12)
    parser.add_argument("--mirror-before", action=argparse.BooleanOptionalAction, default=True,
                        help="also restore from S3 the way the exchange did before its ranged reads (a span at a time)")
    parser.add_argument("--whole-spans", action=argparse.BooleanOptionalAction, default=False,
                        help="also restore from S3 with each span kept whole (before pieces of mirror_reads.KEEP_PIECE)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--dir", default=None, help="where the nodes' disks and SeaweedFS go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="the JSON of every figure")
    args = parser.parse_args(argv)
    args.size_bytes = parse_size(args.size)
    args.ar_bytes = parse_size(args.ar_bytes)
    args.only = set(filter(None, args.only.split(",")))
    for why in (unshare_unavailable(), network_unavailable(), fuse_unavailable()):
        if why:
            print(f"cluster_bench: cannot run here: {why}", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    bench = Bench(args)
    try:
        bench.start()
        net = bench.net
        config = {"rate": args.rate, "rate_bytes_per_s": bench.link, "delay_ms": args.delay_ms,
                  "delay_shaped": net.delay_shaped, "shaping": net.shaping, "nodes": NODES, "ranks_per_node": 1,
                  "mtu": args.mtu, "size_bytes": args.size_bytes, "cols": args.cols, "fat_factor": args.fat_factor,
                  "cap_fraction": args.cap_fraction, "cpus": os.cpu_count()}
        print(f"link: {args.rate} ({bench.link / 1e6:.0f} MB/s) each way, MTU {args.mtu}, delay {args.delay_ms} ms "
              f"asked, {'shaped' if net.delay_shaped else 'NOT shaped'} ({net.shaping})", flush=True)
        bench.run()
    finally:
        bench.close()
        if not args.dir:
            shutil.rmtree(bench.root, ignore_errors=True)
    config["wall_s"] = round(time.monotonic() - t0, 1)
    print()
    print(f"link {args.rate}, delay {args.delay_ms} ms {'shaped' if config['delay_shaped'] else 'not shaped'}; "
          f"{NODES} nodes x 1 rank; state {args.size_bytes / 2**30:.2f} GiB; wall {config['wall_s']} s")
    print(table(bench.rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": config, "rows": bench.rows, "launches": bench.runs,
                       "plain_references": getattr(bench, "plain_refs", {})}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
