"""One read request, prepared and finished: where each byte lands and its check.

Under O_DIRECT the aligned bulk of every host destination whose address is congruent with its
file offset is read straight into it; the rest (edges, scratch, other destinations, device
memory) into a bounce buffer, copied out after every checksum block has been verified. A
container no larger than ``block_size`` is read buffered (``read_buffered_if_small``)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.host_io import (
    IOV_MAX,
    BouncePool,
    check_length,
    clip_views,
    copy_bytes,
    dio_alignment,
    memory_at,
    open_for_reading,
)
from dcp_nvme.engines.requests import SCRATCH, ReadRequest, Segment, plan_read_segments
from dcp_nvme.format.checksums import check_host
from dcp_nvme.format.container import align_down, align_up

log = logging.getLogger(__name__)


_warned_read_memory: set[str] = set()
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def read_buffered_if_small(fd: int, direct: bool, block_size: int) -> bool:
    """Whether reads of the open container ``fd`` stay O_DIRECT: one no larger than
    ``block_size`` has its O_DIRECT flag cleared (``F_SETFL``), and is read buffered."""
    if not direct or os.fstat(fd).st_size > block_size:
        return direct
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
    return False


@dataclass
class ReadSource:
    """A container open for reading: its fd, whether O_DIRECT is on, and the alignment a span
    read straight into destination memory needs (1 when buffered)."""

    path: str
    fd: int
    direct: bool
    align: int
    zero_copy: bool = True
    """False once O_DIRECT refused destination memory: every later read of the file bounces."""

    @classmethod
    def open(cls, path: str, config: IOConfig) -> ReadSource:
        fd, direct = open_for_reading(path, config)
        try:
            direct = read_buffered_if_small(fd, direct, config.block_size)  # one request: cached
            dio = dio_alignment(fd) if direct else None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, direct, dio.span if dio else 1)

    def refused_direct_memory(self, exc: OSError, prepared: PreparedRead) -> bool:
        """Whether O_DIRECT refused a read into destination memory (EINVAL: the reported
        alignment was not enough); if so this read and every later one of the file bounce
        through page-aligned buffers, as writes do (``ContainerWrite.refused_direct_memory``)."""
        if not self.direct or exc.errno != errno.EINVAL or not prepared.direct_bytes:
            return False  # a buffered read, or one bounced already: a real error
        if self.path not in _warned_read_memory:
            _warned_read_memory.add(self.path)
            log.warning("dcp_nvme: O_DIRECT refused a read into tensor memory aligned to %d for %s; "
                        "bouncing every read of this file", self.align, self.path)
        self.zero_copy = False
        return True


@dataclass(frozen=True)
class PreparedRead:
    """A request ready to read from file offset ``lo``: ``spans`` of host memory in file order
    (destination memory, or the bounce buffer ``buffer``, -1: none taken)."""

    request: ReadRequest
    lo: int
    segments: list[Segment]
    spans: list[tuple[int, int]]
    buffer: int
    copied: int
    """Bytes to copy out of the bounce buffer into destinations once read."""
    direct_bytes: int
    """Bytes read straight into destination memory."""


def read_range(request: ReadRequest, direct: bool) -> tuple[int, int]:
    """The file bytes a request reads: rounded out to pages under O_DIRECT."""
    end = request.file_offset + request.length
    return (align_down(request.file_offset), align_up(end)) if direct else (request.file_offset, end)


def prepare_read(request: ReadRequest, source: ReadSource, addresses: Sequence[int | None],
                 pool: BouncePool, take: Callable[[], int]) -> PreparedRead:
    """Plan one request's read (``engines.requests.plan_read_segments``) into host destinations
    (``addresses``: each destination's, None for device memory) and the bounce buffer ``take()``
    hands out, taken only when something bounces."""
    lo, hi = read_range(request, source.direct)
    if hi - lo > pool.size:
        raise ValueError(f"read request of {hi - lo} bytes exceeds the {pool.size}-byte buffer")
    pieces = [(length, None if dest == SCRATCH or (address := addresses[dest]) is None or not source.zero_copy
               else address + dest_offset) for dest, dest_offset, length in request.pieces]
    segments = plan_read_segments(request.file_offset, pieces, lo, hi, source.align, max_segments=IOV_MAX)
    bounced = [s for s in segments if s.address is None]
    index = take() if bounced else -1
    base = pool.buffers[index].data_ptr() if index >= 0 else 0
    spans = [(s.address, s.length) if s.address is not None else (base + s.offset, s.length)
             for s in segments]
    copied = sum(p.length for s in bounced for p in s.pieces
                 if p.source < len(request.pieces) and request.pieces[p.source][0] != SCRATCH)
    return PreparedRead(request, lo, segments, spans, index, copied, hi - lo - sum(s.length for s in bounced))


def finish_read(prepared: PreparedRead, got: int, pool: BouncePool, dests: Sequence[torch.Tensor]) -> None:
    """A request's bytes landed (``got`` of them from ``prepared.lo``): its length and block
    crcs checked across the direct and bounced spans in file order, then the bounced pieces
    copied out of the bounce buffer to their destinations."""
    request = prepared.request
    check_length(request, prepared.lo + got)
    views = clip_views([memory_at(a, n) for a, n in prepared.spans], request.file_offset - prepared.lo,
                        request.length)
    check_host(request.file, request.file_offset, request.checks, views)
    if prepared.buffer < 0:
        return
    buffer = pool.buffers[prepared.buffer]
    for segment in prepared.segments:
        if segment.address is not None:
            continue
        for piece in segment.pieces:
            if piece.source == len(request.pieces):
                continue  # the O_DIRECT rounding
            dest, dest_offset, _ = request.pieces[piece.source]
            if dest != SCRATCH:
                start = dest_offset + piece.src_offset
                copy_bytes(dests[dest][start : start + piece.length],
                           buffer[piece.dst_offset : piece.dst_offset + piece.length])
