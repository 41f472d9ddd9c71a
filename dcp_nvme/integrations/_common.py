"""Helpers shared by the trainer integrations (no trainer imports here).

Storage objects are built through small factories so that a caller (or a
test) can swap dcp_nvme's NVMeWriter/NVMeReader/NVMeStager for anything that
implements the DCP StorageWriter/StorageReader/AsyncStager protocols.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

PathLike = str | os.PathLike
WriterFactory = Callable[[PathLike], Any]
ReaderFactory = Callable[[PathLike], Any]
StagerFactory = Callable[[], Any]

#: dcp_nvme's commit marker: a checkpoint is complete iff this file exists.
NVME_COMMIT_MARKER = "manifest.json"
#: commit marker of torch's FileSystemWriter (plain DCP checkpoints).
DCP_COMMIT_MARKER = ".metadata"


def nvme_writer(path: PathLike, **kwargs: Any):
    from dcp_nvme import NVMeWriter

    kwargs.setdefault("overwrite", True)
    return NVMeWriter(path, **kwargs)


def nvme_reader(path: PathLike):
    from dcp_nvme import NVMeReader

    return NVMeReader(path)


def nvme_stager():
    from dcp_nvme import NVMeStager

    return NVMeStager()


def is_committed(path: PathLike) -> bool:
    """True if ``path`` holds a complete dcp_nvme or plain-DCP checkpoint."""
    p = Path(path)
    return (p / NVME_COMMIT_MARKER).is_file() or (p / DCP_COMMIT_MARKER).is_file()


def make_reader(path: PathLike, reader_factory: ReaderFactory | None = None):
    """Reader for ``path``: the given factory, else NVMeReader for dcp_nvme
    checkpoints, else torch's FileSystemReader for plain DCP checkpoints."""
    if reader_factory is not None:
        return reader_factory(path)
    p = Path(path)
    if not (p / NVME_COMMIT_MARKER).is_file() and (p / DCP_COMMIT_MARKER).is_file():
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(str(p))
    return nvme_reader(path)


def make_writer(path: PathLike, writer_factory: WriterFactory | None = None):
    return writer_factory(path) if writer_factory is not None else nvme_writer(path)


def make_stager(stager_factory: StagerFactory | None = None):
    return stager_factory() if stager_factory is not None else nvme_stager()


def find_latest_checkpoint(
    root: PathLike,
    pattern: str = r"^step-(\d+)$",
    extra_markers: tuple = (),
) -> Path | None:
    """Newest committed checkpoint directory under ``root``.

    Directories are matched by ``pattern`` (its first group is the step) and
    only count when :func:`is_committed` holds and every name in
    ``extra_markers`` exists in them (e.g. Megatron's ``metadata.json``).
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple | None = None
    rx = re.compile(pattern)
    for child in root.iterdir():
        m = rx.search(child.name)
        if not m or not child.is_dir() or not is_committed(child):
            continue
        if any(not (child / e).exists() for e in extra_markers):
            continue
        step = int(m.group(1))
        if best is None or step > best[0]:
            best = (step, child)
    return None if best is None else best[1]


def wait_future(fut: Any) -> None:
    """Block on what dcp.async_save returned (Future or AsyncSaveResponse)."""
    if fut is None:
        return
    upload = getattr(fut, "upload_completion", None)
    (upload if upload is not None else fut).result()
