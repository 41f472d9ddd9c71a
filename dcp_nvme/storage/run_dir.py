"""The checkpoints of a run directory: which are committed, their steps, the newest.

One home for "find the checkpoints of a run", used by the integrations, retention, listing
and status. Pure directory inspection: no manifest is parsed and no data is read.

A checkpoint is a real directory (never a symlink) directly under the run directory that holds
a regular-file commit marker: ``manifest.json`` (dcp_nvme) or ``.metadata`` (DCP's
FileSystemWriter). Steps are read from the usual names: ``step_N``, ``step-N``, ``stepN``,
``global_stepN``, Lightning's ``epoch=E-step=N`` (``.ckpt`` suffix allowed), Megatron's ``iter_NNNNNNN``,
``checkpoint-N`` and a bare ``N``.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dcp_nvme.errors import InvalidInputError

NVME_MARKER = "manifest.json"
"""dcp_nvme's commit marker: renamed into place last, so its presence means committed."""
DCP_MARKER = ".metadata"
"""The commit marker of DCP's FileSystemWriter (a plain DCP checkpoint)."""

NVME = "nvme"
DCP = "dcp"
_MARKERS = {NVME: NVME_MARKER, DCP: DCP_MARKER}

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


@dataclass(frozen=True)
class CheckpointDir:
    """A committed checkpoint directory of a run."""

    path: Path
    step: int | None
    kind: str
    """``"nvme"`` (dcp_nvme's format) or ``"dcp"`` (DCP's FileSystemWriter)."""
    committed_ns: int
    """When its commit marker was written (mtime, ns): the order when names carry no step."""

    @property
    def name(self) -> str:
        return self.path.name


def _regular_file(path: str) -> os.stat_result | None:
    """lstat of ``path`` when it is a regular file (not a link, FIFO or device), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def committed_kind(path: str | os.PathLike, kinds: Iterable[str] = (NVME, DCP)) -> str | None:
    """``"nvme"``/``"dcp"`` when ``path`` is a real directory holding that commit marker."""
    path = os.fspath(path)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    for kind in kinds:
        if _regular_file(os.path.join(path, _MARKERS[kind])) is not None:
            return kind
    return None


def checkpoints(
    run_dir: str | os.PathLike[str],
    *,
    kinds: Iterable[str] = (NVME, DCP),
    extra_markers: Iterable[str] = (),
) -> list[CheckpointDir]:
    """Committed checkpoints directly under ``run_dir``, oldest first, newest last.

    Newest means the highest step when every checkpoint's name carries one (ties by commit
    time), else the latest commit. Symlinked entries are never followed, so a ``latest`` link
    can neither be counted twice nor lead outside the run directory. ``extra_markers`` are
    names that must also exist in a checkpoint (e.g. Megatron's ``metadata.json``). A missing
    ``run_dir`` has no checkpoints.
    """
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in _MARKERS]
    if unknown:
        raise InvalidInputError(f"unknown checkpoint kind(s) {unknown}; expected some of {sorted(_MARKERS)}")
    extra_markers = tuple(extra_markers)
    try:
        entries = list(os.scandir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        kind = committed_kind(entry.path, kinds)
        if kind is None:
            continue
        if any(not os.path.exists(os.path.join(entry.path, m)) for m in extra_markers):
            continue
        marker = _regular_file(os.path.join(entry.path, _MARKERS[kind]))
        if marker is None:  # removed between the two looks
            continue
        found.append(CheckpointDir(Path(entry.path), parse_step(entry.name), kind, marker.st_mtime_ns))
    if found and all(c.step is not None for c in found):
        found.sort(key=lambda c: (c.step, c.committed_ns, c.name))
    else:
        found.sort(key=lambda c: (c.committed_ns, c.name))
    return found


def latest(
    run_dir: str | os.PathLike[str],
    *,
    kinds: Iterable[str] = (NVME,),
    extra_markers: Iterable[str] = (),
) -> Path | None:
    """The newest committed dcp_nvme checkpoint under ``run_dir`` (see :func:`checkpoints`), or
    None: one ``NVMeReader`` loads. A stock DCP checkpoint in the same run is passed over unless
    ``kinds`` names ``"dcp"`` too (``checkpoints()`` lists both, each with its ``kind``)."""
    found = checkpoints(run_dir, kinds=kinds, extra_markers=extra_markers)
    return found[-1].path if found else None
