"""NVMeAsyncSaver: dcp.async_save's contract through one persistent save thread: values of the
call, saves in order, staging and upload failures, close, interpreter exit, two gloo ranks."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from dcp_nvme_harness.warm import warm_python
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_nvme import (
    CheckpointExistsError,
    InvalidInputError,
    NVMeAsyncSaver,
    NVMeReader,
    NVMeStager,
)
from dcp_nvme.errors import SaveError, StagingBusyError
from dcp_nvme.save.async_saver import missing_cpu_backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[2]


class Counter:
    """A Stateful value: the saver saves what its state_dict() returns at the call."""

    def __init__(self) -> None:
        self.steps = torch.arange(6, dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps.copy_(state["steps"])


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(257, 129, generator=g), "b": torch.randn(1001, generator=g).half()},
            "counter": Counter(), "step": seed}


def snapshot(state: dict) -> dict:
    return {"w": state["model"]["w"].clone(), "b": state["model"]["b"].clone(),
            "steps": state["counter"].steps.clone(), "step": state["step"]}


def load(path) -> dict:
    target = {"model": {"w": torch.zeros(257, 129), "b": torch.zeros(1001, dtype=torch.half)},
              "counter": {"steps": torch.zeros(6, dtype=torch.int64)}, "step": None}
    dcp.load(target, storage_reader=NVMeReader(str(path)), no_dist=True)
    return {"w": target["model"]["w"], "b": target["model"]["b"], "steps": target["counter"]["steps"],
            "step": target["step"]}


def assert_bits(loaded: dict, expected: dict) -> None:
    for key in ("w", "b", "steps"):
        assert loaded[key].dtype == expected[key].dtype, key
        assert loaded[key].view(torch.uint8).equal(expected[key].view(torch.uint8)), key
    assert loaded["step"] == expected["step"]


def mutate(state: dict) -> None:
    state["model"]["w"].mul_(-3.0)
    state["model"]["b"].add_(1)
    state["counter"].steps.add_(100)


def test_saves_hold_the_values_at_the_call_and_run_in_order(tmp_path):
    state = make_state(0)
    stager = NVMeStager()
    with NVMeAsyncSaver(stager) as saver:
        first = snapshot(state)
        one = saver.save(state, checkpoint_id=tmp_path / "one", no_dist=True)
        assert isinstance(one, AsyncSaveResponse)
        one.staging_completion.result()
        mutate(state)  # the optimizer step, right after staging: "one" keeps the values above
        second = snapshot(state)
        # queued behind "one" (the single arena waits for it); its values are those of now
        two = saver.save(state, checkpoint_id=tmp_path / "two", no_dist=True)
        two.staging_completion.result()
        mutate(state)
        finished = []
        one.upload_completion.add_done_callback(lambda _f: finished.append("one"))
        two.upload_completion.add_done_callback(lambda _f: finished.append("two"))
        assert isinstance(two.upload_completion.result(), Metadata)
        assert isinstance(one.upload_completion.result(), Metadata)
    assert finished == ["one", "two"]
    assert_bits(load(tmp_path / "one"), first)
    assert_bits(load(tmp_path / "two"), second)
    stats = stager.stats()
    assert stats["saves"] == 2 and stats["rebuilds"] == 0  # one arena, reused: the first save released it
    assert stats["arena_bytes"] > 0  # a stager we passed in stays open
    stager.close()


class FailingStager(NVMeStager):
    """Staging fails on the staging thread, after stage() returned (as a failed copy does)."""

    def __init__(self) -> None:
        super().__init__(wait_timeout=60)  # a save that never released the arena fails, not hangs
        self.fail = True

    def _prepare(self, *args, **kwargs):
        if self.fail:
            raise OSError("copy failed: staging memory unavailable")
        return super()._prepare(*args, **kwargs)


def test_a_staging_failure_fails_both_futures_and_saves_nothing(tmp_path):
    stager = FailingStager()
    state = make_state(1)
    with NVMeAsyncSaver(stager) as saver:
        resp = saver.save(state, checkpoint_id=tmp_path / "bad", no_dist=True)
        with pytest.raises(OSError, match="staging memory unavailable"):
            resp.staging_completion.result(timeout=60)
        with pytest.raises(OSError, match="staging memory unavailable"):
            resp.upload_completion.result(timeout=60)
        assert not (tmp_path / "bad").exists()
        stager.fail = False
        expected = snapshot(state)
        resp = saver.save(state, checkpoint_id=tmp_path / "good", no_dist=True)
        resp.upload_completion.result(timeout=60)  # the failed save left the arena free
    assert_bits(load(tmp_path / "good"), expected)
    stager.close()


def test_an_upload_failure_fails_only_upload_completion_and_the_next_save_works(tmp_path):
    state = make_state(2)
    with NVMeAsyncSaver() as saver:
        saver.save(state, checkpoint_id=tmp_path / "ck", no_dist=True).upload_completion.result()
        committed = (tmp_path / "ck" / "manifest.json").read_bytes()
        first = snapshot(state)
        mutate(state)
        again = saver.save(state, checkpoint_id=tmp_path / "ck", no_dist=True)  # overwrite is off
        assert again.staging_completion.result() is None
        with pytest.raises(CheckpointExistsError, match="overwrite"):
            again.upload_completion.result()
        expected = snapshot(state)
        saver.save(state, checkpoint_id=tmp_path / "next", no_dist=True).upload_completion.result()
        stager = saver.stager
    assert (tmp_path / "ck" / "manifest.json").read_bytes() == committed
    assert_bits(load(tmp_path / "ck"), first)
    assert_bits(load(tmp_path / "next"), expected)
    assert stager.stats()["rebuilds"] == 0 and stager.arena_bytes == 0  # the saver closed its own stager


def test_close_drains_the_queue_and_later_saves_are_refused(tmp_path):
    state = make_state(3)
    saver = NVMeAsyncSaver()
    expected, responses = [], []
    for i in range(3):
        expected.append(snapshot(state))
        responses.append(saver.save(state, checkpoint_id=tmp_path / f"c{i}", no_dist=True))
        responses[-1].staging_completion.result()
        mutate(state)
    saver.close()  # returns once every queued save is durable
    assert all(r.upload_completion.done() and r.upload_completion.exception() is None for r in responses)
    assert not saver._worker.is_alive()
    saver.close()  # idempotent
    with pytest.raises(SaveError, match="closed"):
        saver.save(state, checkpoint_id=tmp_path / "late", no_dist=True)
    assert not (tmp_path / "late").exists()
    for i in range(3):
        assert_bits(load(tmp_path / f"c{i}"), expected[i])


class GatedStager(NVMeStager):
    """The staging thread waits for ``gate`` before it copies: a save still staging."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def _prepare(self, *args, **kwargs):
        assert self.gate.wait(60)
        return super()._prepare(*args, **kwargs)


