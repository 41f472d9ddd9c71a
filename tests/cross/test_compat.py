"""The torch names dcp_nvme relies on beyond torch's public promise (``dcp_nvme.compat``) exist
in the installed torch, and the package reaches torch's private names only through that list."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcp_nvme import compat

PACKAGE = Path(__file__).resolve().parents[2] / "dcp_nvme"


def test_every_listed_name_resolves_in_the_installed_torch():
    for name in (*compat.PRIVATE_NAMES, *compat.RELIED_ON):
        assert compat.resolve(name) is not None, name
    assert compat.dcp_version() == compat.resolve("torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION")
    failure = CheckpointException("save failed", {0: ValueError("disk full")})
    assert isinstance(failure.failures[0], ValueError)
    planner = DefaultLoadPlanner()
    assert "state_dict" in DefaultLoadPlanner.set_up_planner.__code__.co_names or hasattr(planner, "state_dict")


def test_the_installed_torch_is_in_the_tested_range():
    installed = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    oldest, newest = (tuple(int(p) for p in v.split(".")) for v in compat.TESTED_TORCH)
    assert oldest <= installed <= newest, f"torch {torch.__version__} is outside {compat.TESTED_TORCH}"
    assert compat.MIN_TORCH == compat.TESTED_TORCH[0]
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert f'"torch>={compat.MIN_TORCH}"' in pyproject


def test_private_torch_names_are_reached_only_through_compat():
    """A ``from torch... import _name`` or an import of a name this list holds as private, anywhere
    but compat.py, would be a dependency on torch internals that nobody tracks."""
    private = {name.rsplit(".", 1)[1] for name in compat.PRIVATE_NAMES if name.rsplit(".", 1)[1].startswith("_")}
    private_modules = {"torch.distributed.checkpoint.filesystem"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                for alias in node.names:
                    if (alias.name.startswith("_") or alias.name in private
                            or (node.module in private_modules and alias.name == "CURRENT_DCP_VERSION")):
                        found.append(f"{path.relative_to(PACKAGE)}: from {node.module} import {alias.name}")
    assert not found, found


def test_the_stager_keeps_a_tensors_shard_fields():
    """torch 2.14 saves a plain tensor that carries global_shape/global_offsets/local_offsets/
    local_sizes as a shard of a larger tensor (``CheckpointableTensor``); NVMeStager's staged
    copy must carry them, or the save would record the shard as a whole tensor."""
    from dcp_nvme import NVMeStager
    from dcp_nvme.save.arena import SHARD_FIELDS

    shard = torch.arange(8, dtype=torch.float32)
    fields = ((16,), ((8,),), ((0,),), ((8,),))
    for name, value in zip(SHARD_FIELDS, fields):
        setattr(shard, name, value)
    stager = NVMeStager()
    for _ in range(2):  # the second stage reuses the arena
        staged = stager.stage({"w": shard, "plain": torch.ones(4)}).result()
        assert torch.equal(staged["w"], shard) and staged["w"].data_ptr() != shard.data_ptr()
        assert tuple(getattr(staged["w"], name) for name in SHARD_FIELDS) == fields
        assert not any(hasattr(staged["plain"], name) for name in SHARD_FIELDS)
    stager.close()


def test_a_hook_run_before_the_thread_pools_stop_can_still_use_a_pool():
    """The one private Python name: a hook registered through it runs at exit while a thread
    pool still takes work (an atexit hook would get "cannot schedule new futures")."""
    code = """
from concurrent.futures import ThreadPoolExecutor
from dcp_nvme.compat import run_before_thread_pools_stop
pool = ThreadPoolExecutor(1)
def hook():
    print("ran", pool.submit(lambda: 6 * 7).result(), flush=True)
assert run_before_thread_pools_stop(hook)
"""
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0 and "ran 42" in done.stdout, done.stdout + done.stderr
