"""The training step in a checkpoint directory's name (``storage.run_dir`` and
``storage.remote_run`` order a run's steps by it), and the walk both take down a run's steps."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

_STEP_PATTERNS = (
    re.compile(r"^(?:.*[_\-=.])?step[_\-=.]?(\d+)$", re.IGNORECASE),  # step_1, step-1, epoch=0-step=5
    re.compile(r"^(?:iter|iteration|checkpoint|ckpt|epoch)[_\-=.]?(\d+)$", re.IGNORECASE),
    re.compile(r"^(?:global_)?step(\d+)$", re.IGNORECASE),
    re.compile(r"^(\d+)$"),
)
_LIGHTNING_SUFFIX = ".ckpt"  # Lightning's ModelCheckpoint names directories epoch=E-step=N.ckpt


def parse_step(name: str) -> int | None:
    """The training step in a checkpoint directory's name, or None when it names none.

    >>> [parse_step(n) for n in ("step_1000", "epoch=2-step=30.ckpt", "iter_0000500", "final")]
    [1000, 30, 500, None]
    """
    name = name.removesuffix(_LIGHTNING_SUFFIX)
    for pattern in _STEP_PATTERNS:
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def first_loadable(candidates: Iterable[T], problem: Callable[[T], str | None], where: Callable[[T], str],
                   step: Callable[[T], int | None], run: str, stacklevel: int) -> T | None:
    """The first of ``candidates`` (newest first) with no ``problem``; each one before it is
    passed over with a warning naming it, why, and the command that shows the run's states."""
    for candidate in candidates:
        why = problem(candidate)
        if why is None:
            return candidate
        at = "" if step(candidate) is None else f" (step {step(candidate)})"
        warnings.warn(f"dcp_nvme.latest: {where(candidate)}{at} is committed but cannot load, so it is passed "
                      f"over: {why}. `dcp-nvme list {run}` shows its state", stacklevel=stacklevel + 1)
    return None
