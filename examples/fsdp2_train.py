"""FSDP2 training loop that checkpoints with dcp_nvme (async) and resumes from the newest commit.

    torchrun --nproc-per-node=2 examples/fsdp2_train.py --ckpt-dir /nvme/run1 --steps 8 --save-every 2
    torchrun --nproc-per-node=1 examples/fsdp2_train.py --ckpt-dir /nvme/run1 --steps 12 --save-every 2

The second command resumes from the newest committed ``step-N`` directory (``dcp_nvme.latest``: one
whose ``manifest.json``, dcp_nvme's commit marker, exists), at a different world size (DCP reshards on load). The lines that matter for
a user are in ``save_async`` and ``resume``; everything else is an ordinary FSDP2 loop on a tiny MLP
(CPU + gloo, or CUDA + NCCL when a GPU is present).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import dcp_nvme
from dcp_nvme import NVMeReader, NVMeStager, NVMeWriter

DIM, HIDDEN, GLOBAL_BATCH = 16, 32, 8

Hook = Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny MLP, each Linear sharded with fully_shard over all ranks, and its AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    ).to(device())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch; the data depend only on the step, so a resumed run
    (at any world size that divides GLOBAL_BATCH) sees the same samples."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    per = GLOBAL_BATCH // dist.get_world_size()
    lo = dist.get_rank() * per
    return x[lo:lo + per].to(device()), y[lo:lo + per].to(device())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # FSDP2 averages the gradients over ranks
    opt.step()
    opt.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def app_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What a checkpoint holds: sharded model + optimizer state (DTensors) and the step."""
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "train": {"step": step},
    }


def step_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"step-{step}"


def save_async(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, ckpt_dir: str | os.PathLike,
               stager: NVMeStager, pg: dist.ProcessGroup) -> Future:
    """Start an async save; returns once the state is staged (training may then mutate it), with
    the Future of its commit."""
    ret = dcp.async_save(
        app_state(model, opt, step),
        storage_writer=NVMeWriter(step_dir(ckpt_dir, step)),
        async_stager=stager,  # NVMeStager: async_save returns an AsyncSaveResponse
        process_group=pg,  # a gloo group of its own: the upload's collectives run in a thread
    )
    ret.staging_completion.result()
    return ret.upload_completion


def resume(model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt_dir: str | os.PathLike) -> int:
    """Load the newest committed checkpoint into model/opt; returns its step (0: none)."""
    os.makedirs(ckpt_dir, exist_ok=True)  # latest() refuses a run directory that is not there
    latest = dcp_nvme.latest(ckpt_dir)  # newest committed checkpoint; None on a fresh start
    if latest is None:
        return 0
    state = app_state(model, opt, 0)
    dcp.load(state, storage_reader=NVMeReader(latest))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, optim_state_dict=state["optim"])
    return int(state["train"]["step"])


def train(ckpt_dir: str | os.PathLike, steps: int, save_every: int, *, seed: int = 0,
          on_save: Hook | None = None, on_resume: Hook | None = None) -> dict[int, float]:
    """Train to ``steps`` (resuming if a checkpoint exists); returns {step: mean loss}.

    Saves asynchronously every ``save_every`` steps with at most one save in flight; the last
    save is committed before returning. ``on_save``/``on_resume`` observe the state (tests).
    """
    model, opt = build(seed)
    start = resume(model, opt, ckpt_dir)
    if start and on_resume is not None:
        on_resume(start, model, opt)
    stager, pg, pending = NVMeStager(), dist.new_group(backend="gloo"), None
    losses: dict[int, float] = {}
    try:
        for step in range(start + 1, steps + 1):
            losses[step] = train_step(model, opt, step)
            if step % save_every == 0:
                if pending is not None:
                    pending.result()  # the previous save is committed before the next starts
                pending = save_async(model, opt, step, ckpt_dir, stager, pg)
                if on_save is not None:
                    on_save(step, model, opt)
        if pending is not None:
            pending.result()
    finally:
        stager.close()
        dist.destroy_process_group(pg)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=2)
    a = ap.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    try:
        losses = train(a.ckpt_dir, a.steps, a.save_every)
        if dist.get_rank() == 0:
            for step, loss in losses.items():
                print(f"step {step}: loss {loss:.6f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
