"""Real multi-process saves over gloo: DTensor shards, FSDP2, resharding, failures on a rank."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dcp_nvme import NVMeReader, NVMeWriter

pytestmark = pytest.mark.slow


def full_state():
    generator = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(64, 24, generator=generator),
        "proj": torch.randn(16, 40, generator=generator).to(torch.bfloat16),
        "bias": torch.randn(48, generator=generator),
        "step": 11,
    }


def _sharded(state, world, placements):
    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(v, mesh, [placements[k]]) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def _save_sharded(rank, world, path, dims):
    placements = {"emb": Shard(dims[0]), "proj": Shard(dims[1]), "bias": Replicate()}
    state = _sharded(full_state(), world, placements)
    writer = NVMeWriter(path, block_size=8192)
    dcp.save(state, storage_writer=writer)
    if rank == 0:
        assert writer.last_manifest["world_size"] == world


def _load_sharded(rank, world, path, dims):
    placements = {"emb": Shard(dims[0]), "proj": Shard(dims[1]), "bias": Shard(0)}
    expected = full_state()
    dest = _sharded({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in expected.items()},
                    world, placements)
    reader = NVMeReader(path)
    dcp.load(dest, storage_reader=reader)
    for key in ("emb", "proj", "bias"):
        assert torch.equal(dest[key].full_tensor(), expected[key]), key
    assert dest["step"] == 11
    # a rank reads its own slices: bytes needed stay near its share, not the whole checkpoint
    total = sum(v.numel() * v.element_size() for v in expected.values() if isinstance(v, torch.Tensor))
    assert reader.last_stats["bytes_needed"] <= total // world + 4096


@pytest.mark.parametrize("save_world,load_world,save_dims,load_dims", [
    (4, 2, (0, 1), (1, 0)),
    (2, 1, (0, 0), (0, 0)),
    (2, 2, (1, 1), (0, 0)),
])
def test_reshard(tmp_path, save_world, load_world, save_dims, load_dims):
    path = str(tmp_path / "ckpt")
    run_ranks(save_world, _save_sharded, path, save_dims)
    files = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(files) == save_world  # one container per rank
    if load_world == 1:
        dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in full_state().items()}
        dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True)
        for key, value in full_state().items():
            assert torch.equal(dest[key], value) if isinstance(value, torch.Tensor) else dest[key] == value
    else:
        run_ranks(load_world, _load_sharded, path, load_dims)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _fsdp_train_and_save(rank, world, path, out):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=NVMeWriter(path))
    full = {k: v.full_tensor() for k, v in model_sd.items()}
    full_optim = {k: {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in s.items()}
                  for k, s in optim_sd["state"].items()}
    if rank == 0:
        torch.save({"model": full, "optim": full_optim}, out)


def test_fsdp2_save_two_ranks_load_one(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path, reference = str(tmp_path / "ckpt"), str(tmp_path / "reference.pt")
    run_ranks(2, _fsdp_train_and_save, path, reference)
    expected = torch.load(reference)
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(1, 16)).sum().backward()
    optim.step()  # materialise optimizer state to load into
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=NVMeReader(path), no_dist=True)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for key, value in expected["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    loaded_optim = state["optim"]["state"]
    for fqn, moments in expected["optim"].items():
        for name, value in moments.items():
            assert torch.equal(torch.as_tensor(loaded_optim[fqn][name]), torch.as_tensor(value)), (fqn, name)


def _one_rank_fails(rank, world, path):
    from dcp_nvme.engines import host_io as files
    from dcp_nvme.engines import small

    if rank == 1:
        def broken(fd, buffer, offset):
            raise OSError(5, "Input/output error")
        files.pwrite_all = broken  # the engine's first write
        small.pwritev_all = broken  # the one write of a container of one request
    state = _sharded(full_state(), world, {"emb": Shard(0), "proj": Shard(0), "bias": Shard(0)})
    try:
        dcp.save(state, storage_writer=NVMeWriter(path))
    except CheckpointException as exc:
        assert 1 in exc.failures and "Input/output error" in str(exc)
    else:
        raise AssertionError(f"rank {rank}: the save should have failed")
    dist.barrier()
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_failure_on_one_rank_fails_every_rank_and_commits_nothing(tmp_path):
    run_ranks(2, _one_rank_fails, str(tmp_path / "ckpt"))


def _load_two_steps(rank, world, run):
    state = {"w": torch.full((8,), float(rank)), "step": 1}
    for step in (1, 2):  # every rank saves both steps, in one shared directory
        dcp.save({"w": torch.full((8,), float(step)), "step": step},
                 storage_writer=NVMeWriter(os.path.join(run, f"step_{step}")))
    mine = os.path.join(run, f"step_{2 - rank}")  # rank 0 takes step_2, rank 1 step_1: a mix
    try:
        dcp.load(state, storage_reader=NVMeReader(mine))
    except CheckpointException as exc:
        said = str(exc)
        assert "different saves" in said and "step_1" in said and "step_2" in said, said
    else:
        raise AssertionError(f"rank {rank}: a load of two steps should fail on every rank")
    assert torch.equal(state["w"], torch.full((8,), float(rank))) and state["step"] == 1  # untouched
    dcp.load(state, storage_reader=NVMeReader(os.path.join(run, "step_2")))  # one step: loads
    assert torch.equal(state["w"], torch.full((8,), 2.0)) and state["step"] == 2


def test_ranks_that_load_different_steps_are_refused_on_every_rank(tmp_path):
    """A restart where each node took its own newest step (a commit killed half-way) would load
    one model from two steps: the coordinator sees each rank's save in its plan and refuses."""
    run_ranks(2, _load_two_steps, str(tmp_path))
