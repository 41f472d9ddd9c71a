"""Helpers shared by the trainer integrations (no trainer imports here).

Storage objects are built through small factories so that a caller (or a
test) can swap dcp_nvme's NVMeWriter/NVMeReader/NVMeStager for anything that
implements the DCP StorageWriter/StorageReader/AsyncStager protocols.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from dcp_nvme.storage.run_dir import DCP, committed_kind

PathLike = str | os.PathLike
WriterFactory = Callable[[PathLike], Any]
ReaderFactory = Callable[[PathLike], Any]
StagerFactory = Callable[[], Any]


def nvme_writer(path: PathLike, **kwargs: Any):
    from dcp_nvme import NVMeWriter

    kwargs.setdefault("overwrite", True)
    return NVMeWriter(path, **kwargs)


def nvme_reader(path: PathLike, **kwargs: Any):
    from dcp_nvme import NVMeReader

    return NVMeReader(path, **kwargs)


def nvme_stager():
    from dcp_nvme import NVMeStager

    return NVMeStager()


def make_reader(path: PathLike, reader_factory: ReaderFactory | None = None):
    """Reader for ``path``: the given factory, else torch's FileSystemReader for a plain DCP
    checkpoint (``.metadata``, no ``manifest.json``), else NVMeReader."""
    if reader_factory is not None:
        return reader_factory(path)
    if committed_kind(path) == DCP:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(os.fspath(path))
    return nvme_reader(path)


def make_writer(path: PathLike, writer_factory: WriterFactory | None = None):
    return writer_factory(path) if writer_factory is not None else nvme_writer(path)


def make_stager(stager_factory: StagerFactory | None = None):
    return stager_factory() if stager_factory is not None else nvme_stager()


def wait_future(fut: Any) -> None:
    """Block on what dcp.async_save returned (Future or AsyncSaveResponse)."""
    if fut is None:
        return
    upload = getattr(fut, "upload_completion", None)
    (upload if upload is not None else fut).result()
