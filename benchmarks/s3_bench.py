"""Our S3 path against the anchors, on one store: the drain and the restore vs. writing and reading
S3 straight from DCP.

Starts SeaweedFS on loopback (harness/dcp_nvme_harness/seaweed.py: ``weed server -s3`` on free
ports of 127.0.0.1), saves a state of --size bytes (float32 tensors) and runs, interleaved for
--rounds rounds, each row in a fresh process:

    drain       our drain of the committed local checkpoint (what NVMeWriter(mirror=...) runs
                after its commit): tiers.drain(local, s3://...), the drain's time
    fsspec_w    torch's FsspecWriter over s3fs: dcp.save straight to S3
    s3tc_w      AWS's s3torchconnector.dcp.S3StorageWriter (the CRT client)
    restore     our restore from the mirror: dcp.load through NVMeReader("s3://...")
    fsspec_r    torch's FsspecReader over s3fs
    s3tc_r      s3torchconnector.dcp.S3StorageReader

Each row reports GB/s (the state's bytes over the operation's wall time) and CPU seconds per GB
(the process's user+system over the operation: every thread, the client's construction
included, the imports not; ``import_cpu_s`` says those). Rows whose package is missing are
skipped, and said so.

    python benchmarks/s3_bench.py --size 512MiB --rounds 3 --json docs/results/s3_bench_512MiB.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

Python = Callable[[list[str], dict[str, str]], "subprocess.CompletedProcess[str]"]
"""Runs ``python ARGS`` in the environment given, its output captured as text."""


def fresh_python(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter (the benchmark's rows: each pays its imports apart from its figures)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)

ROWS = ("drain", "fsspec_w", "s3tc_w", "restore", "fsspec_r", "s3tc_r")
WRITES = {"restore": "drain", "fsspec_r": "fsspec_w", "s3tc_r": "s3tc_w"}
"""Each reader reads what its own writer wrote in the same round."""
TENSORS = 8


@contextlib.contextmanager
def bench_store(prefix: str) -> Iterator[tuple[dict[str, Any], dict[str, str], str]]:
    """SeaweedFS on loopback in a fresh work directory, with a bucket ``bench``: the storage
    options its rows take, the environment of the rows' processes, the work directory; the
    store closed and the directory removed after."""
    from dcp_nvme_harness.seaweed import SeaweedFS

    here = os.path.dirname(os.path.abspath(__file__))
    # no AWS_* (the rows take the store's options); bytecode written, so no row compiles its imports
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(here, ".."), env.get("PYTHONPATH", "")])
    work = tempfile.mkdtemp(prefix=prefix)
    store = SeaweedFS(os.path.join(work, "weed"))
    try:
        store.start()
        options = store.storage_options()
        options.pop("skip_instance_cache", None)
        store.s3fs().mkdir("bench")
        yield options, env, work
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _state(nbytes: int, zeros: bool = False) -> dict:
    import torch

    per = nbytes // 4 // TENSORS
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.zeros(per) if zeros else torch.randn(per, generator=g) for i in range(TENSORS)}


def _s3tc_fs(region: str, endpoint: str):
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem

    config = S3ClientConfig(force_path_style=True)  # a loopback endpoint has no bucket subdomains
    return S3FileSystem(region, s3_client=S3Client(region, endpoint=endpoint, s3client_config=config))


class _GcClock:
    """Python's collections during the operation, per generation, and their seconds."""

    def __init__(self) -> None:
        self.counts, self.seconds, self.began = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self.began
            self.counts[info["generation"]] += 1


