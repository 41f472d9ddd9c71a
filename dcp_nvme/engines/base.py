"""The engine protocol: how bytes move between memory and one file. Knows nothing of DCP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.requests import IOStats, ReadRequest

if TYPE_CHECKING:
    import torch


@dataclass
class FileWriteResult:
    """A written and fsynced container: its size and the crc32c of every checksum block."""

    path: str
    size: int
    data_start: int
    checksum_block: int
    crcs: list[int]
    header_crc: int
    stats: IOStats = field(repr=False)


class Engine(Protocol):
    """Moves bytes with at most ``queue_depth`` requests of ``block_size`` bytes in flight."""

    name: str

    def write_file(
        self, path: str, header: bytes, sources: Sequence[torch.Tensor], checksum_block: int
    ) -> FileWriteResult:
        """Write ``header`` then the sources (flat uint8 tensors) back to back; fsync; return crcs."""
        ...

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats:
        """Run the requests into the destination tensors (flat uint8), verifying their checks."""
        ...

    def close(self) -> None:
        """Free buffers and threads; the engine may be used again afterwards."""
        ...


class PicklesAsConfig:
    """Engines travel (DCP's PROCESS executor pickles the writer) as their config only: buffers,
    threads and device state belong to one process and are made again on the other side."""

    config: IOConfig

    if TYPE_CHECKING:
        def __init__(self, config: IOConfig) -> None: ...  # what every engine's __init__ takes

    def __getstate__(self) -> dict:
        return {"config": self.config}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["config"])
