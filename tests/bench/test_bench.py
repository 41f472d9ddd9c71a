"""dcp-nvme bench: the synthetic state, page-cache eviction, ratios, and a real tiny run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from dcp_nvme import bench
from dcp_nvme.bench.synthetic import build_state, llama_spec, shard_rows
from dcp_nvme.config import IOConfig
from dcp_nvme.observe.machine import cached_fraction, evict_from_page_cache

SINGLE_RANK_ROWS = {
    "memory.copy", "device.write", "device.read", "dcp_nvme.save", "dcp_nvme.async.blocking",
    "dcp_nvme.async.total", "fs.save.t1", "fs.save.t2", "fs.save.t4", "fs.save.t8", "fs.save.best",
    "torch.save", "safetensors.save", "dcp_nvme.load", "fs.load", "torch.load", "safetensors.load",
    "reshard.dcp_nvme", "reshard.dcp_nvme.noverify", "reshard.fs",
    "dcp_nvme.load.direct", "dcp_nvme.load.buffered",
    "dcp_nvme.async.half.blocking", "dcp_nvme.async.half.total",
    "engine.threads.save", "engine.threads.load", "engine.uring.save", "engine.uring.load",
}


# --------------------------------------------------------------------------- synthetic state


@pytest.mark.parametrize("size", [1 << 20, 8 << 20, 96 << 20, 2 << 30])
@pytest.mark.parametrize("optim", [False, True])
def test_llama_spec_hits_the_requested_size(size, optim):
    spec = llama_spec(size, optim)
    assert abs(spec.nbytes - size) / size < 0.08
    names = {t.fqn for t in spec.tensors}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= names
    weights = [t for t in spec.tensors if not t.fqn.startswith("optim.")]
    assert all(t.dtype == torch.bfloat16 for t in weights)
    moments = [t for t in spec.tensors if t.fqn.startswith("optim.")]
    if optim:
        assert len(moments) == 3 * len(weights) and all(t.dtype == torch.float32 for t in moments)
        assert f"optim.exp_avg_sq.{weights[0].fqn}" in names
    else:
        assert not moments
    gate = next(t for t in spec.tensors if t.fqn == "model.layers.0.mlp.gate_proj.weight")
    assert gate.shape == (spec.intermediate, spec.hidden) and spec.intermediate >= 8 * spec.hidden // 3


def test_llama_spec_rejects_tiny_sizes():
    with pytest.raises(ValueError, match="at least 1 MiB"):
        llama_spec(1000)


def test_build_state_row_shards_tile_each_tensor():
    spec = llama_spec(2 << 20, optim=True)
    whole = build_state(spec)
    shards = [build_state(spec, rank, 3) for rank in range(3)]
    for tensor in spec.tensors:
        assert whole[tensor.fqn].shape == tensor.shape and whole[tensor.fqn].dtype == tensor.dtype
        rows = [s[tensor.fqn].shape[0] for s in shards]
        assert sum(rows) == tensor.shape[0]
        assert [shard_rows(tensor.shape[0], r, 3)[1] for r in range(3)] == rows
        assert all(s[tensor.fqn].shape[1:] == tensor.shape[1:] for s in shards)
    assert (whole["optim.exp_avg_sq.lm_head.weight"] >= 0).all()
    # reproducible, and no two tensors alike
    again = build_state(spec)
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    first, second = whole["model.layers.0.self_attn.q_proj.weight"], whole["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(first, second)


# --------------------------------------------------------------------------- page cache


def test_eviction_empties_the_page_cache_for_the_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(4 << 20))
    path.read_bytes()  # buffered read: the pages are now cached
    before = cached_fraction([str(path)])
    if before is None:
        pytest.skip("this platform cannot tell page-cache residency (mincore)")
    assert before > 0.9
    method = evict_from_page_cache([str(path)])
    assert "posix_fadvise" in method
    assert cached_fraction([str(path)]) < 0.1


# --------------------------------------------------------------------------- ratios and report


def _row(key, op, role, gbps, **extra):
    row = bench.Row(key, key, op, role, bytes=int(gbps * 1e9), seconds=[1.0], extra=extra)
    return row.to_dict()


def test_ratios_and_targets():
    rows = [
        _row("device.write", "write", "limit", 2.0), _row("dcp_nvme.save", "write", "ours", 1.8),
        _row("fs.save.t1", "write", "peer", 0.5), _row("fs.save.best", "write", "peer", 1.5),
        _row("device.read", "read", "limit", 1.5), _row("dcp_nvme.load", "read", "ours", 1.2),
        _row("fs.load", "read", "peer", 0.6),
        _row("reshard.dcp_nvme", "reshard", "ours", 0.1, bytes_read=260, bytes_needed=250),
    ]
    ratios = bench.compute_ratios(rows)
    assert ratios["save_vs_device"] == 0.9 and ratios["save_vs_fs_t1"] == 3.6
    assert ratios["save_vs_fs_best"] == 1.2 and ratios["load_vs_fs"] == 2.0
    assert ratios["reshard_read_amplification"] == 1.04 and ratios["save_vs_torch_save"] is None
    met = {t["ratio"]: t["met"] for t in bench.check_targets(ratios)}
    assert met == {"save_vs_device": True, "save_vs_fs_t1": True, "save_vs_fs_best": False,
                   "load_vs_device": False, "load_vs_fs": True, "reshard_read_amplification": True}


def test_reshard_rows_is_a_quarter_of_each_saved_chunk():
    assert bench.reshard_rows(4096, 1) == 1024
    assert bench.reshard_rows(4096, 2) == 512
    assert bench.reshard_rows(10, 1) == 3  # torch.chunk rounding, as DTensor Shard(0)


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_sequential_parses_write_and_read(tmp_path):
    measured = bench.fio_sequential(str(tmp_path), 4 << 20, 1, IOConfig(queue_depth=2, block_size=1 << 20))
    for op in ("write", "read"):
        assert measured[op]["bytes"] == 4 << 20 and measured[op]["seconds"] > 0
        assert f"--rw={op}" in measured[op]["command"] and "--iodepth=2" in measured[op]["command"]
        cpu = measured[op]["cpu_seconds_per_gb"]
        assert cpu is None or cpu >= 0  # fio's own CPU per GB: the floor beside our engines' rows
    assert not os.listdir(tmp_path)  # fio's files are removed


def test_fio_cpu_per_gb_is_its_cpu_share_of_the_run_time():
    from dcp_nvme.bench.device import _fio_cpu_per_gb

    job = {"usr_cpu": 5.0, "sys_cpu": 15.0, "job_runtime": 1000}  # 20 % of 1 s = 0.2 CPU s
    assert _fio_cpu_per_gb(job, 2 * 10**9) == 0.1
    assert _fio_cpu_per_gb({"usr_cpu": "x"}, 10**9) is None and _fio_cpu_per_gb(job, 0) is None


# --------------------------------------------------------------------------- a real run


def _check_rows(doc, expected):
    rows = {r["key"]: r for r in doc["rows"]}
    assert set(rows) == expected, [r.get("error") for r in doc["rows"]]
    for row in rows.values():
        assert not row["error"], row
        if row["skipped"]:
            assert isinstance(row["skipped"], str) and row["skipped"].strip()
            continue
        assert row["seconds"] and all(s > 0 for s in row["seconds"]), row
        assert row["bytes"] > 0 and row["gbps"] > 0, row
        if "identical" in row["extra"]:
            assert row["extra"]["identical"] is True, row
    return rows


@pytest.mark.slow  # ~30 s on 2 busy cores: a dozen saves and loads, each a real DCP call
def test_bench_cli_smoke(tmp_path):
    """The README's job at a tiny size: every row ran or says why not; the JSON is complete."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    work = tmp_path / "disk"
    command = [sys.executable, "-m", "dcp_nvme.cli", "bench", "--size", "8MiB", "--quick", "--dir", str(work),
               "--json", str(out), "--no-progress"]
    plotting = _has("matplotlib")
    if plotting:
        command += ["--plot", str(png)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SAVE" in done.stdout and "dcp_nvme save (sync) [ours]" in done.stdout and "RATIOS" in done.stdout
    assert not re.search(r"\bMISSED\b|\bmet\b|TARGETS|issue \d", done.stdout)  # figures, no verdicts
    doc = json.loads(out.read_text())
    assert doc["format"] == "dcp_nvme.bench" and doc["format_version"] == 1
    config = doc["config"]
    for key in ("size_requested", "state_bytes", "ranks", "optim", "model", "io", "directory", "fio", "eviction",
                "repeat", "quick"):
        assert key in config, key
    assert config["ranks"] == 1 and config["size_requested"] == 8 << 20
    assert {"queue_depth", "block_size", "direct_io", "checksum_block", "source"} <= set(config["io"])
    assert {"torch", "cpu_count", "directory", "platform"} <= set(doc["machine"])
    rows = _check_rows(doc, SINGLE_RANK_ROWS)
    assert rows["fs.save.t2"]["skipped"] == "--quick runs thread_count=1 only"
    for key in ("dcp_nvme.save", "fs.save.t1", "torch.save", "safetensors.save", "dcp_nvme.load", "fs.load"):
        assert not rows[key]["skipped"], key
    assert rows["dcp_nvme.save"]["extra"]["max_inflight"] >= 1
    assert "latency_p99_ms" in rows["dcp_nvme.load"]["extra"]
    assert 0 <= rows["dcp_nvme.save"]["extra"]["bounce_share"] <= 1
    assert 0 <= rows["dcp_nvme.load"]["extra"]["bounce_share"] <= 1
    if not rows["dcp_nvme.load.direct"]["skipped"]:  # what the O_DIRECT load copied out of bounce buffers
        assert 0 <= rows["dcp_nvme.load.direct"]["extra"]["bounce_share"] <= 1
    half = rows["dcp_nvme.async.half.blocking"]["extra"]
    assert half["arena_bytes_max"] <= half["max_bytes_per_rank"] and half["live_bytes_rank0"] > 0
    for key in ("engine.threads.save", "engine.threads.load", "engine.uring.save", "engine.uring.load",
                "dcp_nvme.load.direct", "dcp_nvme.load.buffered"):
        if not rows[key]["skipped"]:
            assert rows[key]["extra"]["cpu_seconds_per_gb"] > 0, key
    assert doc["dcp_nvme_stats"]["save"][0]["bytes"] >= config["state_bytes"]
    # the resharded load: DCP's FileSystemReader reads whole chunks, dcp_nvme only what is needed
    # (plus whole checksum blocks when verifying)
    total = config["state_bytes"]
    needed = rows["reshard.dcp_nvme"]["extra"]["bytes_needed"]
    assert abs(needed - total / 4) < total * 0.05
    if rows["reshard.fs"]["extra"]["bytes_read"] is not None:
        assert rows["reshard.fs"]["extra"]["bytes_read"] >= 0.95 * total
        assert rows["reshard.dcp_nvme.noverify"]["extra"]["bytes_read"] < 0.5 * total
    assert [t["ratio"] for t in doc["targets"]] == [t[1] for t in bench.TARGETS]
    assert not [p for p in work.iterdir() if p.name.startswith("dcp-nvme-bench-")]  # cleaned up
    if plotting:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_two_ranks(tmp_path):
    """Two processes over gloo share the directory; every row runs and reports the aggregate."""
    options = bench.BenchOptions(size=4 << 20, ranks=2, directory=str(tmp_path), quick=True, progress=False)
    doc = bench.run_bench(options)
    assert doc["config"]["ranks"] == 2 and len(doc["config"]["bytes_per_rank"]) == 2
    rows = _check_rows(doc, SINGLE_RANK_ROWS)
    assert rows["dcp_nvme.save"]["bytes"] == doc["config"]["state_bytes"]
    assert len(doc["dcp_nvme_stats"]["save"]) == 2
    assert "8-way row split" in rows["reshard.dcp_nvme"]["note"]
    print(bench.format_report(doc))


def test_bench_reports_bad_options(tmp_path, capsys):
    from dcp_nvme.cli import main

    assert main(["bench", "--size", "10", "--dir", str(tmp_path)]) == 1
    assert "at least 1 MiB" in capsys.readouterr().err
    assert main(["bench", "--size", "8MiB", "--ranks", "0", "--dir", str(tmp_path)]) == 1
    assert "--ranks must be at least 1" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_device_limit_without_fio_uses_the_plugins_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # a machine without fio
    assert bench.fio_version() is None
    options = bench.BenchOptions(size=2 << 20, directory=str(tmp_path), progress=False,
                                 queue_depth=2, block_size=1 << 20, direct_io=True)
    root = tmp_path / "root"
    root.mkdir()
    run = bench.Bench(options, bench.Group(0, 1), str(root))
    run.device_limit()
    write, read = run.rows
    assert (write.key, read.key) == ("device.write", "device.read")
    for row in (write, read):
        assert "PosixEngine" in row.note and "fio is not installed" in row.note
        assert run.total_bytes - 4096 < row.bytes <= run.total_bytes and row.seconds[0] > 0
        assert row.extra["io"]["max_inflight"] <= 2
    assert not os.listdir(root)  # the probe's directory is gone
    # not the device's limit: no ratio is taken to it, in the ratios or in the report's column
    assert "not the device limit" in write.label and write.extra["device_limit"] is False
    rows = [write.to_dict(), read.to_dict(), _row("dcp_nvme.save", "write", "ours", 1.0),
            _row("dcp_nvme.load", "read", "ours", 1.0)]
    ratios = bench.compute_ratios(rows)
    assert ratios["save_vs_device"] is None and ratios["load_vs_device"] is None
    from dcp_nvme.bench.report import _row_line

    line = _row_line(rows[2], rows[2], rows[0])
    assert line.split()[-2:] == ["-", "-"], line
