"""benchmarks/cluster_bench.py at a tiny size: it builds its network, nodes and SeaweedFS, and
writes a JSON whose figures are all measured (> 0). The full run is in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
from dcp_nvme_harness.multinode import unshare_unavailable  # noqa: E402
from dcp_nvme_harness.netns import network_unavailable  # noqa: E402
from dcp_nvme_harness.seaweed import fuse_unavailable  # noqa: E402


def _unavailable() -> str | None:
    return unshare_unavailable() or network_unavailable() or fuse_unavailable()


@pytest.mark.skipif(bool(_unavailable()), reason=str(_unavailable()))
def test_cluster_bench_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "cluster_bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cluster_bench.py"), "--size", "24MiB",
                           "--rate", "2gbit", "--only", "", "--dir", str(tmp_path / "run"), "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["config"]["rate"] == "2gbit" and doc["config"]["shaping"], doc["config"]
    rows = {r["row"]: r for r in doc["rows"]}
    assert any(name.startswith("plain copy, one TCP stream") for name in rows), rows
    assert any(name.startswith("replication") for name in rows), rows
    for name, row in rows.items():
        assert row["bytes"] > 0 and row["seconds"] > 0 and row["gbps"] > 0, (name, row)
    assert "| transfer |" in proc.stdout and "delay" in proc.stdout
