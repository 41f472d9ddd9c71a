"""Retention of the fast tier: keep the newest K committed checkpoints of a run directory.

A checkpoint is removed only when all of these hold (docs/tiers.md, "Retention"):

- it is a real directory directly inside the run directory holding a committed
  ``manifest.json`` (``dcp_nvme.storage.run_dir.checkpoints``: symlinks, such as a ``latest`` link,
  are never followed, counted or removed, and nothing outside the run directory is touched);
- it is not among the newest ``keep_last`` whose manifest reads back valid (never the newest
  loadable one: ``keep_last >= 1``; a broken directory with a higher step does not count);
- its drain state is ``mirrored`` (the drainer confirmed every file on the target) to a
  target that is not the checkpoint itself or inside it, and that target's committed manifest
  is still this save's (a mirror replaced since, e.g. by another step drained onto the same URL,
  or unreachable now, keeps the local copy);
- no save holds its save lock (an overwrite in progress).

Replicas a node holds of other nodes' files (``peers.replicate``) live inside the step's
directory (``.replicas/``), so they go with it, and only once the mirror holds every node's
files (a node-local drain commits its mirror after every node's marker): a step that is only
replicated is kept, so no removal takes the last protected copy.

A checkpoint whose manifest or drain state cannot be read is kept and reported; it never stops
retention of the others. A removal deletes ``manifest.json`` first, so a crash half-way
leaves an uncommitted directory, never a damaged committed one.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Any

from dcp_nvme.errors import InvalidInputError
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.manifest import MAX_MANIFEST, read_manifest
from dcp_nvme.storage.fsspec_dir import open_store
from dcp_nvme.storage.local_dir import LocalStore, is_local_path, local_path
from dcp_nvme.storage.run_dir import NVME, checkpoints
from dcp_nvme.storage.save_lock import read_holder, stale_reason
from dcp_nvme.tiers.coded import same_save
from dcp_nvme.tiers.journal import MIRRORED, drain_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionDecision:
    path: str
    keep: bool
    reason: str


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _mirror_problem(path: str, target: str, storage_options: dict[str, Any] | None) -> str | None:
    """Why the target cannot be shown to hold the save committed at ``path`` now, or None."""
    try:
        local = LocalStore(path).read(MANIFEST, MAX_MANIFEST)
        remote = open_store(target, storage_options).read(MANIFEST, MAX_MANIFEST)
    except Exception as exc:  # noqa: BLE001  unreachable, gone, not a file: not confirmed
        return f"its mirror {target} cannot be confirmed now ({exc.__class__.__name__}: {exc})"
    if remote != local and not same_save(remote, local):
        return f"its mirror {target} no longer holds this save (it was replaced since the drain)"
    return None


def _judge_old(path: str, storage_options: dict[str, Any] | None = None) -> RetentionDecision:
    """An old checkpoint: removable only when its mirror holds it and no save is writing it."""
    try:
        state = drain_state(path)
    except Exception as exc:  # a broken sibling is kept, never fatal to the others
        return RetentionDecision(path, True, f"its drain state is unreadable ({exc.__class__.__name__}: {exc})")
    if state.state != MIRRORED:
        return RetentionDecision(path, True, f"not drained yet ({state})")
    target = state.target or ""
    if is_local_path(target) and _inside(os.path.realpath(local_path(target)), os.path.realpath(path)):
        return RetentionDecision(path, True, f"its mirror {target} is the checkpoint itself")
    try:
        holder = read_holder(path)
    except ValueError:
        return RetentionDecision(path, True, "its save lock is unreadable (a save may be in progress)")
    if holder is not None and stale_reason(holder) is None:
        return RetentionDecision(path, True, f"a save is writing it ({holder.describe()})")
    problem = _mirror_problem(path, target, storage_options)
    if problem is not None:
        return RetentionDecision(path, True, problem)
    return RetentionDecision(path, False, f"mirrored to {target}")


def _unreadable(path: str) -> str | None:
    """Why ``path``'s manifest does not read back as a valid checkpoint, or None."""
    try:
        read_manifest(LocalStore(path), path)
    except Exception as exc:  # whatever is wrong with it, it is kept and does not count as newest
        return f"{exc.__class__.__name__}: {exc}"
    return None


def plan_retention(run_dir: str | os.PathLike, keep_last: int, *,
                   storage_options: dict[str, Any] | None = None) -> list[RetentionDecision]:
    """What :func:`apply_retention` would do, oldest checkpoint first. ``storage_options``:
    how to reach the mirrors (to confirm each still holds its save)."""
    if keep_last < 1:
        raise InvalidInputError(f"keep_last must be >= 1, got {keep_last}")
    found = [os.fspath(c.path) for c in checkpoints(run_dir, kinds=(NVME,))]
    broken = {path: why for path in found if (why := _unreadable(path)) is not None}
    newest = set([path for path in found if path not in broken][-keep_last:])
    decisions = []
    for path in found:
        if path in broken:
            decisions.append(RetentionDecision(path, True, f"its manifest is unreadable ({broken[path]})"))
        elif path in newest:
            decisions.append(RetentionDecision(path, True, f"among the newest {keep_last}"))
        else:
            decisions.append(_judge_old(path, storage_options))
    return decisions


def _still_removable(run_dir: str, path: str) -> bool:
    """Just before deleting: still a real directory directly inside the run directory."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    return parent == os.path.realpath(run_dir)


def apply_retention(run_dir: str | os.PathLike, keep_last: int, *,
                    storage_options: dict[str, Any] | None = None) -> list[str]:
    """Remove mirrored checkpoints older than the newest ``keep_last``; returns those removed."""
    run_dir = os.fspath(run_dir)
    removed = []
    for decision in plan_retention(run_dir, keep_last, storage_options=storage_options):
        if decision.keep:
            if not decision.reason.startswith("among the newest"):
                log.info("dcp_nvme: retention keeps %s: %s", decision.path, decision.reason)
            continue
        if not _still_removable(run_dir, decision.path):
            log.warning("dcp_nvme: retention skips %s: no longer a directory of %s",
                        decision.path, run_dir)
            continue
        os.unlink(os.path.join(decision.path, MANIFEST))  # uncommit first
        shutil.rmtree(decision.path)  # never follows links inside (fd-based on Linux)
        log.info("dcp_nvme: retention removed %s (%s)", decision.path, decision.reason)
        removed.append(decision.path)
    return removed
