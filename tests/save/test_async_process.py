"""NVMeStager with DCP's PROCESS checkpointer on DTensor states (FSDP2), and the async saver and
the stager in the child of a fork()."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_nvme import NVMeReader, NVMeStager, NVMeWriter

TIMEOUT = 120  # seconds: a save that hangs fails the test instead of the suite


def _locals(state: dict) -> dict:
    """Each tensor's bytes on this rank (a DTensor's local shard), cloned; other leaves as they are."""
    out: dict = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _locals(value)
        elif isinstance(value, DTensor):
            out[key] = value.to_local().detach().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


def _assert_bitwise(got: dict, expected: dict, path: str = "") -> None:
    assert set(got) == set(expected), (path, set(got), set(expected))
    for key, want in expected.items():
        where = f"{path}.{key}"
        have = got[key]
        if isinstance(want, dict):
            _assert_bitwise(have, want, where)
        elif isinstance(want, torch.Tensor):
            have = have.to_local() if isinstance(have, DTensor) else have
            assert have.dtype == want.dtype and have.shape == want.shape, where
            assert torch.equal(have.contiguous().reshape(-1).view(torch.uint8),
                               want.contiguous().reshape(-1).view(torch.uint8)), where
        else:
            assert have == want, where


def _dtensor_state(world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    return {
        "a": distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Shard(0)]),
        "c": distribute_tensor(torch.randn(6, 10, generator=g).to(torch.bfloat16), mesh, [Shard(1)]),
        "r": distribute_tensor(torch.randn(5, generator=g), mesh, [Replicate()]),
        "plain": torch.arange(7.0),
        "step": 3,
    }


def _dtensors_to_process(rank: int, world: int, root: str) -> None:
    from multiprocessing.reduction import ForkingPickler

    state = _dtensor_state(world)
    for shared in (True, False):
        stager = NVMeStager(shared_memory=shared)
        # what DCP's PROCESS executor does with the staged state: torch.multiprocessing pickles it
        staged = stager.stage(state).result(TIMEOUT)
        sent = ForkingPickler.loads(ForkingPickler.dumps(staged))
        assert all(isinstance(sent[k], DTensor) for k in "abcr")
        _assert_bitwise(sent, _locals(state))
        del staged, sent
        for i in range(2):  # the second save reuses the arena
            path = os.path.join(root, f"shared{int(shared)}_{i}")
            expected = _locals(state)
            resp = dcp.async_save(state, storage_writer=NVMeWriter(path), async_stager=stager,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            resp.staging_completion.result(TIMEOUT)
            for key in "abc":
                state[key].to_local().add_(1)  # after staging: not in this checkpoint
            resp.upload_completion.result(TIMEOUT)
            dest = {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                           run_check=False, shape=v.shape, stride=v.stride())
                        if isinstance(v, DTensor) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
                    for k, v in state.items()}
            dcp.load(dest, storage_reader=NVMeReader(path))
            _assert_bitwise(dest, expected)
        stager.close()


@pytest.mark.slow
def test_process_checkpointer_saves_dtensors_from_the_arena(tmp_path):
    """Two and more DTensors staged in one arena: each local shard is an arena view past the
    first, which made torch pickle the DTensor wrapper as if it owned memory (SIGSEGV in
    ``_share_fd_cpu_`` on every rank)."""
    run_ranks(2, _dtensors_to_process, str(tmp_path))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _fsdp2_to_process(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step() -> None:
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()

    torch.manual_seed(1 + rank)
    for _ in range(3):
        step()
    for shared in (True, False):
        stager = NVMeStager(shared_memory=shared)
        path = os.path.join(root, f"fsdp_shared{int(shared)}")
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        expected = {"model": _locals(model_sd), "optim": _locals(optim_sd["state"])}
        resp = dcp.async_save(state, storage_writer=NVMeWriter(path), async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        resp.staging_completion.result(TIMEOUT)
        step()  # the optimizer step after staging changes the live state, not the checkpoint
        resp.upload_completion.result(TIMEOUT)
        stager.close()
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=NVMeReader(path))
        _assert_bitwise({"model": model_sd, "optim": optim_sd["state"]}, expected)


@pytest.mark.slow
def test_process_checkpointer_saves_fsdp2_model_and_adamw(tmp_path):
    run_ranks(2, _fsdp2_to_process, str(tmp_path))


# --------------------------------------------------------------------------- fork()

_FORK_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_nvme import NVMeReader, NVMeStager, NVMeWriter
    from dcp_nvme.save.async_saver import NVMeAsyncSaver

    root = sys.argv[1]
    def state(value):
        return {"w": torch.full((1000,), float(value)), "b": torch.arange(33, dtype=torch.int64) * value,
                "step": int(value)}
    def check(path, value):
        out = {"w": torch.zeros(1000), "b": torch.zeros(33, dtype=torch.int64), "step": 0}
        dcp.load(out, storage_reader=NVMeReader(path), no_dist=True)
        want = state(value)
        assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"]), path
        assert out["step"] == want["step"], path

    saver = NVMeAsyncSaver()      # its worker and its stager's staging thread run in the parent
    idle = NVMeAsyncSaver()       # never saves in the child
    stager = NVMeStager()         # used with dcp.async_save
    saver.save(state(1), checkpoint_id=os.path.join(root, "parent1"), no_dist=True).upload_completion.result(60)
    dcp.async_save(state(1), storage_writer=NVMeWriter(os.path.join(root, "stager1")), async_stager=stager,
                   no_dist=True).upload_completion.result(60)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            # the parent's arenas (mmap/shared memory, shared with the parent) are not reused
            assert saver.stager.arena_bytes == 0 and stager.arena_bytes == 0
            saver.save(state(2), checkpoint_id=os.path.join(root, "child"), no_dist=True).upload_completion.result(60)
            dcp.async_save(state(4), storage_writer=NVMeWriter(os.path.join(root, "child_stager")),
                           async_stager=stager, no_dist=True).upload_completion.result(60)
            saver.save(state(5), checkpoint_id=os.path.join(root, "child2"), no_dist=True)
            saver.close()         # waits for the save above
            idle.close()
            check(os.path.join(root, "child2"), 5)
        except BaseException as exc:
            print(f"child: {type(exc).__name__}: {exc}", flush=True)
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    saver.save(state(3), checkpoint_id=os.path.join(root, "parent2"), no_dist=True).upload_completion.result(60)
    saver.close(); idle.close(); stager.close()
    check(os.path.join(root, "parent1"), 1)
    check(os.path.join(root, "child"), 2)
    check(os.path.join(root, "child_stager"), 4)
    check(os.path.join(root, "parent2"), 3)
    print("fork ok")
""")


@pytest.mark.slow  # other processes
def test_saver_and_stager_work_in_a_forked_child(tmp_path):
    """The child of fork() saves with the parent's NVMeAsyncSaver and NVMeStager: both used to
    hand the save to a thread that exists only in the parent (the futures never resolved). Forked
    in a fresh interpreter, so that this test process (which has threads) forks nothing."""
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0 and "fork ok" in done.stdout, done.stdout + done.stderr
