"""FSDP2 (fully_shard + DCP state_dict helpers) scenario for examples/fsdp2_train.py.

    python integration/fsdp2_scenario.py

One spawn of 2 ranks (see dcp_nvme_harness/scenarios.py): A trains 8 steps with async saves every 3 steps (step-3,
step-6) as the uninterrupted run, then a save "killed" before its commit is left behind as
step-9 (rank files without manifest.json); B (2 ranks) and C (1 rank) each start from a fresh
model, resume from the newest committed step (6, not 9), check model + optimizer state == the
state when step 6 was saved, and train 7..8 with A's losses.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from dcp_nvme_harness import scenarios as _storage


def _example():
    """examples/fsdp2_train.py, the script users read, loaded by its path."""
    path = _storage.REPO_ROOT / "examples" / "fsdp2_train.py"
    spec = importlib.util.spec_from_file_location("fsdp2_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

STEPS, SAVE_EVERY, RESUME_AT = 8, 3, 6


def _resume_and_check(rank: int, root: Path, ref: dict, ref_losses: dict, tol: float, what: str) -> None:
    fsdp2_train = _example()

    seen = {}

    def on_resume(step, model, opt):
        seen["step"] = step
        got = _storage.full_state(model, opt)
        if rank == 0:
            _storage.assert_same_state(ref, got, f"{what} resumed state")

    losses = fsdp2_train.train(root, STEPS, SAVE_EVERY, seed=1, on_resume=on_resume)
    assert seen.get("step") == RESUME_AT, f"{what}: resumed from {seen.get('step')}, expected {RESUME_AT}"
    _storage.assert_losses_continue(ref_losses, losses, range(RESUME_AT + 1, STEPS + 1), tol, what)


def worker(rank: int, port_c: int, root: str) -> None:
    fsdp2_train = _example()
    import torch.distributed as dist

    root = Path(root)
    run = root / "run"
    snaps = {}

    def on_save(step, model, opt):
        snaps[step] = _storage.full_state(model, opt)

    losses_a = fsdp2_train.train(run, STEPS, SAVE_EVERY, seed=0, on_save=on_save)
    assert sorted(losses_a) == list(range(1, STEPS + 1))
    if rank == 0:
        # a save killed before its commit: the data files exist, manifest.json does not
        shutil.copytree(run / f"step-{RESUME_AT}", run / "step-9")
        (run / "step-9" / "manifest.json").unlink()
    dist.barrier()
    # B and C each resume from a copy: B's own saves must not change what C sees
    for phase in ("B", "C"):
        if rank == 0:
            shutil.copytree(run, root / phase)
    dist.barrier()
    _resume_and_check(rank, root / "B", snaps[RESUME_AT], losses_a, _storage.TOL_SAME_WORLD, "fsdp2 B (2 ranks)")
    if _storage.shrink_to_one(port_c):
        _resume_and_check(0, root / "C", snaps[RESUME_AT], losses_a, _storage.TOL_OTHER_WORLD, "fsdp2 C (1 rank)")


def run(root: Path) -> None:
    _storage.spawn(worker, str(root))
    for step in (3, 6):
        _storage.assert_nvme_checkpoint(root / "run" / f"step-{step}")
    # B resumed at 2 ranks and saved no new multiple of 3 beyond 6; C's resume wrote nothing new
    assert not (root / "run" / "step-9" / "manifest.json").exists()


if __name__ == "__main__":
    import tempfile
    import time

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dcpnvme_fsdp2_") as d:
        run(Path(d))
    print(f"fsdp2 scenario OK ({time.time() - t0:.1f}s)")
