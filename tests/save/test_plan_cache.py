"""Saves with DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) on 2 real gloo
ranks: the second and third saves gather no plans, and each still commits under its own key
(a new directory, then an overwrite of the first), every checkpoint loading byte for byte."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.format.container import save_key_of


class RecordingWriter(NVMeWriter):
    """Records, on the coordinator, what each save's gathered plans held."""

    gathered: list

    def prepare_global_plan(self, plans):
        self.gathered = getattr(self, "gathered", []) + [[(p.usable, len(p.items)) for p in plans]]
        return super().prepare_global_plan(plans)


def _state(rank: int, step: int) -> dict:
    return {f"rank{rank}": torch.arange(1000, dtype=torch.float32) * (rank + 1) + step,
            "shared": torch.arange(16, dtype=torch.int64)}


def _keys(directory: str) -> set:
    return {save_key_of(n) for n in os.listdir(directory) if save_key_of(n)}


def _cached_saves(rank: int, world: int, root: str) -> None:
    writer = RecordingWriter(os.path.join(root, "a"), overwrite=True)
    paths = [os.path.join(root, name) for name in ("a", "b", "a")]
    keys = []
    for step, path in enumerate(paths):
        state = _state(rank, step)  # same shapes: the plans do not change, the data does
        dcp.save(state, storage_writer=writer, checkpoint_id=path,
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        dist.barrier()
        with open(os.path.join(path, "manifest.json")) as f:
            keys.append(json.load(f)["save_key"])
        assert _keys(path) == {keys[-1]}, (step, _keys(path))  # no file under another key
        out = {name: torch.zeros_like(t) for name, t in state.items()}
        out = {k: v for k, v in out.items() if k in (f"rank{rank}", "shared")}
        dcp.load(out, storage_reader=NVMeReader(path))
        for name, tensor in out.items():
            assert torch.equal(tensor, state[name]), (step, name)
        dist.barrier()
    assert len(set(keys)) == 3, keys
    if rank == 0:
        first, *later = writer.gathered
        assert all(usable and items for usable, items in first)
        for plans in later:  # nothing changed: every rank sent an empty, unusable plan
            assert plans == [(False, 0)] * world, plans


def test_plan_caching_gathers_no_plans_and_commits_each_save(tmp_path):
    run_ranks(2, _cached_saves, str(tmp_path))
