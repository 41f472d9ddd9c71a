"""The device limit as fio measures it: sequential O_DIRECT write then read of new files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from typing import Any

from dcp_nvme.config import IOConfig
from dcp_nvme.errors import BenchError
from dcp_nvme.observe.machine import evict_from_page_cache, files_under


def fio_version() -> str | None:
    if not shutil.which("fio"):
        return None
    try:
        return subprocess.run(["fio", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def fio_sequential(directory: str, nbytes_per_job: int, jobs: int, config: IOConfig) -> dict[str, Any]:
    """fio sequential write then read of ``jobs`` new files, libaio at the engine's depth and size."""
    block = config.block_size
    per_job = max(block, -(-nbytes_per_job // block) * block)
    name = f"fio-{uuid.uuid4().hex[:8]}"
    base = ["fio", f"--name={name}", f"--directory={directory}", f"--bs={block}",
            f"--iodepth={config.queue_depth}", "--ioengine=libaio", f"--direct={int(config.direct_io)}",
            f"--size={per_job}", f"--numjobs={jobs}", "--group_reporting", "--output-format=json"]
    results: dict[str, Any] = {}
    try:
        for op, extra in (("write", ["--rw=write", "--end_fsync=1"]), ("read", ["--rw=read"])):
            if op == "read":
                evict_from_page_cache(files_under(directory))
            command = base + extra
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise BenchError(f"fio failed ({done.returncode}): {done.stderr.strip()[-300:]}")
            doc = json.loads(done.stdout[done.stdout.index("{"):])
            stats = doc["jobs"][0][op]
            if not stats["bw_bytes"]:
                raise BenchError(f"fio reported no {op} bandwidth")
            results[op] = {"bytes": stats["io_bytes"], "seconds": stats["io_bytes"] / stats["bw_bytes"],
                           "command": " ".join(command), "version": doc.get("fio version"),
                           "cpu_seconds_per_gb": _fio_cpu_per_gb(doc["jobs"][0], stats["io_bytes"]),
                           "lat_p50_ms": _fio_percentile(stats, "50.000000"),
                           "lat_p99_ms": _fio_percentile(stats, "99.000000")}
    finally:
        for path in files_under(directory):
            if os.path.basename(path).startswith(name):
                os.unlink(path)
    return results


def _fio_cpu_per_gb(job: dict[str, Any], nbytes: int) -> float | None:
    """fio's user+sys CPU over the job's run time, per GB moved: the kernel's own cost of the
    I/O, the floor any engine of ours pays too (fio reports CPU as a percentage of run time)."""
    try:
        seconds = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * float(job["job_runtime"]) / 1000
    except (KeyError, TypeError, ValueError):
        return None
    return round(seconds / (nbytes / 1e9), 4) if nbytes > 0 and seconds >= 0 else None


def _fio_percentile(stats: dict[str, Any], key: str) -> float | None:
    value = stats.get("clat_ns", {}).get("percentile", {}).get(key)
    return round(value / 1e6, 3) if value else None
