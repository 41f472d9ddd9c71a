"""dcp-nvme bench and the layers: the node budget against the per-rank depth, block layer, drive."""

from __future__ import annotations

import pytest

from dcp_nvme import bench


@pytest.mark.slow
def test_bench_two_ranks_with_a_node_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tmp_path / "no-tune.json"))
    for name in ("QUEUE_DEPTH", "BLOCK_SIZE", "DIRECT_IO", "NODE_QUEUE_DEPTH"):
        monkeypatch.delenv(f"DCP_NVME_{name}", raising=False)
    options = bench.BenchOptions(size=4 << 20, ranks=2, directory=str(tmp_path / "disk"), quick=True,
                                 progress=False, queue_depth=3, block_size=256 << 10, node_queue_depth=4)
    doc = bench.run_bench(options)
    rows = {r["key"]: r for r in doc["rows"]}
    assert not rows["dcp_nvme.save"]["error"] and not rows["dcp_nvme.save.per_rank_depth"]["error"]
    # the node budget: 4 over 2 ranks = 2 each, recorded by each rank's writer
    assert [s["config"]["queue_depth"] for s in doc["dcp_nvme_stats"]["save"]] == [2, 2]
    assert all(1 <= s["io"]["max_inflight"] <= 2 for s in doc["dcp_nvme_stats"]["save"])
    replaced = rows["dcp_nvme.save.per_rank_depth"]
    assert replaced["extra"]["queue_depth"] == 3 and replaced["extra"]["total_depth"] == 6
    assert 1 <= replaced["extra"]["max_inflight"] <= 3 and replaced["gbps"] > 0
    staggered = rows["dcp_nvme.save.staggered"]  # the other write order, same run: ranks in turns at 4 each
    assert not staggered["error"] and staggered["extra"]["queue_depth"] == [4, 4]
    assert doc["ratios"]["staggered_vs_together"] == pytest.approx(
        staggered["gbps"] / rows["dcp_nvme.save"]["gbps"], abs=1e-3)
    assert "qd 2" in rows["device.write"]["note"]  # the device limit at the same total depth
    layers = doc["layers"]
    assert (layers["node_queue_depth"], layers["per_rank_depth"], layers["local_ranks"]) == (4, 2, 2)
    assert [r["rank"] for r in layers["save"]["ranks"]] == [0, 1]
    assert layers["save"]["straggler"]["slowest_over_median"] >= 1
    assert doc["ratios"]["save_vs_per_rank_depth"] == pytest.approx(
        rows["dcp_nvme.save"]["gbps"] / replaced["gbps"], abs=1e-3)
    assert [t["value"] is not None for t in layers["targets"]] == [True, True]
    report = bench.format_report(doc)
    assert "LAYERS" in report and "node_queue_depth 4 over 2 rank(s) = 2 per rank" in report
    assert "write order: together; staggered / together = " in report
    assert "save telemetry: node " in report and "slowest rank" in report
    if layers["block_layer"]["device"]:
        assert f"block layer: {layers['block_layer']['device']['name']}" in report
    print(report)
