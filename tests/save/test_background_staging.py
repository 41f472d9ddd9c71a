"""NVMeStager's background staging of host tensors: async_save returns before the copy, the
checkpoint holds the values of the call, staging_completion is the copy's end, a failed copy or
a state the stager cannot stage surfaces from both futures and commits nothing, bounded staging
waits for the copy."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_stager import assert_same, async_save, load, make_state, snapshot

from dcp_nvme import NVMeStager, NVMeWriter
from dcp_nvme.errors import UnsupportedItemError
from dcp_nvme.save import arena
from dcp_nvme.save import stager as stager_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class GatedCopy:
    """Stands in for the staging thread's copy: holds it until ``open`` is set, then copies
    (or raises ``fail``). Installed for one test through monkeypatch."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.open = threading.Event()
        self.started = threading.Event()
        self.fail = fail
        self.threads: set[str] = set()

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.threads.add(threading.current_thread().name)
        self.started.set()
        assert self.open.wait(30), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        arena.copy_host_chunked(dst, src)


def test_async_save_returns_before_the_copy_and_keeps_the_values_of_the_call(tmp_path, monkeypatch):
    gate = GatedCopy()
    monkeypatch.setattr(stager_module, "copy_host_chunked", gate)
    state = make_state()
    expected = snapshot(state)
    stager = NVMeStager()
    _, resp = async_save(state, str(tmp_path / "c"), stager)
    assert gate.started.wait(30)
    # the caller has its thread back while the copy is still held
    assert not resp.staging_completion.done() and not resp.upload_completion.done()
    assert all(name.startswith("dcp-nvme-stage") for name in gate.threads), gate.threads
    gate.open.set()
    stager.synchronize_staging()  # returns once the copy is done
    resp.staging_completion.result(timeout=30)
    assert 0 < stager.stats()["last_stage_seconds"] < stager.stats()["last_copy_seconds"]
    # after staging_completion nothing of the state is read any more: tensors or other leaves
    state["model"]["note"]["values"].append(99)
    state["optim"]["param_groups"][0]["lr"] = 5.0
    state["step"] = 1000
    for tensor in (state["model"]["embed"], state["model"]["w1"], state["optim"]["state"]["0"]["exp_avg"]):
        tensor.mul_(-3).add_(1)  # the optimizer step, after staging_completion
    resp.upload_completion.result()
    assert_same(load(str(tmp_path / "c"), expected), expected)
    stager.close()


def test_a_failed_copy_surfaces_from_both_futures_and_commits_nothing(tmp_path, monkeypatch):
    gate = GatedCopy(fail=MemoryError("injected: the staging copy failed"))
    monkeypatch.setattr(stager_module, "copy_host_chunked", gate)
    state = make_state()
    stager = NVMeStager()
    _, resp = async_save(state, str(tmp_path / "bad"), stager)
    assert gate.started.wait(30)
    gate.open.set()
    with pytest.raises(MemoryError, match="staging copy failed"):
        resp.staging_completion.result(timeout=30)
    with pytest.raises(MemoryError, match="staging copy failed"):
        resp.upload_completion.result(timeout=30)
    assert not os.path.exists(tmp_path / "bad" / "manifest.json")
    # the arena is free again: the next save (real copy) commits the current values
    monkeypatch.setattr(stager_module, "copy_host_chunked", arena.copy_host_chunked)
    _, resp = async_save(state, str(tmp_path / "ok"), stager)
    resp.upload_completion.result(timeout=60)
    assert stager.stats()["rebuilds"] == 0
    assert_same(load(str(tmp_path / "ok"), state), snapshot(state))
    stager.close()


def test_a_state_it_cannot_stage_fails_the_save_from_the_staging_thread(tmp_path):
    stager = NVMeStager()
    state = {"w": torch.ones(4), "m": torch.empty(4, device="meta")}
    _, resp = async_save(state, str(tmp_path / "q"), stager)
    with pytest.raises(UnsupportedItemError, match="m: a meta tensor has no data"):
        resp.upload_completion.result(timeout=30)
    assert not (tmp_path / "q" / "manifest.json").exists()
    _, resp = async_save({"w": torch.ones(4)}, str(tmp_path / "ok"), stager)  # the arena is free
    resp.upload_completion.result(timeout=30)
    stager.close()


def test_bounded_staging_writes_only_after_the_copy_and_a_failed_copy_releases(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(11)
    state = {f"layer{i}": torch.randn(64, 1024, generator=g) for i in range(8)}  # 8 x 256 KiB
    expected = snapshot(state)
    gate = GatedCopy()
    monkeypatch.setattr(stager_module, "copy_host_chunked", gate)
    stager = NVMeStager(max_bytes=4 * (256 << 10))
    _, resp = async_save(state, str(tmp_path / "half"), stager)
    assert gate.started.wait(30)
    assert not resp.staging_completion.done()
    assert not (tmp_path / "half" / "manifest.json").exists()
    gate.open.set()
    resp.staging_completion.result(timeout=60)  # the arena copy and the live head are written
    assert stager.stats()["last_live_bytes"] == 4 * (256 << 10)
    for tensor in state.values():
        tensor.mul_(-1)
    resp.upload_completion.result(timeout=60)
    assert_same(load(str(tmp_path / "half"), expected), expected)

    gate = GatedCopy(fail=RuntimeError("injected: bounded copy failed"))
    monkeypatch.setattr(stager_module, "copy_host_chunked", gate)
    _, resp = async_save(state, str(tmp_path / "fail"), stager)
    gate.open.set()
    with pytest.raises(RuntimeError, match="bounded copy failed"):
        resp.staging_completion.result(timeout=60)
    with pytest.raises(RuntimeError, match="bounded copy failed"):
        resp.upload_completion.result(timeout=60)
    assert not (tmp_path / "fail" / "manifest.json").exists()
    stager.close()


def test_background_copy_off_copies_before_async_save_returns(tmp_path):
    state = make_state(seed=4)
    expected = snapshot(state)
    stager = NVMeStager(background_copy=False)
    resp = dcp.async_save(state, storage_writer=NVMeWriter(str(tmp_path / "s")),
                          async_stager=stager, no_dist=True)
    assert resp.staging_completion.done()
    for tensor in (state["model"]["embed"], state["model"]["b1"]):
        tensor.zero_()
    resp.upload_completion.result()
    assert_same(load(str(tmp_path / "s"), expected), expected)
    stager.close()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5000, 7),                       # contiguous: several memmove chunks
    lambda: torch.randn(300, 900)[:, 3:800],            # strided rows: serial row blocks
    lambda: torch.randn(4000, 3).t(),                   # transposed
    lambda: torch.randn(999, dtype=torch.complex64).conj(),  # a lazy conjugate
    lambda: torch.tensor(2.5),                          # 0-dim
    lambda: torch.empty(0, 3),
], ids=["contiguous", "strided", "transposed", "conj", "scalar", "empty"])
def test_chunked_copy_is_exact(make):
    src = make()
    dst = torch.empty(src.shape, dtype=src.dtype)
    arena.copy_host_chunked(dst, src, chunk=4096)
    assert torch.equal(dst, src.resolve_conj())
