"""The engine protocol's read half over fsspec (``s3://``, ``gs://``, any URL).

Each ``ReadRequest`` is one ranged GET (``cat_file(path, start, end)``), ``queue_depth`` of them
in flight, checked against the request's crc32c blocks before its bytes reach a destination.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import numpy as np
import torch

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.host_io import check_length
from dcp_nvme.engines.requests import SCRATCH, IOStats, ReadRequest, run_bounded
from dcp_nvme.format.checksums import check_host


class FsspecEngine:
    """Ranged reads over fsspec into destination tensors, ``queue_depth`` requests in flight.

    ``request.file`` is a path inside ``fs`` (what ``FsspecStore.path`` returns). Every request
    is checked against its crc32c blocks (``ReadRequest.checks``) before any byte is copied out.
    """

    name = "fsspec"

    def __init__(self, fs, config: IOConfig) -> None:
        self.fs = fs
        self.config = config

    def write_file(self, path, header, sources, checksum_block):  # noqa: ANN001
        raise NotImplementedError("the fsspec tier is written by the drain (dcp_nvme.tiers), "
                                  "not by NVMeWriter; save locally with mirror=URL")

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats:
        stats = IOStats("read")
        started = time.perf_counter()

        def run(request: ReadRequest) -> None:
            begun = stats.begin()
            data = self.fs.cat_file(request.file, start=request.file_offset,
                                    end=request.file_offset + request.length)
            stats.end(begun, len(data), len(data))
            deliver(request, data, dests)

        run_bounded(self.config.queue_depth, requests, run, "dcp-nvme-fsspec")
        stats.seconds = time.perf_counter() - started
        return stats

    def close(self) -> None:
        pass


def deliver(request: ReadRequest, data: bytes | bytearray | memoryview, dests: Sequence[torch.Tensor]) -> None:
    """Check one whole-request read (length, then crc32c) and scatter its pieces to ``dests``."""
    check_length(request, request.file_offset + len(data))
    check_host(request.file, request.file_offset, request.checks, [memoryview(data)])
    source = np.frombuffer(data, dtype=np.uint8)
    position = 0
    for dest, dest_offset, length in request.pieces:
        if dest != SCRATCH and length:
            _copy_into(dests[dest], dest_offset, source, position, length)
        position += length


def _copy_into(dest: torch.Tensor, offset: int, source: np.ndarray, position: int, length: int) -> None:
    if dest.device.type == "cpu":
        ctypes.memmove(dest.data_ptr() + offset, source.ctypes.data + position, length)
    else:  # device memory: one host tensor per piece, copied by torch
        dest[offset : offset + length].copy_(torch.from_numpy(source[position : position + length].copy()))
