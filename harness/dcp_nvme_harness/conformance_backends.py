"""The storage layers the conformance suite compares: DCP's stock file system classes and ours.

Every conformance case runs once per backend; a case that passes for ``stock`` and fails for
``nvme`` is an incompatibility. The only knob a case may set is ``overwrite``; everything
else is each class's default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_nvme import NVMeReader, NVMeWriter


@dataclass(frozen=True)
class Backend:
    name: str
    writer_class: type
    reader_class: type

    def writer(self, path: str | os.PathLike, overwrite: bool | None = None) -> StorageWriter:
        """A writer for ``path``; ``overwrite=None`` keeps the class's own default."""
        kwargs: dict[str, Any] = {} if overwrite is None else {"overwrite": overwrite}
        return self.writer_class(path, **kwargs)

    def reader(self, path: str | os.PathLike, trusted: bool = False) -> StorageReader:
        """A reader for ``path``; ``trusted`` opts in to full pickle for non-tensor items where
        the class asks for it (ours: ``allow_pickle=True``; the stock reader always unpickles)."""
        if trusted and self.name == "nvme":
            return self.reader_class(path, allow_pickle=True)
        return self.reader_class(path)


STOCK = Backend("stock", FileSystemWriter, FileSystemReader)
NVME = Backend("nvme", NVMeWriter, NVMeReader)
BACKENDS = {b.name: b for b in (STOCK, NVME)}


def full_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same values on every rank and every run, derived from the name."""
    generator = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(shape))
    values = torch.randn(shape, generator=generator)
    if dtype.is_floating_point or dtype.is_complex:
        return values.to(dtype)
    return (values * 100).to(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) if a.numel() else True


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert bitwise_equal(actual, expected), (
        f"{what}: {actual.dtype}{tuple(actual.shape)} differs from the saved "
        f"{expected.dtype}{tuple(expected.shape)}")
