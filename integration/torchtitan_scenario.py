"""torchtitan CheckpointManager scenario (FSDP2 on CPU + gloo).

    python integration/torchtitan_scenario.py

Uses torchtitan's real OptimizersContainer, LRSchedulersContainer and CheckpointManager
machinery (through dcp_nvme.integrations.torchtitan.NVMeCheckpointManager) around a tiny FSDP2
MLP; no full torchtitan Trainer. One spawn of 2 ranks (see dcp_nvme_harness/scenarios.py):

  A  2 ranks, async_mode="async", interval 2: async saves at steps 2 and 4 (training overlaps
     the uploads), synchronous full save at step 6 (``save(6, last_step=True)`` with
     last_save_model_only=False), training on to step 8 (the uninterrupted reference). A save
     killed before its commit is then left behind as step-8 (data files, no manifest.json).
  B  2 ranks, fresh objects: ``load()`` (step=-1 -> newest committed = 6, not 8), state ==
     step-6 snapshot, losses 7..8 == A.
  C  1 rank: ``load(step=4)`` (the async checkpoint, resharded 2 -> 1), state == step-4
     snapshot, losses 5..8 == A.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dcp_nvme_harness import scenarios as _storage

TOTAL = 8
DIN, BATCH = 16, 8


def _phase(ckpt_dir: Path, phase: str, seed: int, load_step: int | None = None,
           ref: dict | None = None) -> tuple[dict, dict]:
    """Build model/optimizers/CheckpointManager afresh; phase A trains from scratch and saves,
    B/C load (``load_step``: -1 = newest) and train on. Returns (losses, snapshots by step)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from dcp_nvme.integrations.torchtitan import NVMeCheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(DIN, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0})],
        implementation="for-loop",  # the default "fused" is CUDA-only
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=TOTAL)
    train_state = {"step": 0}

    class TrainState:  # Stateful, like torchtitan's Trainer
        def state_dict(self):
            return {"step": torch.tensor(train_state["step"])}

        def load_state_dict(self, sd):
            train_state["step"] = int(sd["step"])

    cfg = NVMeCheckpointManager.Config(
        enable=True, folder=str(ckpt_dir), interval=2, keep_latest_k=0,
        async_mode="async" if phase == "A" else "disabled", last_save_model_only=False,
    )
    ckpt = NVMeCheckpointManager(
        cfg, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": TrainState()}, sd_adapter=None,
    )

    def snapshot() -> dict:
        snap = _storage.full_state(model, optimizers.optimizers[0])
        snap["lr"] = optimizers.optimizers[0].param_groups[0]["lr"]
        snap["step"] = train_state["step"]
        return snap

    if load_step is not None:
        assert ckpt.load(step=load_step), f"torchtitan {phase}: nothing loaded from {ckpt_dir}"
        got = snapshot()
        if rank == 0:
            _storage.assert_same_state(ref, got, f"torchtitan {phase} resumed state")

    losses: dict[int, float] = {}
    snaps: dict[int, dict] = {}
    while train_state["step"] < TOTAL:
        step = train_state["step"] + 1
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(BATCH, DIN, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        per = BATCH // world
        loss = torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / world
        train_state["step"] = step
        if phase == "A" and step <= 6:
            ckpt.save(curr_step=step, last_step=(step == 6))
            snaps[step] = snapshot()
    ckpt.maybe_wait_for_saving()
    if phase == "A":
        from dcp_nvme import NVMeStager

        assert isinstance(ckpt._nvme_stager, NVMeStager), ckpt._nvme_stager
    ckpt.close()
    return losses, snaps


def worker(rank: int, port_c: int, root: str) -> None:
    import logging
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    root = Path(root)
    losses_a, snaps = _phase(root / "run", "A", seed=0)
    if rank == 0:
        # a save killed before its commit: data files present, manifest.json absent
        shutil.copytree(root / "run" / "step-6", root / "run" / "step-8")
        (root / "run" / "step-8" / "manifest.json").unlink()
        for phase in ("B", "C"):
            shutil.copytree(root / "run", root / phase)
    dist.barrier()
    losses, _ = _phase(root / "B", "B", seed=1, load_step=-1, ref=snaps[6])
    _storage.assert_losses_continue(losses_a, losses, range(7, TOTAL + 1), _storage.TOL_SAME_WORLD,
                                    "torchtitan B (2 ranks)")
    if _storage.shrink_to_one(port_c):
        losses, _ = _phase(root / "C", "C", seed=1, load_step=4, ref=snaps[4])
        _storage.assert_losses_continue(losses_a, losses, range(5, TOTAL + 1), _storage.TOL_OTHER_WORLD,
                                        "torchtitan C (1 rank)")


def run(root: Path) -> None:
    _storage.spawn(worker, str(root))
    for step in (2, 4, 6):
        _storage.assert_nvme_checkpoint(root / "run" / f"step-{step}")


if __name__ == "__main__":
    import tempfile
    import time

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dcpnvme_torchtitan_") as d:
        run(Path(d))
    print(f"torchtitan scenario OK ({time.time() - t0:.1f}s)")