def child(row: str, url: str, local: str, options: dict[str, Any], nbytes: int, transfers: int,
          part_size: int, perf: str | None = None) -> dict[str, Any]:
    """One row, in this (fresh) process: imports first, then the timed operation."""
    began = _cpu()
    import torch
    import torch.distributed.checkpoint as dcp

    region = options.get("client_kwargs", {}).get("region_name", "us-east-1")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", options["key"])  # the CRT client reads these
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", options["secret"])
    os.environ.setdefault("AWS_REGION", region)
    state = _state(nbytes, zeros=row in WRITES)
    if row in ("drain", "restore"):
        import botocore.session  # noqa: F401  (the library, as s3fs and s3torchconnector below)

        from dcp_nvme import NVMeReader
        from dcp_nvme.load import reader  # noqa: F401
        from dcp_nvme.tiers import DrainOptions, drain, drainer, s3_client  # noqa: F401
    elif row.startswith("fsspec"):
        import s3fs  # noqa: F401
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    else:
        import s3torchconnector.dcp as s3tc
    imported = _cpu() - began
    import gc

    profiler = None
    if perf:  # the operation alone, every thread: perf report -i FILE --no-children --sort dso,sym
        import signal

        profiler = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-p", str(os.getpid()), "-o", perf],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attached
    clock = _GcClock()
    gc.callbacks.append(clock)
    cpu, started = _cpu(), time.perf_counter()
    if row == "drain":
        drain(local, url, storage_options=options,
              options=DrainOptions(max_transfers=transfers, part_size=part_size, retries=0))
    elif row == "restore":
        dcp.load(state, storage_reader=NVMeReader(url, storage_options=options), no_dist=True)
    elif row == "fsspec_w":
        dcp.save(state, storage_writer=FsspecWriter(url, **options), no_dist=True)
    elif row == "fsspec_r":
        dcp.load(state, storage_reader=FsspecReader(url, **options), no_dist=True)
    elif row == "s3tc_w":
        writer = s3tc.S3StorageWriter(region, url)
        writer.fs = _s3tc_fs(region, options["endpoint_url"])
        dcp.save(state, storage_writer=writer, no_dist=True)
    elif row == "s3tc_r":
        reader = s3tc.S3StorageReader(region, url)
        reader.fs = _s3tc_fs(region, options["endpoint_url"])
        dcp.load(state, storage_reader=reader, no_dist=True)
    seconds, cpu = time.perf_counter() - started, _cpu() - cpu
    gc.callbacks.remove(clock)
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait()
    if row in WRITES:  # the bytes came back: the first values of the first tensor
        expect = _state(nbytes)["layer0.weight"][:4]
        assert torch.equal(state["layer0.weight"][:4], expect), f"{row}: read back other bytes"
    return {"row": row, "seconds": seconds, "cpu_s": cpu, "import_cpu_s": imported,
            "s3fs_imported": "s3fs" in sys.modules, "gc_collections": clock.counts, "gc_seconds": clock.seconds,
            "gc_objects": len(gc.get_objects())}