def _closing(saver: NVMeAsyncSaver) -> threading.Thread:
    closer = threading.Thread(target=saver.close, daemon=True)
    closer.start()
    return closer


def test_a_save_still_staging_is_run_by_close_and_by_a_dropped_saver(tmp_path):
    state = make_state(5)
    expected = snapshot(state)
    stager = GatedStager()
    saver = NVMeAsyncSaver(stager)
    resp = saver.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    closer = _closing(saver)  # the save is not queued yet: its copy has not even started
    closer.join(0.3)
    assert closer.is_alive() and not resp.upload_completion.done()
    stager.gate.set()
    closer.join(60)
    assert not closer.is_alive() and isinstance(resp.upload_completion.result(), Metadata)
    # a saver nobody keeps: garbage before its copy is done, the save still runs
    stager.gate.clear()
    resp = NVMeAsyncSaver(stager).save(state, checkpoint_id=tmp_path / "b", no_dist=True)
    gc.collect()
    stager.gate.set()
    assert isinstance(resp.upload_completion.result(timeout=60), Metadata)
    for name in ("a", "b"):
        assert_bits(load(tmp_path / name), expected)
    stager.close()


def test_a_stage_that_raises_raises_from_save_and_close_still_returns(tmp_path):
    state = make_state(6)
    stager = GatedStager(on_busy="error")
    saver = NVMeAsyncSaver(stager)
    first = saver.save(state, checkpoint_id=tmp_path / "first", no_dist=True)
    with pytest.raises(StagingBusyError, match="still being written"):
        saver.save(state, checkpoint_id=tmp_path / "second", no_dist=True)  # the one arena is staging
    stager.gate.set()
    closer = _closing(saver)
    closer.join(60)
    assert not closer.is_alive()  # the refused save is not waited for
    first.upload_completion.result()
    assert not (tmp_path / "second").exists()
    stager.close()


def test_a_save_cancelled_while_queued_is_not_run_and_the_next_one_is(tmp_path):
    state = make_state(7)
    stager = GatedStager(buffers=2)
    with NVMeAsyncSaver(stager) as saver:
        first = saver.save(state, checkpoint_id=tmp_path / "first", no_dist=True)
        second = saver.save(state, checkpoint_id=tmp_path / "second", no_dist=True)
        assert second.upload_completion.cancel()  # still waiting for its copy: not started
        stager.gate.set()
        first.upload_completion.result(timeout=60)
        expected = snapshot(state)
        third = saver.save(state, checkpoint_id=tmp_path / "third", no_dist=True)
        third.upload_completion.result(timeout=60)
    assert second.staging_completion.result() is None and not (tmp_path / "second").exists()
    assert_bits(load(tmp_path / "third"), expected)
    assert stager.stats()["rebuilds"] == 0
    stager.close()


