"""Worker of benchmarks/cluster_bench.py: one phase on simulated nodes over shaped links.

    torchrun ... cluster_bench_worker.py PHASE RUN_DIR [options]   (one rank per node)
    python cluster_bench_worker.py plain-recv|plain-send|s3-put|s3-get ...   (inside one node)

Torchrun phases (every rank prints one ``RESULT {json}`` line, with one os.write):

  save     two node-local saves of a state of --size bytes (each rank a Shard(0) DTensor slice of
           --tensors float32 matrices of --cols columns): ``rep`` with ``replicas=--replicas``
           (the replication is waited for; its ReplicationResult reported) and ``plain`` without
           replicas (for the drains)
  restore  ``dcp.load`` of ``rep`` with ``NVMeReader(path, peers=True)`` on every rank; the host
           wiped the restoring node's copy before: its rank reports seconds, remote bytes, sources
  drain    each node drains its files of ``plain`` to $FUSE_ROOT/<tag> (a directory on a weed
           mount, a network file system) and then to $S3_ROOT/<tag> (SeaweedFS S3), all nodes at
           once; per rank the drain's bytes and the seconds until its last piece arrived
  s3restore  the last node's rank removes its own copy of ``plain``, then every rank loads it with
           ``NVMeReader(path, mirror=$S3_ROOT/<tag>)`` (peers on, as with a mirror by default): that node's bytes all from S3 (no node holds them)
  cap      rank 0 drains a one-process checkpoint (saved in ``save``) to $S3_ROOT at --cap bytes/s
           while every rank runs --iters all-reduces of --ar-bytes; before, the same loop alone

Plain-copy helpers (no torch), the "same bytes over the same link" references:

  plain-recv PORT N [SENDERS]  listen on PORT, take N bytes from each of SENDERS connections,
                               print {"seconds", "bytes"} from the first accept to the last byte
  plain-send ADDR PORT N       send N bytes over one TCP stream
  s3-put ENDPOINT BUCKET KEY N PART INFLIGHT   boto3 multipart upload of N bytes, INFLIGHT parts at once
  s3-get ENDPOINT BUCKET KEY BLOCK INFLIGHT    boto3 ranged GETs of the object, INFLIGHT in flight
  fuse-write PATH N                            N bytes written to PATH (on a weed mount), fsync'd
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def report(record: dict) -> None:
    os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())


# --------------------------------------------------------------------------- plain references


def plain_recv(port: int, nbytes: int, senders: int = 1) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(senders)
    print("ready", flush=True)
    conns, began = [], None
    for _ in range(senders):
        conn, _ = listener.accept()
        began = began or time.perf_counter()
        conns.append(conn)

    def take(conn: socket.socket) -> int:
        buf, got = bytearray(4 << 20), 0
        view = memoryview(buf)
        while got < nbytes:
            n = conn.recv_into(view, min(len(buf), nbytes - got))
            if not n:
                break
            got += n
        conn.close()
        return got

    with ThreadPoolExecutor(senders) as pool:
        got = sum(pool.map(take, conns))
    seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "bytes": got}), flush=True)


def plain_send(addr: str, port: int, nbytes: int) -> None:
    data = memoryview(os.urandom(4 << 20))
    deadline = time.monotonic() + 20
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sent = 0
    while sent < nbytes:
        chunk = data[: min(len(data), nbytes - sent)]
        s.sendall(chunk)
        sent += len(chunk)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    s.close()


def _s3(endpoint: str, pool: int):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="eu-west-1", config=Config(max_pool_connections=pool + 2))


def s3_put(endpoint: str, bucket: str, key: str, nbytes: int, part: int, inflight: int) -> None:
    client = _s3(endpoint, inflight)
    data = os.urandom(part)
    parts = [(i + 1, min(part, nbytes - off)) for i, off in enumerate(range(0, nbytes, part))]
    began = time.perf_counter()
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def put(p: tuple[int, int]) -> dict:
        number, length = p
        got = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                 Body=data[:length])
        return {"PartNumber": number, "ETag": got["ETag"]}

    with ThreadPoolExecutor(inflight) as pool:
        done = list(pool.map(put, parts))
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    print(json.dumps({"seconds": time.perf_counter() - began, "bytes": nbytes}), flush=True)


def s3_get(endpoint: str, bucket: str, key: str, block: int, inflight: int) -> None:
    client = _s3(endpoint, inflight)
    size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    ranges = [(o, min(size, o + block) - 1) for o in range(0, size, block)]
    began = time.perf_counter()

    def get(r: tuple[int, int]) -> int:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={r[0]}-{r[1]}")["Body"]
        return len(body.read())

    with ThreadPoolExecutor(inflight) as pool:
        got = sum(pool.map(get, ranges))
    print(json.dumps({"seconds": time.perf_counter() - began, "bytes": got}), flush=True)


def fuse_write(path: str, nbytes: int, block: int = 8 << 20) -> None:
    """N bytes written to a file on a weed mount in ``block`` writes, then fsync'd."""
    data = memoryview(os.urandom(block))
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, data[: min(block, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    print(json.dumps({"seconds": time.perf_counter() - began, "bytes": nbytes}), flush=True)


PLAIN = {"plain-recv": plain_recv, "plain-send": plain_send, "s3-put": s3_put, "s3-get": s3_get,
         "fuse-write": fuse_write}


def _plain_main() -> None:
    fn = PLAIN[sys.argv[1]]
    args = [int(a) if a.isdigit() else a for a in sys.argv[2:]]
    fn(*args)


# --------------------------------------------------------------------------- torchrun phases


def _phases() -> None:  # noqa: C901  one phase per launch, each short
    import argparse
    import shutil
    import threading
    import traceback

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dcp_nvme import NVMeReader, NVMeWriter
    from dcp_nvme.tiers import DrainOptions, drain

    parser = argparse.ArgumentParser()
    parser.add_argument("phase")
    parser.add_argument("run_dir")
    parser.add_argument("--size", type=int, default=1 << 30)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tag", default="x")
    parser.add_argument("--cap", type=float, default=0)
    parser.add_argument("--ar-bytes", type=int, default=32 << 20)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--part-size", type=int, default=64 << 20)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    # weight matrices of --cols columns, rows sharded: for a 1-D tensor DCP's planning builds an
    # int64 index per element of each local shard (torch 2.13), which a model's large weights,
    # matrices, do not pay
    rows = max(world, args.size // 4 // args.tensors // args.cols // world * world)
    shard = rows // world
    record: dict = {"rank": rank, "host": os.uname().nodename, "phase": args.phase}
    s3_options = json.loads(os.environ["S3_OPTIONS"]) if os.environ.get("S3_OPTIONS") else None

    def state(fill: bool) -> dict:
        out = {}
        for i in range(args.tensors):
            local = (torch.arange(shard * args.cols, dtype=torch.float32).view(shard, args.cols)
                     + (1000.0 * i + 1e7 * rank)) if fill else torch.full((shard, args.cols), -1.0)
            out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)])
        return out

    def check(loaded: dict) -> bool:
        want = state(True)
        return all(torch.equal(loaded[k].to_local(), want[k].to_local()) for k in want)

    def profiled() -> dict:
        """Cumulative seconds of the exchange's steps on this rank (where a restore's time goes)."""
        import dcp_nvme.peers.exchange as ex
        import dcp_nvme.peers.streams as st

        spent: dict = {}

        def wrap(owner, name: str, label: str) -> None:
            fn = getattr(owner, name)

            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

            setattr(owner, name, timed)

        for name, label in (("agree_metadata", "agree_metadata"), ("move_ranges", "fetch"),
                            ("_nowhere", "from_mirror"), ("_keep_record", "keep_record"),
                            ("verify_piece", "verify (read or received)")):
            wrap(ex, name, label)
        for name, label in (("run_wave", "waves"), ("read_checked", "holder_read_verify"),
                            ("verify_piece", "verify (read or received)")):
            wrap(st, name, label)
        wrap(ex.Arrivals, "keep", "keep (pwrite)")
        wrap(ex.Arrivals, "adopt", "adopt (fsync, rename)")
        wrap(ex.dist, "batch_isend_irecv", "post p2p")
        return spent

    def timed_load(path: str, **reader_kw) -> None:
        spent = profiled()
        out = state(False)
        reader = NVMeReader(path, **reader_kw)
        marks: dict = {}

        def marked(name: str) -> None:  # when each of the reader's steps began and ended, from the load's start
            fn = getattr(reader, name)

            def timed(*a, **k):
                marks[name] = [round(time.perf_counter() - began, 3)]
                try:
                    return fn(*a, **k)
                finally:
                    marks[name].append(round(time.perf_counter() - began, 3))

            setattr(reader, name, timed)

        for name in ("read_metadata", "prepare_local_plan", "prepare_global_plan", "read_data"):
            marked(name)
        dist.barrier()
        began = time.perf_counter()
        dcp.load(out, storage_reader=reader)
        record["marks"] = marks
        record["seconds"] = time.perf_counter() - began
        stats = reader.last_stats or {}
        record["remote_bytes"] = int(stats.get("remote_bytes", 0))
        record["bytes_needed"] = int(stats.get("bytes_needed", 0))
        record["sources"] = stats.get("sources")
        record["phases"] = stats.get("phases")
        record["equal"] = check(out)
        record["profile"] = {k: round(v, 3) for k, v in spent.items()}

    def drain_timed(local: str, target: str, options: DrainOptions, storage_options=None, live=None) -> dict:
        marks: list[tuple[float, int]] = []
        began = time.perf_counter()
        if live is not None:
            live["marks_live"] = marks

        def progress(_name, piece) -> None:
            marks.append((time.perf_counter(), piece.length))

        result = drain(local, target, storage_options=storage_options, options=options, progress=progress)
        last = marks[-1][0] if marks else time.perf_counter()
        return {"bytes": result.bytes_sent, "seconds": last - began, "began": began,
                "total_seconds": result.seconds, "marks": [(round(t - began, 4), n) for t, n in marks]}

    try:
        rep, plain = os.path.join(args.run_dir, "rep"), os.path.join(args.run_dir, "plain")
        if args.phase == "save":
            writer = NVMeWriter(rep, replicas=args.replicas)
            dist.barrier()
            began = time.perf_counter()
            dcp.save(state(True), storage_writer=writer)
            record["save_seconds"] = time.perf_counter() - began
            result = writer.replication_future.result(timeout=600)
            record["replication"] = {"bytes": result.bytes, "seconds": result.seconds, "pulled": result.pulled,
                                     "replicated_on": result.replicated_on, "failed": result.failed}
            dist.barrier()
            dcp.save(state(True), storage_writer=NVMeWriter(plain))
            if rank == 0:  # the cap phase's one-process checkpoint: this rank's share of the state
                solo = {k: v.to_local().clone() for k, v in state(True).items()}
                dcp.save(solo, storage_writer=NVMeWriter(os.path.join(args.run_dir, "solo")), no_dist=True)
            dist.barrier()
        elif args.phase == "restore":
            timed_load(rep, peers=True)
        elif args.phase == "drain":
            options = DrainOptions(retries=1, backoff=0.2, node_wait=300, part_size=args.part_size)
            for kind, root, so in (("fuse", os.environ["FUSE_ROOT"], None),
                                   ("s3", os.environ["S3_ROOT"], s3_options)):
                dist.barrier()
                record[kind] = drain_timed(plain, f"{root}/{args.tag}", options, so)
                record[kind].pop("marks")
            dist.barrier()
        elif args.phase == "s3restore":
            if rank == world - 1:
                shutil.rmtree(plain)
            dist.barrier()
            if os.environ.get("MIRROR_SEQUENTIAL") == "1":  # as before ranged mirror reads: a span at a time, one read each
                import dcp_nvme.peers.mirror_reads as ex

                ex.MIRROR_IN_FLIGHT, ex.MIRROR_RANGE = 1, 1 << 40
            if os.environ.get("MIRROR_WHOLE_SPANS") == "1":  # as before pieces: a span checked and kept whole
                import dcp_nvme.peers.mirror_reads as ex

                ex.KEEP_PIECE = 1 << 62
            timed_load(plain, mirror=f"{os.environ['S3_ROOT']}/{args.tag}", mirror_options=s3_options, peers=True)
        elif args.phase == "cap":
            tensor = torch.ones(args.ar_bytes // 4)

            def loop() -> float:
                dist.barrier()
                began = time.perf_counter()
                for _ in range(args.iters):
                    dist.all_reduce(tensor)
                return time.perf_counter() - began

            loop()  # warm-up: the ring's connections
            record["allreduce_alone"] = loop()
            drained: dict = {}
            if rank == 0:
                options = DrainOptions(bandwidth=args.cap, part_size=args.part_size, retries=1, backoff=0.2)

                def run() -> None:
                    try:
                        drained.update(drain_timed(os.path.join(args.run_dir, "solo"),
                                                   f"{os.environ['S3_ROOT']}/{args.tag}", options, s3_options,
                                                   drained))
                    except BaseException as exc:  # noqa: BLE001
                        drained["error"] = f"{type(exc).__name__}: {exc}"

                thread = threading.Thread(target=run)
                thread.start()
                while not drained.get("marks_live") and thread.is_alive():  # until its first piece arrived
                    time.sleep(0.01)
            ar_began = time.perf_counter()
            record["allreduce_with_drain"] = loop()
            ar_ended = time.perf_counter()
            if rank == 0:
                thread.join()
                if "error" in drained:
                    raise RuntimeError(drained["error"])
                # the drain's rate while the all-reduces ran: pieces that arrived in that window
                marks = [(drained["began"] + t, n) for t, n in drained["marks"]]
                def rate(pieces: list) -> tuple[int, float]:
                    """Bytes after the first piece, and seconds from the first to the last."""
                    if len(pieces) < 2:
                        return 0, 0.0
                    return sum(n for _, n in pieces[1:]), pieces[-1][0] - pieces[0][0]

                inside = [(t, n) for t, n in marks if ar_began <= t <= ar_ended]
                after = [(t, n) for t, n in marks if t > ar_ended]
                (window_bytes, window), (after_bytes, after_s) = rate(inside), rate(after)
                record["drain"] = {"bytes": drained["bytes"], "seconds": drained["seconds"],
                                   "cap": args.cap, "overlap_bytes": window_bytes, "overlap_seconds": window,
                                   "overlap_rate": window_bytes / window if window else None,
                                   "after_rate": after_bytes / after_s if after_s else None,
                                   "pieces": len(marks), "pieces_during_allreduce": len(inside),
                                   "pieces_after": len(after)}
        else:
            raise SystemExit(f"unknown phase {args.phase}")
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exc()
        record["error"] = f"{type(exc).__name__}: {str(exc).strip()[-800:]}"
    report(record)
    dist.destroy_process_group()
    sys.exit(1 if "error" in record else 0)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in PLAIN:
        _plain_main()
    else:
        _phases()
