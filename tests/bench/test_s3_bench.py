"""benchmarks/s3_bench.py at a tiny size against its own SeaweedFS on loopback: every row runs,
reads back the bytes its writer wrote, and the report carries each row's rate, CPU per GB and
the ratios the goals of docs/benchmarks.md are judged by."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "s3_bench.py"
    spec = importlib.util.spec_from_file_location("s3_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_s3_bench_reports_every_row_with_rate_and_cpu(tmp_path):
    from dcp_nvme_harness.seaweed import seaweed_unavailable
    from dcp_nvme_harness.warm import warm_python

    why = seaweed_unavailable()
    if why:
        pytest.skip(why)
    pytest.importorskip("s3fs")
    bench = _bench()
    rows = [r for r in bench.ROWS if bench._available(r)]
    assert {"drain", "restore", "fsspec_w", "fsspec_r"} <= set(rows)
    out = tmp_path / "s3.json"
    warm = warm_python()  # each row's process forked from one that imported torch: no import paid per row
    report = bench.main(["--size", "24MiB", "--rounds", "1", "--part-size", "8MiB", "--json", str(out)],
                        python=lambda args, env: warm.run(args, env=env, timeout=300))
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["summary"]) == set(rows)
    for row in rows:
        (run,) = report["runs"][row]
        assert run["seconds"] > 0 and run["cpu_s"] > 0 and run["gbps"] > 0 and run["cpu_s_per_gb"] > 0
    # our rows never load s3fs: the S3 path is botocore itself
    assert not report["runs"]["drain"][0]["s3fs_imported"] and not report["runs"]["restore"][0]["s3fs_imported"]
    assert "restore_rate_vs_fsspec" in report["ratios"] and "drain_rate_vs_fastest_writer" in report["ratios"]
    if "s3tc_r" in rows:
        assert report["ratios"]["restore_cpu_vs_s3tc"] > 0
