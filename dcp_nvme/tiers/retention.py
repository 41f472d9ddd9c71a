"""Retention of the fast tier: keep the newest K committed checkpoints of a run directory.

Only checkpoints whose drain state is ``mirrored`` are ever removed: one that is local,
draining, failed or uncommitted stays whatever its age. A removal deletes ``manifest.json``
first, so a crash half-way leaves an uncommitted directory, never a damaged committed one.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

from ..manifest import MANIFEST
from .state import MIRRORED, drain_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionDecision:
    path: str
    keep: bool
    reason: str


def committed_checkpoints(run_dir: str | os.PathLike) -> list[str]:
    """Committed checkpoint directories directly under ``run_dir``, oldest commit first."""
    found = []
    for entry in os.scandir(run_dir):
        manifest = os.path.join(entry.path, MANIFEST)
        if entry.is_dir() and os.path.isfile(manifest):
            found.append((os.stat(manifest).st_mtime_ns, entry.name, entry.path))
    return [path for _, _, path in sorted(found)]


def plan_retention(run_dir: str | os.PathLike, keep_last: int) -> list[RetentionDecision]:
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    checkpoints = committed_checkpoints(run_dir)
    newest = set(checkpoints[-keep_last:])
    decisions = []
    for path in checkpoints:
        if path in newest:
            decisions.append(RetentionDecision(path, True, f"among the newest {keep_last}"))
            continue
        state = drain_state(path)
        if state.state != MIRRORED:
            decisions.append(RetentionDecision(path, True, f"not drained yet ({state})"))
        else:
            decisions.append(RetentionDecision(path, False, f"mirrored to {state.target}"))
    return decisions


def apply_retention(run_dir: str | os.PathLike, keep_last: int) -> list[str]:
    """Remove mirrored checkpoints older than the newest ``keep_last``; returns those removed."""
    removed = []
    for decision in plan_retention(run_dir, keep_last):
        if decision.keep:
            if "not drained" in decision.reason:
                log.info("dcp_nvme: retention keeps %s: %s", decision.path, decision.reason)
            continue
        os.unlink(os.path.join(decision.path, MANIFEST))  # uncommit first
        shutil.rmtree(decision.path)
        log.info("dcp_nvme: retention removed %s (%s)", decision.path, decision.reason)
        removed.append(decision.path)
    return removed
