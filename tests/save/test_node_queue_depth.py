"""The node budget (node_queue_depth) and the per-save layer telemetry, over real gloo ranks."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import signal
import statistics

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.config import IOConfig, resolve_config
from dcp_nvme.host.job import effective_queue_depth, node_turn, ranks_per_host, turn_file
from dcp_nvme.save.results import format_summary, layer_summary


@pytest.fixture(autouse=True)
def no_env(monkeypatch, tmp_path):
    for name in ("LOCAL_WORLD_SIZE", "DCP_NVME_NODE_QUEUE_DEPTH", "DCP_NVME_QUEUE_DEPTH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tmp_path / "no-tune.json"))


def test_share_of_the_node_budget():
    assert effective_queue_depth(IOConfig(queue_depth=8), 8) == 8  # no budget: per-rank depth
    assert effective_queue_depth(IOConfig(node_queue_depth=32), 8) == 4
    assert effective_queue_depth(IOConfig(node_queue_depth=6), 4) == 1
    assert effective_queue_depth(IOConfig(node_queue_depth=3), 8) == 1  # never below one
    assert effective_queue_depth(IOConfig(node_queue_depth=4096), 1) == 256  # the engine's ceiling
    assert ranks_per_host(["a", "b", "a", None]) == [2, 1, 2, 1]


def test_node_queue_depth_is_validated_from_every_source(monkeypatch, tmp_path, caplog):
    for bad in (0, -3, 65537, "lots", True, 2.5):
        with pytest.raises(ValueError, match=r"node_queue_depth=.* is not valid: .*1 to 65536"):
            IOConfig(node_queue_depth=bad)
    assert IOConfig(node_queue_depth="12").node_queue_depth == 12  # canonical form, as other options
    monkeypatch.setenv("DCP_NVME_NODE_QUEUE_DEPTH", "lots")
    with pytest.raises(ValueError, match="from environment variable DCP_NVME_NODE_QUEUE_DEPTH"):
        resolve_config()
    monkeypatch.setenv("DCP_NVME_NODE_QUEUE_DEPTH", "48")
    with pytest.raises(ValueError, match="node_queue_depth=0 from the argument"):
        resolve_config(node_queue_depth=0)
    assert resolve_config().node_queue_depth == 48
    assert resolve_config(node_queue_depth=16).node_queue_depth == 16  # an argument wins
    monkeypatch.delenv("DCP_NVME_NODE_QUEUE_DEPTH")
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"best": {"queue_depth": 4, "block_size": 1 << 20, "direct_io": True,
                                         "node_queue_depth": 24}}))
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune))
    assert resolve_config().node_queue_depth == 24
    tune.write_text(json.dumps({"best": {"node_queue_depth": 0, "queue_depth": 4}}))
    with caplog.at_level("WARNING", logger="dcp_nvme.config"):
        config = resolve_config()  # an out-of-range tuned value is skipped, the file's others apply
    assert config.node_queue_depth != 0 and config.queue_depth == 4
    assert "ignoring node_queue_depth of tune file" in caplog.text and "from 1 to 65536" in caplog.text


def _state(world: int):
    generator = torch.Generator().manual_seed(5)
    full = {"w": torch.randn(256, 1024, generator=generator), "b": torch.randn(512, 256, generator=generator)}
    mesh = init_device_mesh("cpu", (world,))
    return full, {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}


def _budgeted_save(rank, world, path, local_world_size, node_depth):
    if local_world_size:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    full, state = _state(world)
    writer = NVMeWriter(path, queue_depth=16, block_size=16384, node_queue_depth=node_depth, direct_io=False)
    dcp.save(state, storage_writer=writer)
    stats = writer.last_stats
    expected = node_depth // (local_world_size or world)
    assert stats["config"]["queue_depth"] == expected, stats["config"]
    assert stats["local_ranks"] == (local_world_size or world)
    assert 1 <= stats["io"]["max_inflight"] <= expected  # the engine never had more in flight
    assert stats["io"]["requests"] >= 32
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=NVMeReader(path))
    for key, tensor in full.items():
        assert torch.equal(dest[key].full_tensor(), tensor), key


@pytest.mark.slow
@pytest.mark.parametrize("local_world_size,node_depth", [(None, 8), (1, 6)])
def test_two_ranks_share_the_node_budget(tmp_path, local_world_size, node_depth):
    """Host names agreed through the plan: both ranks on this host keep 8 // 2 = 4 each;
    LOCAL_WORLD_SIZE=1 says otherwise and each keeps the whole 6."""
    path = str(tmp_path / "ckpt")
    run_ranks(2, _budgeted_save, path, local_world_size, node_depth)
    doc = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert [r["config"]["queue_depth"] for r in doc["ranks"]] == [node_depth // (local_world_size or 2)] * 2
    assert doc["config"]["node_queue_depth"] == node_depth


def _plain_save(rank, world, path):
    _, state = _state(world)
    writer = NVMeWriter(path, queue_depth=3, block_size=16384, direct_io=False)
    dcp.save(state, storage_writer=writer)
    if rank == 0:
        assert writer.last_manifest["layers"]["straggler"] is not None


@pytest.mark.slow
def test_save_telemetry_shows_ranks_nodes_and_the_straggler(tmp_path):
    run_ranks(2, _plain_save, str(tmp_path / "ckpt"))
    doc = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    layers = doc["layers"]
    by_rank = {r["rank"]: r for r in doc["ranks"]}
    assert [r["rank"] for r in layers["ranks"]] == [0, 1]
    for entry in layers["ranks"]:
        stats = by_rank[entry["rank"]]
        assert entry["bytes"] == stats["bytes"] == os.path.getsize(tmp_path / "ckpt" / stats["file"])
        assert entry["max_inflight"] == stats["io"]["max_inflight"] and 1 <= entry["max_inflight"] <= 3
        assert entry["seconds"] == stats["phases"]["write"] > 0
        assert entry["gbps"] == pytest.approx(entry["bytes"] / entry["seconds"] / 1e9, abs=1e-3)
        assert entry["queue_depth"] == 3 and entry["local_ranks"] == 2
        assert "drive" not in stats and "block_layer" not in stats  # diagnostics run only when asked
    [(host, node)] = layers["nodes"].items()
    assert host == by_rank[0]["host"] == by_rank[1]["host"]
    assert node["ranks"] == [0, 1]
    assert node["bytes"] == sum(r["bytes"] for r in layers["ranks"])
    assert node["max_inflight_sum"] == sum(r["max_inflight"] for r in layers["ranks"])
    assert node["queue_depth_sum"] == 6
    straggler = layers["straggler"]
    slowest = max(layers["ranks"], key=lambda r: r["seconds"])
    assert straggler["rank"] == slowest["rank"] and straggler["seconds"] == slowest["seconds"]
    median = statistics.median(r["seconds"] for r in layers["ranks"])
    assert straggler["slowest_over_median"] == pytest.approx(slowest["seconds"] / median, abs=1e-3)
    assert straggler["slowest_over_median"] >= 1


def test_layer_summary_on_a_known_node_of_four():
    def rank(r, host, seconds, inflight, throttled=False):
        return {"rank": r, "host": host, "bytes": 10**9, "phases": {"write": seconds}, "config": {"queue_depth": 4},
                "io": {"max_inflight": inflight}, "local_ranks": 2, "drive": {"throttled": throttled}}

    summary = layer_summary([rank(3, "b", 4.0, 4, True), rank(0, "a", 1.0, 4), rank(1, "a", 2.0, 3),
                             rank(2, "b", 1.0, 2)])
    assert [r["rank"] for r in summary["ranks"]] == [0, 1, 2, 3]
    assert summary["nodes"]["a"] == {"ranks": [0, 1], "bytes": 2 * 10**9, "seconds": 2.0, "max_inflight_sum": 7,
                                     "queue_depth_sum": 8, "gbps": 1.0}
    assert summary["straggler"] == {"rank": 3, "host": "b", "seconds": 4.0, "median_seconds": 1.5,
                                    "slowest_over_median": 2.667}
    assert summary["throttled_ranks"] == [3]
    assert "slowest rank 3 4.000 s = 2.67 x median" in format_summary(summary)


# --------------------------------------------------------------------------- staggered writes


def test_staggered_ranks_each_take_the_whole_budget(monkeypatch, tmp_path, caplog):
    staggered = IOConfig(node_queue_depth=8, node_write_order="staggered")
    assert effective_queue_depth(staggered, 4) == 8  # one rank at a time: all of it
    assert effective_queue_depth(IOConfig(node_queue_depth=8), 4) == 2  # together: a share
    with pytest.raises(ValueError, match="node_write_order='sideways' from the argument is not valid"):
        IOConfig(node_write_order="sideways")
    with pytest.raises(ValueError, match="node_write_order='alone' from the argument is not valid"):
        NVMeWriter(tmp_path / "c", node_write_order="alone")
    assert NVMeWriter(tmp_path / "c", node_write_order="staggered").config.node_write_order == "staggered"
    tune = tmp_path / "tune.json"  # the other source: what `dcp-nvme tune --ranks N` measured faster
    tune.write_text(json.dumps({"best": {"node_write_order": "staggered"}}))
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune))
    assert resolve_config().node_write_order == "staggered"
    assert resolve_config(node_write_order="together").node_write_order == "together"  # an argument wins
    tune.write_text(json.dumps({"best": {"node_write_order": "alone"}}))
    with caplog.at_level("WARNING", logger="dcp_nvme.config"):
        assert resolve_config().node_write_order == "together"
    assert f"ignoring node_write_order of tune file {tune}" in caplog.text


def _turn_is_free(directory: str) -> bool:
    fd = os.open(turn_file(directory), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops a lock this probe may have taken
    return True


def _hold_turn(directory: str, holding, release) -> None:
    with node_turn(directory):
        holding.set()
        release.wait(60)


@pytest.mark.parametrize("ending", ["release", "kill"])
def test_a_turn_is_exclusive_on_the_node_and_dies_with_its_holder(tmp_path, ending):
    """Another process holds the turn: nobody else gets it until it releases, or is killed."""
    ctx = multiprocessing.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_turn, args=(str(tmp_path), holding, release))
    holder.start()
    try:
        assert holding.wait(60)
        assert not _turn_is_free(str(tmp_path))
        if ending == "kill":
            os.kill(holder.pid, signal.SIGKILL)  # the kernel drops a dead holder's flock
        else:
            release.set()
        holder.join(60)
        assert _turn_is_free(str(tmp_path))
    finally:
        if holder.is_alive():  # never set() after a kill: the dead waiter leaves the Event's lock held
            release.set()
            holder.join(5)
        if holder.is_alive():
            holder.kill()


def test_a_planted_link_at_the_turn_file_is_refused(tmp_path):
    path = turn_file(str(tmp_path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(tmp_path / "victim", path)
    try:
        with pytest.raises(OSError, match="write-turn file .*node_write_order=staggered"):
            with node_turn(str(tmp_path)):
                pass
        assert not (tmp_path / "victim").exists()
    finally:
        os.unlink(path)


def _staggered_save(rank, world, path):
    full, state = _state(world)
    writer = NVMeWriter(path, queue_depth=2, block_size=16384, node_queue_depth=4,
                        node_write_order="staggered", direct_io=False)
    dcp.save(state, storage_writer=writer)
    stats = writer.last_stats
    assert stats["config"]["queue_depth"] == 4 and stats["write_order"] == "staggered"
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=NVMeReader(path))
    for key, tensor in full.items():
        assert torch.equal(dest[key].full_tensor(), tensor), key


@pytest.mark.slow
def test_staggered_ranks_write_one_after_the_other(tmp_path):
    """Two ranks on this host, node_write_order=staggered: each writes with the whole budget,
    and their write intervals (wall clock, from the manifest) do not overlap."""
    path = str(tmp_path / "ckpt")
    run_ranks(2, _staggered_save, path)
    doc = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    first, second = sorted(tuple(r["write_unix"]) for r in doc["ranks"])
    assert first[0] <= first[1] <= second[0] <= second[1], (first, second)
    assert all(r["write_order"] == "staggered" for r in doc["ranks"])
