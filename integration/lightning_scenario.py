"""Lightning (Trainer + NVMeModelParallelStrategy on FSDP2, CPU + gloo) checkpoint scenario.

    python integration/lightning_scenario.py

One spawn of 2 ranks (see dcp_nvme_harness/scenarios.py):
  A  2 ranks: train 8 steps; ``trainer.save_checkpoint`` at step 2 (sync) and step 4 (async:
     training goes on while the upload runs); the run ends normally and is the uninterrupted
     reference.
  B  2 ranks, Lightning's own ``ModelCheckpoint(every_n_train_steps=2, save_last=True)`` with
     async saves by default: a run stopped at step 4 leaves ``epoch=0-step=4.ckpt`` (step 2's
     was removed through the strategy, save_top_k=1) and ``last.ckpt``; a fresh Trainer/module
     (other init seed) resumes with ``ckpt_path="last"``: model, optimizer, lr scheduler and
     global step == A's step-4 snapshot; steps 5..8 reproduce A's losses.
  C  1 rank: resumes from ``dcp_nvme.latest`` of a copy of A's checkpoints (step-4), resharding
     2 -> 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dcp_nvme_harness import scenarios as _storage

STEPS, RESUME_AT, GLOBAL_BATCH, DIM = 8, 4, 8, 16


def _fit(ckpt_dir: Path, phase: str, seed: int, ref: dict | None = None, *, ckpt_path: str | Path | None = None,
         max_steps: int = STEPS, model_checkpoint: bool = False) -> tuple[dict, dict]:
    """One Trainer.fit; returns (losses by step, snapshots by saved step). ``model_checkpoint``:
    Lightning's ModelCheckpoint saves (async) instead of explicit ``save_checkpoint`` calls."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.fsdp import fully_shard

    from dcp_nvme.integrations.lightning import NVMeModelParallelStrategy

    world = dist.get_world_size()
    losses: dict[int, float] = {}
    snaps: dict[int, dict] = {}

    def snapshot(trainer, module) -> dict:
        snap = _storage.full_state(module, trainer.optimizers[0])
        snap["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        snap["global_step"] = trainer.global_step
        return snap

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            # data depend only on the global step -> identical across resumes and world sizes
            g = torch.Generator().manual_seed(1000 + self.global_step)
            x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
            y = x.sum(dim=1, keepdim=True).sin()
            r, n = dist.get_rank(), dist.get_world_size()
            per = GLOBAL_BATCH // n
            loss = torch.nn.functional.mse_loss(self.net(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[self.global_step + 1] = mean.item() / n
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(1000)), batch_size=1)

    class Checkpoints(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if ref is None and step in (2, RESUME_AT):
                if not model_checkpoint:
                    trainer.save_checkpoint(ckpt_dir / f"step-{step}",
                                            storage_options={"async_save": step == RESUME_AT})
                snaps[step] = snapshot(trainer, pl_module)
                if step == RESUME_AT:
                    from dcp_nvme import NVMeStager

                    assert isinstance(trainer.strategy._nvme_stager, NVMeStager), trainer.strategy._nvme_stager

        def on_train_start(self, trainer, pl_module):
            if ref is not None:
                got = snapshot(trainer, pl_module)
                if dist.get_rank() == 0:
                    _storage.assert_same_state(ref, got, f"lightning {phase} resumed state")

    callbacks: list = [Checkpoints()]
    if model_checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_last=True))
    strategy = NVMeModelParallelStrategy(
        data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo",
        async_save=model_checkpoint)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_steps=max_steps,
        logger=False, enable_checkpointing=model_checkpoint, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, use_distributed_sampler=False,
    )
    trainer.fit(Net(), ckpt_path=ckpt_path)
    return losses, snaps


def worker(rank: int, port_c: int, root: str) -> None:
    import logging
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    root = Path(root)
    import dcp_nvme

    losses_a, snaps = _fit(root / "run", "A", seed=0)
    assert sorted(losses_a) == list(range(1, STEPS + 1)), sorted(losses_a)
    if rank == 0:
        shutil.copytree(root / "run", root / "C")
    dist.barrier()
    resumed = range(RESUME_AT + 1, STEPS + 1)

    # B: ModelCheckpoint. A run stopped at RESUME_AT, then a resume from "last".
    _fit(root / "B", "B stopped", seed=0, max_steps=RESUME_AT, model_checkpoint=True)
    if rank == 0:
        names = sorted(p.name for p in (root / "B").iterdir())
        assert names == [f"epoch=0-step={RESUME_AT}.ckpt", "last.ckpt"], names
        for name in names:
            _storage.assert_nvme_checkpoint(root / "B" / name)
    dist.barrier()
    losses, _ = _fit(root / "B", "B", seed=1, ref=snaps[RESUME_AT], ckpt_path="last", model_checkpoint=True)
    _storage.assert_losses_continue(losses_a, losses, resumed, _storage.TOL_SAME_WORLD, "lightning B (2 ranks)")

    if _storage.shrink_to_one(port_c):
        ckpt = dcp_nvme.latest(root / "C")
        assert ckpt is not None and ckpt.name == f"step-{RESUME_AT}", ckpt
        losses, _ = _fit(root / "C", "C", seed=1, ref=snaps[RESUME_AT], ckpt_path=ckpt)
        _storage.assert_losses_continue(losses_a, losses, resumed, _storage.TOL_OTHER_WORLD, "lightning C (1 rank)")


def run(root: Path) -> None:
    _storage.spawn(worker, str(root))
    for step in (2, RESUME_AT):
        _storage.assert_nvme_checkpoint(root / "run" / f"step-{step}")


if __name__ == "__main__":
    import tempfile
    import time

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dcpnvme_lightning_") as d:
        run(Path(d))
    print(f"lightning scenario OK ({time.time() - t0:.1f}s)")
