"""Retention deletes only real, committed, mirrored, old checkpoints of the run directory
(docs/tiers.md, "Retention"): never through a symlink, never outside the run directory, never the
newest, never an unconfirmed mirror or one mirrored onto itself, never while a save writes it;
a broken sibling never stops it. Real saves, real drains to a second directory."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.storage import save_lock as savelock
from dcp_nvme.tiers import MIRRORED, DrainOptions, apply_retention, drain, drain_state, plan_retention
from dcp_nvme.tiers.journal import JOURNAL

OPTIONS = DrainOptions(retries=0, backoff=0.01)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5000, generator=g), "step": torch.tensor([seed])}


def save(path, seed: int) -> str:
    dcp.save(state(seed), storage_writer=NVMeWriter(str(path)), no_dist=True)
    return str(path)


def assert_loads(path, seed: int) -> None:
    out = {"w": torch.zeros(5000), "step": torch.zeros(1, dtype=torch.int64)}
    dcp.load(out, storage_reader=NVMeReader(str(path)), no_dist=True)
    expected = state(seed)
    assert torch.equal(out["w"].view(torch.uint8), expected["w"].view(torch.uint8))
    assert torch.equal(out["step"], expected["step"])


def mirrored_run(tmp_path, steps) -> tuple:
    run, pfs = tmp_path / "run", tmp_path / "pfs"
    paths = {}
    for step in steps:
        paths[step] = save(run / f"step_{step}", step)
        drain(paths[step], str(pfs / f"step_{step}"), options=OPTIONS)
        assert drain_state(paths[step]).state == MIRRORED
    return run, paths


def test_links_outside_paths_and_broken_siblings_are_never_followed_or_fatal(tmp_path):
    run, paths = mirrored_run(tmp_path, [2, 3, 4])
    # links a user or a trainer leaves in a run directory, to the newest and to outside
    os.symlink(paths[4], run / "latest")
    os.symlink("step_4", run / "best")
    outside = save(tmp_path / "elsewhere" / "step_1", 1)
    drain(outside, str(tmp_path / "pfs-elsewhere" / "step_1"), options=OPTIONS)
    os.symlink(outside, run / "step_0")  # a link with a checkpoint's name, oldest by step
    # broken siblings: a manifest holding null, one holding garbage
    for name, content in (("step_5", b"null"), ("step_6", b"{not json")):
        (run / name).mkdir()
        (run / name / MANIFEST).write_bytes(content)

    decisions = {os.path.basename(d.path): d for d in plan_retention(run, keep_last=1)}
    assert set(decisions) == {"step_2", "step_3", "step_4", "step_5", "step_6"}  # no link
    for broken in ("step_5", "step_6"):  # kept, and not counted as the newest
        assert decisions[broken].keep and "manifest is unreadable" in decisions[broken].reason
    assert decisions["step_4"].keep and "among the newest" in decisions["step_4"].reason
    removed = apply_retention(run, keep_last=1)
    assert sorted(removed) == sorted([paths[2], paths[3]])
    assert sorted(os.listdir(run)) == ["best", "latest", "step_0", "step_4", "step_5", "step_6"]
    assert_loads(paths[4], 4)
    assert (run / "step_5" / MANIFEST).read_bytes() == b"null"  # the broken ones untouched
    assert_loads(outside, 1)  # nothing outside the run directory was touched
    assert os.path.islink(run / "latest") and os.path.islink(run / "step_0")


def test_newest_kept_and_latest_link_never_costs_its_manifest(tmp_path):
    run, paths = mirrored_run(tmp_path, [1, 2, 3])
    os.symlink(paths[3], run / "latest")
    os.symlink(paths[3], run / "zzz-any-link-name")  # sorts after every step: still not a checkpoint
    removed = apply_retention(run, keep_last=1)
    assert sorted(removed) == sorted([paths[1], paths[2]])
    assert_loads(paths[3], 3)
    assert_loads(run / "latest", 3)
    assert apply_retention(run, keep_last=1) == []  # the newest is never removed, even mirrored


def test_unconfirmed_self_mirror_and_locked_checkpoints_are_kept(tmp_path):
    run, paths = mirrored_run(tmp_path, [1, 2, 3, 4])
    # step_1: its journal claims a mirror onto the checkpoint itself (the drain(ck, ck) bug)
    journal_path = os.path.join(paths[1], JOURNAL)
    journal = json.loads(open(journal_path).read())
    journal["target"] = paths[1]
    with open(journal_path, "w") as handle:
        json.dump(journal, handle)
    # step_2: never drained (its journal is gone)
    os.unlink(os.path.join(paths[2], JOURNAL))
    # step_3: an overwrite is writing it right now
    lock = savelock.acquire(paths[3], "0badc0de")
    decisions = {os.path.basename(d.path): d for d in plan_retention(run, keep_last=1)}
    assert decisions["step_2"].keep and "not drained" in decisions["step_2"].reason
    assert decisions["step_3"].keep and "a save is writing it" in decisions["step_3"].reason
    if drain_state(paths[1]).state == MIRRORED:  # where state.py still trusts such a journal
        assert decisions["step_1"].keep and "the checkpoint itself" in decisions["step_1"].reason
    assert decisions["step_1"].keep
    assert apply_retention(run, keep_last=1) == []
    lock.release()
    assert apply_retention(run, keep_last=1) == [paths[3]]  # once the save is over
    for step in (1, 2, 4):
        assert_loads(paths[step], step)


def test_a_mirror_replaced_or_unreachable_since_its_drain_keeps_the_local_copy(tmp_path):
    """The journal says mirrored, but the target now holds another save (another step written
    over the same URL by other means), or is gone: retention must not trust the journal alone."""
    run, pfs = tmp_path / "run", tmp_path / "pfs"
    for step in (1, 2, 3):
        save(run / f"step_{step}", step)
    drain(str(run / "step_1"), str(pfs / "a"), options=OPTIONS)
    drain(str(run / "step_2"), str(pfs / "b"), options=OPTIONS)
    drain(str(run / "step_3"), str(pfs / "other"), options=OPTIONS)
    for name in os.listdir(pfs / "other"):  # step 3's mirror copied over step 1's
        (pfs / "a" / name).write_bytes((pfs / "other" / name).read_bytes())
    os.rename(pfs / "b", pfs / "b.gone")  # step 2's mirror is gone
    assert drain_state(run / "step_1").state == MIRRORED == drain_state(run / "step_2").state
    decisions = {os.path.basename(d.path): d for d in plan_retention(run, keep_last=1)}
    assert decisions["step_1"].keep and "no longer holds this save" in decisions["step_1"].reason
    assert decisions["step_2"].keep and "cannot be confirmed now" in decisions["step_2"].reason
    assert apply_retention(run, keep_last=1) == []
    assert_loads(run / "step_1", 1)
    assert_loads(run / "step_2", 2)
    os.rename(pfs / "b.gone", pfs / "b")  # reachable and right again: removable
    assert apply_retention(run, keep_last=1) == [str(run / "step_2")]