def _machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def main(argv: list[str] | None = None, python: Python = fresh_python) -> dict[str, Any]:
    """Run the benchmark; the report (also written to --json). ``python`` runs each row's process
    (the tests fork them from a process that imported torch: the figures exclude imports anyway)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    parser.add_argument("--max-transfers", type=int, default=8, help="our drain's parts in flight")
    parser.add_argument("--part-size", default="16MiB", help="our drain's part size")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--perf", default=None, help="perf record each row's operation to PREFIX.<row>.perf")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--args", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.args)
        record = child(args.child, **spec)
        print(json.dumps(record))
        return record

    from dcp_nvme.config import parse_size

    nbytes = parse_size(args.size)
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown row(s) {sorted(unknown)}")
    rows = [r for r in rows if _available(r)]
    from dcp_nvme_harness.seaweed import seaweed_unavailable

    why = seaweed_unavailable()
    if why:
        raise SystemExit(f"s3_bench: SeaweedFS is not available ({why})")
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
    with bench_store("s3-bench-") as (options, env, work):
        for round_ in range(args.rounds):
            local = os.path.join(work, f"local_{round_}")
            _save_local(local, nbytes, env, python)
            for row in rows:
                writer = WRITES.get(row, row)
                url = f"s3://bench/r{round_}/{writer}"
                spec = {"url": url, "local": local, "options": options, "nbytes": nbytes,
                        "transfers": args.max_transfers, "part_size": parse_size(args.part_size),
                        "perf": f"{os.path.abspath(args.perf)}.{row}.perf" if args.perf else None}
                out = python([os.path.abspath(__file__), "--child", row, "--args", json.dumps(spec)], env)
                if out.returncode != 0:
                    raise SystemExit(f"s3_bench: {row} failed:\n{out.stderr[-4000:]}")
                record = json.loads(out.stdout.strip().splitlines()[-1])
                record["gbps"] = nbytes / 1e9 / record["seconds"]
                record["cpu_s_per_gb"] = record["cpu_s"] / (nbytes / 1e9)
                results[row].append(record)
                print(f"round {round_} {row:9s} {record['gbps']:.3f} GB/s {record['cpu_s_per_gb']:.2f} CPU s/GB",
                      flush=True)
            shutil.rmtree(local, ignore_errors=True)
    summary = {row: {"gbps": statistics.median(r["gbps"] for r in runs),
                     "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in runs),
                     "import_cpu_s": statistics.median(r["import_cpu_s"] for r in runs)}
               for row, runs in results.items()}
    ratios = _ratios(summary)
    report = {"config": {"size": nbytes, "rounds": args.rounds, "max_transfers": args.max_transfers,
                         "part_size": parse_size(args.part_size), "store": "SeaweedFS on 127.0.0.1",
                         "machine": _machine()},
              "summary": summary, "ratios": ratios, "runs": results}
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return report


def _ratios(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """The goals: our drain vs. the faster direct writer (rate) and the leanest (CPU per GB);
    our restore vs. s3torchconnector's reader."""
    out: dict[str, float] = {}
    writers = [summary[r] for r in ("fsspec_w", "s3tc_w") if r in summary]
    if "drain" in summary and writers:
        out["drain_rate_vs_fastest_writer"] = summary["drain"]["gbps"] / max(w["gbps"] for w in writers)
        out["drain_cpu_vs_leanest_writer"] = summary["drain"]["cpu_s_per_gb"] / min(w["cpu_s_per_gb"] for w in writers)
    if "restore" in summary and "s3tc_r" in summary:
        out["restore_rate_vs_s3tc"] = summary["restore"]["gbps"] / summary["s3tc_r"]["gbps"]
        out["restore_cpu_vs_s3tc"] = summary["restore"]["cpu_s_per_gb"] / summary["s3tc_r"]["cpu_s_per_gb"]
    if "restore" in summary and "fsspec_r" in summary:
        out["restore_rate_vs_fsspec"] = summary["restore"]["gbps"] / summary["fsspec_r"]["gbps"]
    return out


def _available(row: str) -> bool:
    import importlib.util

    need = {"fsspec_w": "s3fs", "fsspec_r": "s3fs", "s3tc_w": "s3torchconnector", "s3tc_r": "s3torchconnector",
            "drain": "botocore", "restore": "botocore"}[row]
    if importlib.util.find_spec(need) is None:
        print(f"s3_bench: row {row} skipped: {need} is not installed", file=sys.stderr)
        return False
    return True


_SAVE = """
import importlib.util, sys
import torch.distributed.checkpoint as dcp
from dcp_nvme import NVMeWriter
spec = importlib.util.spec_from_file_location("s3_bench", sys.argv[3])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
dcp.save(bench._state(int(sys.argv[2])), storage_writer=NVMeWriter(sys.argv[1]), no_dist=True)
"""


def _save_local(local: str, nbytes: int, env: dict[str, str], python: Python) -> None:
    """The committed local checkpoint the drain row mirrors (saved by a process of its own)."""
    out = python(["-c", _SAVE, local, str(nbytes), os.path.abspath(__file__)], env)
    if out.returncode != 0:
        raise SystemExit(f"s3_bench: the local save failed:\n{out.stderr[-4000:]}")


if __name__ == "__main__":
    main()