def test_bad_input_is_refused_on_the_caller():
    with NVMeAsyncSaver() as saver:
        with pytest.raises(InvalidInputError, match="checkpoint_id"):
            saver.save({"x": torch.ones(2)}, no_dist=True)
        with pytest.raises(InvalidInputError, match="must be a dict"):
            saver.save([torch.ones(2)], checkpoint_id="/nonexistent/x", no_dist=True)
    with pytest.raises(InvalidInputError, match="AsyncStager"):
        NVMeAsyncSaver(stager="fast")
    # dist.get_backend_config strings: the save thread's collectives need a CPU backend
    assert missing_cpu_backend("cuda:nccl")
    assert not missing_cpu_backend("cpu:gloo,cuda:nccl")
    assert not missing_cpu_backend("cpu:gloo,cuda:gloo")


def test_bounded_staging_through_the_saver_releases_training_and_leaks_no_thread(tmp_path):
    state = make_state(4)
    stager = NVMeStager(max_bytes=64 << 10)  # smaller than the state: the first tensors are written live
    with NVMeAsyncSaver(stager) as saver:
        expected = snapshot(state)
        resp = saver.save(state, checkpoint_id=tmp_path / "b", no_dist=True)
        resp.staging_completion.result(timeout=60)
        mutate(state)
        resp.upload_completion.result(timeout=60)
        assert stager.stats()["last_live_bytes"] > 0
    assert_bits(load(tmp_path / "b"), expected)
    assert not [t for t in threading.enumerate() if t.name.startswith("dcp-nvme-stage-wave")]
    stager.close()


EXIT_WITHOUT_CLOSE = """
import sys, torch, warnings
warnings.filterwarnings("ignore")
from dcp_nvme import NVMeAsyncSaver
saver = NVMeAsyncSaver()
state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
for i in range(3):
    saver.save(state, checkpoint_id=f"{sys.argv[1]}/c{i}", no_dist=True)
print("queued", flush=True)
"""


def test_interpreter_exit_without_close_finishes_the_queued_saves(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = warm_python().run(["-c", EXIT_WITHOUT_CLOSE, tmp_path], timeout=240, env=env)  # as `python -c`
    assert run.returncode == 0, run.stderr
    assert "queued" in run.stdout
    for i in range(3):
        out = {"w": torch.zeros(1 << 20)}
        dcp.load(out, storage_reader=NVMeReader(str(tmp_path / f"c{i}")), no_dist=True)
        assert out["w"].equal(torch.arange(1 << 20, dtype=torch.float32))


def _two_ranks(rank: int, world_size: int, root: str) -> None:
    g = torch.Generator().manual_seed(rank)
    state = {f"rank{rank}": torch.randn(300, 77, generator=g), "shared": torch.full((64,), 5.0)}
    expected = []
    with NVMeAsyncSaver() as saver:
        for i in range(2):
            expected.append({k: v.clone() for k, v in state.items()})
            resp = saver.save(state, checkpoint_id=os.path.join(root, f"s{i}"))
            resp.staging_completion.result()
            state[f"rank{rank}"].add_(1)
            state["shared"].add_(1)
        resp.upload_completion.result()
    dist.barrier()
    for i in range(2):
        target = {f"rank{rank}": torch.zeros(300, 77), "shared": torch.zeros(64)}
        dcp.load(target, storage_reader=NVMeReader(os.path.join(root, f"s{i}")))
        for key, value in expected[i].items():
            assert target[key].equal(value), (rank, i, key)


def test_two_gloo_ranks_save_through_the_saver_and_load(tmp_path):
    run_ranks(2, _two_ranks, str(tmp_path))
    assert all((tmp_path / f"s{i}" / "manifest.json").exists() for i in range(2))


CTRL_C_WHILE_STAGING = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme import NVMeStager, NVMeWriter

state = {f"t{i}": torch.ones(20000) for i in range(3000)}  # a walk long enough to be cut
pending = dcp.async_save(state, storage_writer=NVMeWriter(sys.argv[1]), async_stager=NVMeStager(), no_dist=True)
raise KeyboardInterrupt  # Ctrl-C right after the call
"""


@pytest.mark.slow  # another process
def test_ctrl_c_while_staging_says_the_save_is_abandoned(tmp_path):
    """The interpreter's exit stops Python's thread pools under the staging thread: the message
    says the process is exiting and the save is abandoned, not that staging failed."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = warm_python().run(["-c", CTRL_C_WHILE_STAGING, tmp_path / "step_1"], timeout=120, env=env)
    assert "KeyboardInterrupt" in run.stderr, run.stderr
    assert "cannot schedule new futures" not in run.stderr and "staging failed" not in run.stderr, run.stderr
    assert "the process is exiting (its main thread ended, e.g. by Ctrl-C) while a save was being staged: " \
           "that save is abandoned and nothing of it is written" in run.stderr, run.stderr
    assert not (tmp_path / "step_1" / "manifest.json").exists()
