"""NVMeStager through dcp.async_save: round trips, zero-copy writes, safety, failures, memory."""

from __future__ import annotations

import errno
import json
import os
import pickle
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_nvme import NVMeReader, NVMeStager, NVMeWriter
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.save.stager import StagingBusyError, TensorSpec, plan_arena

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BLOCK = 1 << 20


def make_state(seed: int = 0, scale: int = 1) -> dict:
    """Float tensors of odd sizes with non-tensor leaves between them (as users write them)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "step": 7 + seed,
        "model": {
            "embed": torch.randn(301 * scale, 257, generator=g),
            "note": {"text": "hello", "values": [1, 2, 3]},
            "w1": torch.randn(1023, 65 * scale, generator=g),
            "b1": torch.randn(1001, generator=g),
        },
        "optim": {"state": {"0": {"exp_avg": torch.randn(777 * scale, 33, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
    }


def all_dtypes_state() -> dict:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 48, generator=g)
    return {
        "f32": torch.randn(17, 5, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "mask": torch.rand(9, generator=g) > 0.5,  # 9 bytes: the next tensor needs padding
        "i64": torch.arange(11, dtype=torch.int64),
        "c64": torch.randn(7, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "strided": base[:, 5:9],  # non-contiguous view of a larger storage
        "fp8": torch.randn(12, generator=g).to(torch.float8_e4m3fn),
        "obj": {"nested": [1, "two", 3.0]},
    }


def zeros_like_state(state):
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return None


def snapshot(state):
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def assert_same(loaded, expected, path="") -> None:
    if isinstance(expected, dict):
        assert set(loaded) == set(expected), path
        for k in expected:
            assert_same(loaded[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, torch.Tensor):
        assert loaded.dtype == expected.dtype and loaded.shape == expected.shape, path
        a, b = loaded.contiguous().reshape(-1), expected.contiguous().reshape(-1)
        assert a.view(torch.uint8).equal(b.view(torch.uint8)) if a.numel() else True, path
    else:
        assert loaded == expected, path


def load(path: str, template: dict) -> dict:
    out = zeros_like_state(template)
    out = _fill_objects(out, template)
    dcp.load(out, storage_reader=NVMeReader(path), no_dist=True)
    return out


def _fill_objects(out, template):
    """DCP loads non-tensor leaves by key: the target needs the key present (any value)."""
    if isinstance(template, dict):
        return {k: _fill_objects(out[k], v) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill_objects(o, v) for o, v in zip(out, template)] if out is not None else None
    return out


def async_save(state, path, stager, **kw):
    writer = NVMeWriter(path, block_size=BLOCK, queue_depth=4)
    resp = dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True, **kw)
    return writer, resp


def data_bytes(state) -> int:
    if isinstance(state, dict):
        return sum(data_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


# --------------------------------------------------------------------------- pure layout


def test_plan_arena_packs_back_to_back_and_pads_only_for_dtype_alignment():
    specs = [TensorSpec(torch.float32, (3,), "cpu"), TensorSpec(torch.bool, (5,), "cpu"),
             TensorSpec(torch.float64, (2,), "cpu"), TensorSpec(torch.uint8, (0,), "cpu")]
    offsets, total = plan_arena(specs)
    assert offsets == [0, 12, 24, 40]  # 17 rounded up to 24 for the float64
    assert total == 40


def test_the_arena_is_laid_out_as_the_writer_lays_out_its_container(tmp_path):
    """Zero-copy rests on one layout function: every staged tensor sits at the same offset from
    the first in the arena as in the container's data region, and the writer copies nothing but
    the window that holds the pickled leaf. Fails if the stager's or the writer's layout drifts."""
    g = torch.Generator().manual_seed(5)
    state = {
        "step": 3,  # a non-tensor leaf: the stager puts it after the tensors
        "model": {"w": torch.randn(300, 257, generator=g), "h": torch.randn(128, generator=g).bfloat16(),
                  "mask": torch.rand(64, generator=g) > 0.5, "ids": torch.arange(77)},
        "opt": {"m": torch.randn(5000, dtype=torch.float64, generator=g)},
    }
    stager = NVMeStager()
    staged = stager.stage(state).result()
    window = 64 << 10
    writer = NVMeWriter(tmp_path / "c", block_size=window, queue_depth=2, engine="posix")
    dcp.save(staged, storage_writer=writer, no_dist=True)
    tensors = {f"{top}.{k}": v for top in ("model", "opt") for k, v in staged[top].items()}
    manifest = NVMeReader(tmp_path / "c").manifest()
    placed = {c.fqn: c.byte_offset for c in manifest.chunks if c.kind == "tensor"}
    first = min(placed.values())
    base = min(t.data_ptr() for t in tensors.values())
    assert {fqn: t.data_ptr() - base for fqn, t in tensors.items()} == {
        fqn: offset - first for fqn, offset in placed.items()}
    assert 0 < writer.last_stats["io"]["copied_bytes"] <= window  # only the tail window
    stager.close()


# --------------------------------------------------------------------------- THREAD mode


def test_thread_round_trip_streams_the_arena_without_copies(tmp_path):
    state = make_state(scale=4)
    stager = NVMeStager()
    plain = NVMeWriter(tmp_path / "plain", block_size=BLOCK, queue_depth=4)
    dcp.save(state, storage_writer=plain, no_dist=True)
    for i in range(2):  # the 2nd save reuses the arena
        writer, resp = async_save(state, str(tmp_path / f"s{i}"), stager)
        resp.upload_completion.result()
        assert_same(load(str(tmp_path / f"s{i}"), state), snapshot(state))
    total = data_bytes(state)
    # every window but the unaligned tail (which also holds the pickled leaves) is written
    # straight from the arena; an unstaged save writes its tensors from their own memory too,
    # bouncing only their unaligned edges, pads and the pickled leaves
    assert writer.last_stats["io"]["copied_bytes"] < BLOCK
    assert plain.last_stats["io"]["copied_bytes"] < total // 20
    stats = stager.stats()
    assert stats["arena_bytes"] == total and stats["rebuilds"] == 0 and stats["saves"] == 2
    assert stats["pinned_bytes"] == (total if torch.cuda.is_available() else 0)


def test_every_dtype_and_strided_views_round_trip(tmp_path):
    state = all_dtypes_state()
    expected = snapshot(state)
    _, resp = async_save(state, str(tmp_path / "c"), NVMeStager())
    resp.upload_completion.result()
    assert_same(load(str(tmp_path / "c"), state), expected)


def test_mutating_after_async_save_returns_does_not_change_the_checkpoint(tmp_path):
    state = make_state(scale=4)  # more than BLOCK: the engine writes it (engines.small writes one request)
    expected = snapshot(state)
    gate = threading.Event()
    original = PosixEngine.write_file

    def slow_write(self, *args, **kwargs):
        gate.wait(10)  # the write starts only after the caller has mutated everything
        return original(self, *args, **kwargs)

    stager = NVMeStager()
    try:
        PosixEngine.write_file = slow_write
        _, resp = async_save(state, str(tmp_path / "c"), stager)
        resp.staging_completion.result()
        for tensor in (state["model"]["embed"], state["model"]["b1"],
                       state["optim"]["state"]["0"]["exp_avg"]):
            tensor.mul_(-3).add_(1)
        state["model"]["note"]["values"].append(99)
        state["optim"]["param_groups"][0]["lr"] = 5.0
        gate.set()
        resp.upload_completion.result()
    finally:
        PosixEngine.write_file = original
    assert_same(load(str(tmp_path / "c"), expected), expected)


def test_structure_change_rebuilds_the_arena(tmp_path):
    stager = NVMeStager()
    first = make_state(seed=1)
    _, resp = async_save(first, str(tmp_path / "a"), stager)
    resp.upload_completion.result()
    size_a = stager.arena_bytes
    second = make_state(seed=2, scale=3)  # same keys, bigger shapes
    second["model"]["extra"] = torch.arange(100, dtype=torch.int32)
    _, resp = async_save(second, str(tmp_path / "b"), stager)
    resp.upload_completion.result()
    assert stager.stats()["rebuilds"] == 1 and stager.arena_bytes == data_bytes(second) > size_a
    third = make_state(seed=3)  # back to the first structure: rebuilt again, still correct
    _, resp = async_save(third, str(tmp_path / "c"), stager)
    resp.upload_completion.result()
    assert stager.stats()["rebuilds"] == 2
    assert_same(load(str(tmp_path / "a"), first), snapshot(first))
    assert_same(load(str(tmp_path / "b"), second), snapshot(second))
    assert_same(load(str(tmp_path / "c"), third), snapshot(third))


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_repeated_saves_keep_memory_flat(tmp_path):
    g = torch.Generator().manual_seed(5)
    state = {f"layer{i}": torch.randn(1024, 1024 + i, generator=g) for i in range(6)}  # ~24 MiB
    size = data_bytes(state)
    stager = NVMeStager()
    rss = []
    for i in range(6):
        _, resp = async_save(state, str(tmp_path / f"c{i}"), stager)
        resp.upload_completion.result()
        for tensor in state.values():
            tensor.add_(1)
        rss.append(_rss())
    assert abs(rss[5] - rss[1]) < 0.10 * size, [r // 2**20 for r in rss]
    assert stager.arena_bytes == size


# --------------------------------------------------------------------------- busy and failures


def test_a_save_never_restages_the_arena_while_it_is_written(tmp_path):
    """on_busy='error' refuses; on_busy='wait' blocks until the earlier write is done."""
    first = make_state(seed=1, scale=4)  # more than BLOCK: the engine writes it, not engines.small
    expected_first = snapshot(first)
    gate = threading.Event()
    original = PosixEngine.write_file

    def gated_write(self, *args, **kwargs):
        gate.wait(10)
        return original(self, *args, **kwargs)

    refusing, waiting = NVMeStager(on_busy="error"), NVMeStager()
    try:
        PosixEngine.write_file = gated_write
        _, held = async_save(first, str(tmp_path / "held"), refusing)
        with pytest.raises(StagingBusyError, match="still being written"):
            refusing.stage(make_state(seed=2, scale=4))

        _, resp1 = async_save(first, str(tmp_path / "one"), waiting)
        second = make_state(seed=2, scale=4)
        done: list = []
        worker = threading.Thread(
            target=lambda: done.append(async_save(second, str(tmp_path / "two"), waiting)))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive(), "the second save re-staged the arena during the first write"
        gate.set()
        worker.join(10)
        assert not worker.is_alive()
        held.upload_completion.result()
        resp1.upload_completion.result()
        done[0][1].upload_completion.result()
    finally:
        gate.set()
        PosixEngine.write_file = original
    assert_same(load(str(tmp_path / "one"), expected_first), expected_first)
    assert_same(load(str(tmp_path / "two"), second), snapshot(second))
    assert waiting.stats()["waited_seconds"] > 0


def test_background_failure_surfaces_and_nothing_is_committed(tmp_path):
    state = make_state(scale=4)  # more than BLOCK: the engine writes it (engines.small writes one request)
    stager = NVMeStager()
    original = PosixEngine.write_file

    def disk_full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    try:
        PosixEngine.write_file = disk_full
        _, resp = async_save(state, str(tmp_path / "full"), stager)
        resp.staging_completion.result()  # staging itself succeeded
        with pytest.raises(CheckpointException) as info:
            resp.upload_completion.result()
    finally:
        PosixEngine.write_file = original
    # DCP keeps each rank's failure as (exception, traceback)
    causes = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes), causes
    assert not os.path.exists(tmp_path / "full" / "manifest.json")
    # the failed save released the arena: the next one reuses it and commits
    t0 = time.monotonic()
    _, resp = async_save(state, str(tmp_path / "ok"), stager)
    resp.upload_completion.result()
    assert time.monotonic() - t0 < 30
    assert stager.stats()["rebuilds"] == 0
    assert_same(load(str(tmp_path / "ok"), state), snapshot(state))


def test_stager_pickles_with_its_options_only():
    stager = NVMeStager(buffers=2, on_busy="error", shared_memory=True)
    clone = pickle.loads(pickle.dumps(stager))
    assert (clone.buffers, clone.on_busy, clone.shared_memory) == (2, "error", True)
    assert clone.arena_bytes == 0
    with pytest.raises(ValueError, match="on_busy"):
        NVMeStager(on_busy="drop")


# --------------------------------------------------------------------------- processes


def _process_mode(rank: int, world_size: int, root: str) -> None:
    state = make_state(scale=4)
    for shared in (True, False):
        stager = NVMeStager(shared_memory=shared)
        for i in range(2):
            path = os.path.join(root, f"s{int(shared)}{i}")
            expected = snapshot(state)
            resp = dcp.async_save(state, storage_writer=NVMeWriter(path, block_size=BLOCK),
                                  async_stager=stager,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            resp.staging_completion.result()  # the copy is taken (on the stager's thread)
            for tensor in (state["model"]["embed"], state["model"]["w1"]):
                tensor.add_(1)
            resp.upload_completion.result()
            out = _fill_objects(zeros_like_state(expected), expected)
            dcp.load(out, storage_reader=NVMeReader(path))
            assert_same(out, expected)
            with open(os.path.join(path, "manifest.json")) as f:
                io_stats = json.load(f)["ranks"][0]["io"]
            # the checkpoint process maps the arena and streams it without copying
            assert io_stats["copied_bytes"] < BLOCK, io_stats
        stager.close()
    # a failure in the checkpoint process comes back through the future; nothing committed
    blocker = os.path.join(root, "a_file")
    open(blocker, "w").close()
    resp = dcp.async_save(state, storage_writer=NVMeWriter(os.path.join(blocker, "ckpt")),
                          async_stager=NVMeStager(),
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    with pytest.raises(CheckpointException, match="a_file"):
        resp.upload_completion.result()


@pytest.mark.slow
def test_process_checkpointer_round_trip_and_failure(tmp_path):
    run_ranks(1, _process_mode, str(tmp_path))


def _two_ranks(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(11)
    full = torch.randn(402, 129, generator=g)
    shared = torch.randn(1000, generator=g)  # replicated: DCP dedups it to one rank
    state = {"sharded": distribute_tensor(full, mesh, [Shard(0)]), "shared": shared,
             "step": 4, "local": torch.full((300,), float(rank))}
    state["local"] = distribute_tensor(torch.arange(600.0), mesh, [Shard(0)])
    stager = NVMeStager()
    for i in range(2):
        path = os.path.join(root, f"c{i}")
        resp = dcp.async_save(state, storage_writer=NVMeWriter(path, block_size=BLOCK),
                              async_stager=stager)
        resp.upload_completion.result()
    out = {"sharded": distribute_tensor(torch.zeros(402, 129), mesh, [Shard(0)]),
           "shared": torch.zeros(1000), "step": 0,
           "local": distribute_tensor(torch.zeros(600), mesh, [Shard(0)])}
    dcp.load(out, storage_reader=NVMeReader(os.path.join(root, "c1")))
    assert isinstance(out["sharded"], DTensor)
    assert out["sharded"].full_tensor().equal(full)
    assert out["local"].full_tensor().equal(torch.arange(600.0))
    assert out["shared"].equal(shared) and out["step"] == 4
    assert stager.stats()["rebuilds"] == 0


@pytest.mark.slow
def test_two_rank_gloo_async_save(tmp_path):
    run_ranks(2, _two_ranks, str(tmp_path))
