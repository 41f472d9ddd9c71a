"""Two tiers, measured: local NVMe commit + background drain vs. writing straight to S3.

Starts a moto S3 server on loopback (harness/dcp_nvme_harness/s3server.py; needs moto[server] and s3fs), saves a
synthetic state of --size bytes, and reports, per case, the time until training may continue,
the local-commit time and the drain time:

    nvme+drain->s3     NVMeWriter on --local, then drain() to s3://bench/...
    nvme+drain->dir    the same checkpoint drained to --mirror-dir (the parallel-FS stand-in)
    async+mirror->s3   dcp.async_save(NVMeWriter(local, mirror=s3 URL)): returns, commits, drains
    fsspec->s3         DCP's FsspecWriter writing straight to the same server (the alternative)

    python benchmarks/tiers_bench.py --size 128MiB --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from dcp_nvme import NVMeWriter
from dcp_nvme.config import parse_size
from dcp_nvme.tiers import Drainer, DrainOptions, drain, set_default_drainer


def make_state(nbytes: int, tensors: int = 8) -> dict:
    per = nbytes // 4 // tensors
    return {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="128MiB")
    parser.add_argument("--local", default=None, help="fast-tier directory (default: a temp dir)")
    parser.add_argument("--mirror-dir", default=None, help="second-tier directory (default: a temp dir)")
    parser.add_argument("--part-size", default="64MiB")
    parser.add_argument("--max-transfers", type=int, default=4)
    parser.add_argument("--verify", choices=("sent", "readback"), default="sent")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    from dcp_nvme_harness.s3server import S3Server

    size = parse_size(args.size)
    local_root = args.local or tempfile.mkdtemp(prefix="tiers-local-")
    mirror_root = args.mirror_dir or tempfile.mkdtemp(prefix="tiers-mirror-")
    options = DrainOptions(max_transfers=args.max_transfers, part_size=parse_size(args.part_size),
                           verify=args.verify)
    srv = S3Server(proxy=False)  # straight to moto: no fault proxy in the path
    srv.start()
    storage = srv.storage_options()
    srv.s3fs().mkdir("bench")
    sd = make_state(size)
    config = {"size_bytes": size, "tensors": len(sd), "local": local_root, "mirror_dir": mirror_root,
              "drain": {"max_transfers": options.max_transfers, "part_size": options.part_size,
                        "verify": options.verify},
              "s3": "moto " + srv.moto_url, "torch": torch.__version__, "cpus": os.cpu_count()}
    print(json.dumps(config, indent=1))
    results: dict[str, dict] = {}
    try:
        local = os.path.join(local_root, "step_1")
        commit_s, _ = timed(lambda: dcp.save(sd, storage_writer=NVMeWriter(local), no_dist=True))
        drain_s3_s, r = timed(lambda: drain(local, "s3://bench/nvme/step_1", storage_options=storage,
                                            options=options))
        results["nvme+drain->s3"] = {"blocking_s": commit_s, "local_commit_s": commit_s,
                                     "drain_s": drain_s3_s, "total_s": commit_s + drain_s3_s,
                                     "bytes_sent": r.bytes_sent}
        drain_dir_s, r = timed(lambda: drain(local, os.path.join(mirror_root, "step_1"), options=options))
        results["nvme+drain->dir"] = {"blocking_s": commit_s, "local_commit_s": commit_s,
                                      "drain_s": drain_dir_s, "total_s": commit_s + drain_dir_s,
                                      "bytes_sent": r.bytes_sent}

        drainer = Drainer(options)
        previous = set_default_drainer(drainer)
        try:
            local2 = os.path.join(local_root, "step_2")
            writer = NVMeWriter(local2, mirror="s3://bench/async/step_2", mirror_options=storage)
            started = time.perf_counter()
            future = dcp.async_save(sd, storage_writer=writer, no_dist=True)
            returned = time.perf_counter() - started
            (future.result() if hasattr(future, "result") else future.upload_completion.result())
            committed = time.perf_counter() - started
            writer.drain_future.result()
            drained = time.perf_counter() - started
        finally:
            set_default_drainer(previous)
            drainer.close()
        results["async+mirror->s3"] = {"blocking_s": returned, "local_commit_s": committed,
                                       "drain_s": drained - committed, "total_s": drained}

        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # checkpoint_id=None: with an id DCP re-inits the filesystem without these options
        fsspec_s, _ = timed(lambda: dcp.save(sd, storage_writer=FsspecWriter("s3://bench/fsspec/step_1",
                                                                             **storage), no_dist=True))
        results["fsspec->s3"] = {"blocking_s": fsspec_s, "local_commit_s": None, "drain_s": None,
                                 "total_s": fsspec_s}
    finally:
        srv.close()
        if not args.local:
            shutil.rmtree(local_root, ignore_errors=True)
        if not args.mirror_dir:
            shutil.rmtree(mirror_root, ignore_errors=True)
    print(f"{'case':<18} {'training waits':>14} {'local commit':>13} {'drain':>8} {'total':>8}  (s; MB/s of total)")
    for name, row in results.items():
        def f(v):
            return f"{v:8.2f}" if v is not None else "       -"
        print(f"{name:<18} {row['blocking_s']:14.2f} {f(row['local_commit_s']):>13} {f(row['drain_s'])} "
              f"{f(row['total_s'])}  {size / 1e6 / row['total_s']:7.1f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": config, "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
