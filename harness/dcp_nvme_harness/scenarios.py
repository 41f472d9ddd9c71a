"""Shared plumbing for the integration scenarios: process launch, checkpoint checks, comparisons.

Every scenario runs its phases inside ONE ``torch.multiprocessing.spawn`` of 2 processes (process
start-up and trainer imports dominate the cost on a 2-core CI box):

  A  world 2: train, save (sync and async) through dcp_nvme; rank 0 keeps the losses and the
     full model/optimizer state taken at each save (the uninterrupted reference run).
  B  world 2: build everything afresh (a different init seed), resume from the latest committed
     checkpoint, check state == reference snapshot, train on, check losses == A's.
  C  world 1: rank 0 tears the 2-rank process group down, joins a new 1-rank group and repeats B
     (resharding 2 -> 1); rank 1 exits.

The trainers' storage is always the real dcp_nvme (NVMeWriter / NVMeReader / NVMeStager): the
integrations default to it and the scenarios pass no factories. ``assert_nvme_checkpoint`` checks
the files on disk so a silent fallback to DCP's FileSystemWriter would fail the run.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

WORLD = 2
# tolerances for loss continuity: same world size must agree to float rounding of one reduction;
# another world size changes the reduction order (per-rank partial losses/gradients)
TOL_SAME_WORLD = 1e-6
TOL_OTHER_WORLD = 1e-5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _set_env(rank: int, world: int, port: int) -> None:
    # what torchrun exports; TORCHELASTIC_RUN_ID makes Lightning treat the processes as
    # externally launched (TorchElasticEnvironment) instead of launching its own
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
        TORCHELASTIC_RUN_ID="dcp-nvme-scenario", OMP_NUM_THREADS="1",
    )


def init_group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    _set_env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def shrink_to_one(port: int) -> bool:
    """Leave the 2-rank group; rank 0 joins a fresh 1-rank group and returns True."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return False
    init_group(0, 1, port)
    return True


def _entry(rank: int, fn: Callable[..., Any], ports: tuple[int, int], args: tuple) -> None:
    import torch

    torch.set_num_threads(1)
    init_group(rank, WORLD, ports[0])
    fn(rank, ports[1], *args)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, phase_c_port, *args)`` on 2 ranks joined by gloo on loopback.

    ``fn`` must be a module-level function of an importable module: the ranks are forked from
    multiprocessing's fork server, a fresh process that imported torch and dcp_nvme once (and
    ``fn``'s module, whose trainer imports then come once per rank, not per scenario), so the
    ranks start from a clean process without each importing torch again.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "dcp_nvme", fn.__module__])
    mp.start_processes(_entry, args=(fn, (free_port(), free_port()), args), nprocs=WORLD, join=True,
                       start_method="forkserver")


# --------------------------------------------------------------------------- checks


def full_state(model: Any, *optimizers: Any) -> dict:
    """Snapshot of the full (unsharded) model + optimizer state of an FSDP2 model; a collective,
    the tensors land on rank 0 (other ranks get empty dicts)."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = {"model": get_model_state_dict(model, options=o)}
    for i, opt in enumerate(optimizers):
        full[f"optim{i}"] = get_optimizer_state_dict(model, opt, options=o)
    return copy.deepcopy(full)  # CPU tensors (Adam's "step") come back by reference


def assert_nvme_checkpoint(path: os.PathLike | str, world: int = WORLD) -> None:
    """``path`` is a committed dcp_nvme checkpoint written by ``world`` ranks (not a DCP
    FileSystemWriter one): manifest.json, one rank_*.safetensors per rank, no .metadata."""
    p = Path(path)
    names = sorted(x.name for x in p.iterdir()) if p.is_dir() else []
    assert "manifest.json" in names, f"{p}: no manifest.json (not a committed dcp_nvme checkpoint): {names}"
    ranks = [n for n in names if n.startswith("rank_") and n.endswith(".safetensors")]
    assert len(ranks) == world, f"{p}: expected {world} rank_*.safetensors files, found {names}"
    assert ".metadata" not in names, f"{p}: holds DCP FileSystemWriter's .metadata: {names}"


def assert_same_state(ref: Mapping, got: Mapping, what: str) -> None:
    """Bitwise equality of two nested state dicts (tensors by torch.equal, the rest by ==)."""
    import torch

    assert set(ref) == set(got), f"{what}: keys differ: {sorted(set(ref) ^ set(got))}"
    for key, value in ref.items():
        other = got[key]
        if isinstance(value, Mapping):
            assert_same_state(value, other, f"{what}.{key}")
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, torch.Tensor)) for v in value):
            assert len(value) == len(other), f"{what}.{key}: length differs"
            assert_same_state(dict(enumerate(value)), dict(enumerate(other)), f"{what}.{key}")
        elif isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            a, b = torch.as_tensor(value), torch.as_tensor(other)
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}.{key}: tensors differ ({a.dtype} {a.flatten()[:4]} vs {b.dtype} {b.flatten()[:4]})"
        else:
            assert value == other, f"{what}.{key}: {value!r} != {other!r}"


def assert_losses_continue(ref: Mapping[int, float], got: Mapping[int, float], steps: range,
                           tol: float, what: str) -> None:
    """The resumed run's per-step losses equal the uninterrupted run's."""
    assert sorted(got) == list(steps), f"{what}: trained steps {sorted(got)}, expected {list(steps)}"
    for step in steps:
        a, b = ref[step], got[step]
        assert abs(a - b) <= tol * max(1.0, abs(a)), f"{what}: step {step} loss {b} != {a} (tol {tol})"
