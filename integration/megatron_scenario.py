"""Megatron-Core dist_checkpointing scenario (CPU + gloo).

    python integration/megatron_scenario.py

A tiny 2-layer MLP, tensor-parallel by hand (W1 split by rows, W2 by columns, partial outputs
all-reduced), Adam per shard. Model and optimizer state are described with Megatron
``ShardedTensor``s (global offsets), an RNG-like ``ShardedObject`` per rank and common (rank-0)
data, and checkpointed with ``megatron.core.dist_checkpointing.save/load`` through the
strategies that ``dcp_nvme.integrations.megatron.install`` sets up. Plain CPU + gloo, no shim of
any CUDA call. One spawn of 2 ranks:

  A  2 ranks: 8 iterations; sync save at iter 2 through Megatron's
     ``FullyParallelSaveStrategyWrapper`` (the replicated ``optim.step`` is saved by whichever
     rank the wrapper picks), async save at iter 4 whose ``AsyncRequest`` is finalized with
     ``execute_sync()`` after iter 6 (iters 5-6 overlap the upload).
  B  2 ranks, fresh tensors, no ``install()``: the newest committed iter (4) comes from
     ``dcp_nvme.latest``; Megatron picks the load strategy from its ``metadata.json``;
     state == snapshot, losses 5..8 == A.
  C  1 rank: the same, resharded 2 -> 1 by global offsets (without the per-rank ShardedObject,
     as Megatron-LM's --no-load-rng).

Then ``megatron_tools_check.py`` runs Megatron's own tools in a fresh process that only imports
``dcp_nvme.integrations.megatron`` (see there).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from dcp_nvme_harness import scenarios as _storage

TOTAL = 8
DIN, HID, BATCH = 16, 32, 8


def _phase(root: Path, phase: str, seed: int, ref: dict | None = None) -> tuple[dict, dict]:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    import dcp_nvme
    from dcp_nvme.integrations import megatron as nv

    rank, world = dist.get_rank(), dist.get_world_size()
    save_strategy = None
    if ref is None:  # only the saving phase calls install(); loads rely on the import alone
        context: dict = {}  # Megatron-LM's checkpointing_context
        nv.install(context)
        save_strategy = context["save_strategy"]
        assert isinstance(save_strategy, nv.NVMeSaveShardedStrategy)
    torch.manual_seed(seed)
    full_w1 = torch.randn(HID, DIN) * 0.3
    full_w2 = torch.randn(1, HID) * 0.3
    part = HID // world
    sl = slice(rank * part, (rank + 1) * part)
    w1 = torch.nn.Parameter(full_w1[sl].clone())
    w2 = torch.nn.Parameter(full_w2[:, sl].clone())
    opt = torch.optim.Adam([w1, w2], lr=1e-2)
    for p in (w1, w2):  # materialise Adam's state so that it can be described and loaded into
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    opt.param_groups[0]["lr"] = 1e-2
    opt.zero_grad(set_to_none=True)
    for p in (w1, w2):
        opt.state[p]["step"].zero_()

    def sharded_sd(it: int) -> dict:
        def w1_sh(key, t):
            return ShardedTensor.from_rank_offsets(key, t, (0, rank, world))

        def w2_sh(key, t):
            return ShardedTensor.from_rank_offsets(key, t, (1, rank, world))

        s1, s2 = opt.state[w1], opt.state[w2]
        return {
            "model": {"w1": w1_sh("model.w1", w1.data), "w2": w2_sh("model.w2", w2.data)},
            "optimizer": {
                "w1": {"exp_avg": w1_sh("optim.w1.exp_avg", s1["exp_avg"]),
                       "exp_avg_sq": w1_sh("optim.w1.exp_avg_sq", s1["exp_avg_sq"])},
                "w2": {"exp_avg": w2_sh("optim.w2.exp_avg", s2["exp_avg"]),
                       "exp_avg_sq": w2_sh("optim.w2.exp_avg_sq", s2["exp_avg_sq"])},
                # replicated scalar: main replica on rank 0
                "step": ShardedTensor.from_rank_offsets("optim.step", s1["step"].reshape(1).clone(),
                                                        replica_id=rank),
            },
            "rank_info": ShardedObject("rank_info", {"rank": rank, "it": it}, (world,), (rank,)),
            "iteration": it,  # common state (rank 0's copy)
        }

    def full_state() -> dict:
        def gather(t, dim):
            out = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(out, t.contiguous())
            return torch.cat(out, dim=dim)

        s1, s2 = opt.state[w1], opt.state[w2]
        return {
            "w1": gather(w1.data, 0), "w2": gather(w2.data, 1),
            "w1.exp_avg": gather(s1["exp_avg"], 0), "w1.exp_avg_sq": gather(s1["exp_avg_sq"], 0),
            "w2.exp_avg": gather(s2["exp_avg"], 1), "w2.exp_avg_sq": gather(s2["exp_avg_sq"], 1),
            "step": s1["step"].clone(),
        }

    start = 0
    if ref is not None:
        ckpt = dcp_nvme.latest(root, extra_markers=("metadata.json",))
        assert ckpt is not None and ckpt.name == "iter_4", ckpt
        request = sharded_sd(0)
        if world != 2:
            del request["rank_info"]  # per-rank ShardedObjects do not reshard
        loaded = dist_checkpointing.load(request, str(ckpt))  # strategy picked from metadata.json
        with torch.no_grad():
            w1.copy_(loaded["model"]["w1"])
            w2.copy_(loaded["model"]["w2"])
            for p, k in ((w1, "w1"), (w2, "w2")):
                for sk in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][sk].copy_(loaded["optimizer"][k][sk])
                opt.state[p]["step"].copy_(loaded["optimizer"]["step"].reshape(()))
        start = loaded["iteration"]
        assert start == 4, start
        if world == 2:
            assert loaded["rank_info"] == {"rank": rank, "it": 4}, loaded["rank_info"]
        got = full_state()
        if rank == 0:
            _storage.assert_same_state(ref, got, f"megatron {phase} resumed state")

    pending = None  # the async save's AsyncRequest, finalized after iter 6
    losses: dict[int, float] = {}
    snaps: dict[int, dict] = {}
    for it in range(start, TOTAL):
        g = torch.Generator().manual_seed(1000 + it)
        x = torch.randn(BATCH, DIN, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        partial = torch.tanh(x @ w1.t()) @ w2.t()
        out = partial.detach().clone()
        dist.all_reduce(out)  # sum of TP partials; its backward is the identity
        out.requires_grad_(True)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        partial.backward(out.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = it + 1
        losses[done] = loss.item()
        if ref is None and done in (2, 4):
            d = root / f"iter_{done}"
            if rank == 0:
                d.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            if done == 2:
                dist_checkpointing.save(sharded_sd(done), str(d),
                                        sharded_strategy=FullyParallelSaveStrategyWrapper(save_strategy))
            else:
                pending = dist_checkpointing.save(sharded_sd(done), str(d), sharded_strategy=save_strategy,
                                                  async_sharded_save=True)
            snaps[done] = full_state()
        if done == 6 and pending is not None:
            assert not (root / "iter_4" / "metadata.json").exists()  # Megatron's commit comes last
            pending.execute_sync()
            assert (root / "iter_4" / "metadata.json").is_file()
    if save_strategy is not None:
        save_strategy.close()
    return losses, snaps


def worker(rank: int, port_c: int, root: str) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    root = Path(root)
    losses_a, snaps = _phase(root / "run", "A", seed=0)
    if rank == 0:
        for phase in ("B", "C"):
            shutil.copytree(root / "run", root / phase)
    dist.barrier()
    resumed = range(5, TOTAL + 1)
    losses, _ = _phase(root / "B", "B", seed=1, ref=snaps[4])
    _storage.assert_losses_continue(losses_a, losses, resumed, _storage.TOL_SAME_WORLD, "megatron B (2 ranks)")
    if _storage.shrink_to_one(port_c):
        losses, _ = _phase(root / "C", "C", seed=1, ref=snaps[4])
        _storage.assert_losses_continue(losses_a, losses, resumed, _storage.TOL_OTHER_WORLD, "megatron C (1 rank)")


def run(root: Path) -> None:
    import subprocess

    _storage.spawn(worker, str(root))
    for it in (2, 4):
        assert (root / "run" / f"iter_{it}" / "metadata.json").is_file()
        _storage.assert_nvme_checkpoint(root / "run" / f"iter_{it}")
    tools = Path(__file__).resolve().parent / "megatron_tools_check.py"
    subprocess.run([sys.executable, str(tools), str(root / "run" / "iter_4")], check=True, timeout=600)


if __name__ == "__main__":
    import tempfile
    import time

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dcpnvme_megatron_") as d:
        run(Path(d))
    print(f"megatron scenario OK ({time.time() - t0:.1f}s)")
