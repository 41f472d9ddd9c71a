"""``list``: the checkpoints under a run directory, newest first, from their small files only."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dcp_nvme.format.container import DCP_METADATA, MANIFEST, save_key_of
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.storage.run_dir import parse_step
from dcp_nvme.tiers import drain_state
from dcp_nvme.tiers.coded import decoded_view
from dcp_nvme.tools.status import INCOMPLETE, NOT_A_CHECKPOINT, checkpoint_state


@dataclass
class CheckpointEntry:
    path: str
    name: str
    step: int | None
    state: str
    reason: str
    bytes: int
    """Bytes of every file in the directory (what it costs on disk)."""
    ranks: int | None
    created_unix: float
    tier: Any = None
    """The checkpoint's drain state (``dcp_nvme.tiers``)."""

    @property
    def ok(self) -> bool:
        return self.state == "committed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _looks_like_checkpoint(path: Path) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return MANIFEST in names or DCP_METADATA in names or any(save_key_of(n) for n in names)


def _empty_step(path: Path) -> bool:
    """A step directory with no checkpoint file in it: a save killed before its first file."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return parse_step(path.name) is not None and all(n.startswith(".") for n in names)  # a lock at most


def _tier_state(path: str) -> Any:
    try:
        state = drain_state(path)
    except Exception as exc:  # a tier problem must not hide the checkpoint list
        return f"unknown ({exc})"
    return getattr(state, "value", state)


def describe(path: str | os.PathLike) -> CheckpointEntry:
    """One checkpoint directory as a list row."""
    root = Path(path)
    source = decoded_view(LocalStore(root))  # a compressed mirror reads as its plain files
    found = checkpoint_state(source)
    total = 0
    newest = 0.0
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False):
            stat = entry.stat(follow_symlinks=False)
            total += stat.st_size
            newest = max(newest, stat.st_mtime)
    ranks = None
    created = newest
    if found.manifest is not None:
        ranks = found.manifest.doc.get("world_size")
        created = float(found.manifest.doc.get("created_unix") or newest)
    elif found.data_files:
        ranks = len(found.data_files)
    state, reason = found.state, found.reason
    if state == NOT_A_CHECKPOINT and _empty_step(root):
        state, reason = INCOMPLETE, (f"{root} is an empty step directory: a save there stopped (or was killed) "
                                     "before it wrote a file; the next save of this step writes it, or remove it")
    return CheckpointEntry(str(root), root.name, parse_step(root.name), state, reason,
                           total, ranks, created, _tier_state(str(root)))


def describe_remote(step: Any) -> CheckpointEntry:
    """One step of a remote run (``storage.remote_run.RemoteStep``) as a list row: its state as
    a local one's, from its small files; its tier ``remote`` (it is the object store's copy)."""
    found = checkpoint_state(decoded_view(step.store))
    ranks, created = None, 0.0
    if found.manifest is not None:
        ranks = found.manifest.doc.get("world_size")
        created = found.manifest.created_unix or 0.0
    elif found.data_files:
        ranks = len(found.data_files)
    return CheckpointEntry(step.url, step.name, step.step, found.state, found.reason, step.bytes, ranks,
                           created, "remote")


def list_remote(url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointEntry]:
    """The steps of the run at ``url`` (an fsspec URL), or the checkpoint ``url`` itself, newest
    first, as :func:`list_checkpoints` orders them."""
    from dcp_nvme.storage.fsspec_dir import FsspecStore
    from dcp_nvme.storage.remote_run import listed_step, remote_steps

    itself = listed_step(FsspecStore(url, storage_options))
    if itself.committed:
        return [describe_remote(itself)]
    steps = remote_steps(url, fs=itself.store.fs)
    if steps is None:
        raise FileNotFoundError(f"{url} holds nothing (no such bucket or prefix, or the storage options "
                                "point at another store)")
    entries = [describe_remote(s) for s in steps if _looks_like_checkpoint_names(s.names)]
    return _newest_first(entries)


def _looks_like_checkpoint_names(names: Any) -> bool:
    return MANIFEST in names or DCP_METADATA in names or any(save_key_of(n) for n in names)


def _newest_first(entries: list[CheckpointEntry]) -> list[CheckpointEntry]:
    if entries and all(e.step is not None for e in entries):
        entries.sort(key=lambda e: (e.step, e.created_unix), reverse=True)
    else:
        entries.sort(key=lambda e: e.created_unix, reverse=True)
    return entries


def list_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointEntry]:
    """Checkpoints in ``run_dir`` (or ``run_dir`` itself if it is one), newest first.

    Newest means highest step when every name carries one, else latest creation time.
    """
    root = Path(run_dir)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    if _looks_like_checkpoint(root):
        candidates = [root]
    else:
        candidates = sorted(p for p in root.iterdir()
                            if p.is_dir() and (_looks_like_checkpoint(p) or _empty_step(p)))
    return _newest_first([describe(p) for p in candidates])
