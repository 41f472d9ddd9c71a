"""dcp-nvme tune and the layers: --ranks N measured together, block layer and drive health shown."""

from __future__ import annotations

import json
import os

import pytest

from dcp_nvme.cli import main
from dcp_nvme.config import TUNE_FILE_ENV, resolve_config
from dcp_nvme.host.job import effective_queue_depth
from dcp_nvme.tune.ranks import combine, node_grid, order_grid


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv(TUNE_FILE_ENV, str(tmp_path / "tune.json"))
    for name in ("QUEUE_DEPTH", "BLOCK_SIZE", "DIRECT_IO", "NODE_QUEUE_DEPTH"):
        monkeypatch.delenv(f"DCP_NVME_{name}", raising=False)


def test_node_grid_keeps_one_node_depth_per_rank_share():
    assert node_grid(4, [16, 2, 4, 6, 8]) == [(2, 1), (8, 2), (16, 4)]  # 2 and 4 both give 1 per rank
    assert node_grid(1, [3, 1]) == [(1, 1), (3, 3)]


def test_order_grid_adds_each_node_depth_staggered_when_ranks_share_a_node():
    assert order_grid(2, [4, 8]) == [("together", 4, 2), ("together", 8, 4), ("staggered", 4, 4), ("staggered", 8, 8)]
    assert order_grid(1, [4]) == [("together", 4, 4)]  # one process: nothing to take turns with


def test_combine_adds_bytes_and_takes_the_slowest_process():
    def probe(write, read, inflight):
        io = {"bytes": 10**9, "max_inflight": inflight, "latency_p50_ms": 1.0, "latency_p99_ms": write}
        return {"queue_depth": 2, "block_size": 1 << 20, "direct_io": True, "bytes": 10**9, "write_seconds": write,
                "read_seconds": read, "write_io": io, "read_io": io, "eviction": "x"}

    point = combine([probe(1.0, 0.5, 2), probe(2.0, 0.25, 1)], node_depth=4)
    assert (point["bytes"], point["write_seconds"], point["read_seconds"]) == (2 * 10**9, 2.0, 0.5)
    assert (point["write_gbps"], point["read_gbps"]) == (1.0, 4.0)
    assert point["write_io"]["max_inflight"] == 3 and point["write_io"]["latency_p99_ms"] == 2.0
    assert (point["ranks"], point["node_queue_depth"], point["queue_depth"]) == (2, 4, 2)


@pytest.mark.slow
def test_tune_two_ranks_stores_the_node_budget(tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    assert main(["tune", "--dir", str(disk), "--size", "4MiB", "--queue-depths", "2,4", "--block-sizes", "512KiB",
                 "--direct", "off", "--ranks", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["ranks"] == 2 and len(doc["points"]) == 4  # node depths 2 and 4, together and staggered
    assert [(p["node_write_order"], p["node_queue_depth"]) for p in doc["points"]] == [
        ("together", 2), ("together", 4), ("staggered", 2), ("staggered", 4)]
    for point in doc["points"]:
        share = 1 if point["node_write_order"] == "staggered" else 2  # in turns, each has all of it
        assert point["queue_depth"] == point["node_queue_depth"] // share
        assert len(point["per_rank"]) == 2 and point["bytes"] == 4 << 20
        for probe in point["per_rank"]:
            assert probe["bytes"] == 2 << 20 and 1 <= probe["write_io"]["max_inflight"] <= point["queue_depth"]
        assert point["write_seconds"] == max(p["write_seconds"] for p in point["per_rank"])
    best = doc["best"]
    assert best["node_queue_depth"] in (2, 4) and best["ranks"] == 2
    share = 1 if best["node_write_order"] == "staggered" else 2
    assert best["queue_depth"] == best["node_queue_depth"] // share
    assert f"best: node_queue_depth={best['node_queue_depth']} over 2 ranks ({best['node_write_order']})" in out
    config = resolve_config()
    assert (config.node_queue_depth, config.queue_depth, config.node_write_order) == (
        best["node_queue_depth"], best["queue_depth"], best["node_write_order"])
    assert effective_queue_depth(config, 2) == best["queue_depth"]  # what a rank of the node will keep
    assert "block layer:" in out and "drive health" in out
    assert "block_layer" in doc and "available" in doc["drive"]
    assert os.listdir(disk) == []


def test_tune_single_rank_reports_the_block_layer(tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    assert main(["tune", "--dir", str(disk), "--size", "1MiB", "--queue-depths", "2", "--block-sizes", "1MiB",
                 "--direct", "off", "--no-progress"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "tune.json").read_text())
    device = doc["block_layer"]["device"]
    if device is None:
        assert "not a local block device" in out
    else:
        assert f"block layer: {device['name']}" in out
        for disk_entry in device["disks"]:
            assert f"  {disk_entry['name']}: " in out
    for advice in doc["block_layer"]["advice"]:
        assert f"warning: {advice}" in out
    assert "node_queue_depth" not in doc["best"]
