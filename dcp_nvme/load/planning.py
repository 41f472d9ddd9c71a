"""Read planning (pure): which byte ranges a tensor slice needs, and how they become requests;
the reads planned together (``Batch``); the coordinator's check that every rank loads one save.

A slice of a stored chunk is a set of contiguous runs (``slice_runs``); the runs of every item a
rank loads are sorted, merged into ``block_size`` requests and widened to whole checksum blocks
(``plan_reads``), so each block read can be verified; unwanted bytes land in a scratch piece."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.host_io import tensor_bytes
from dcp_nvme.engines.requests import SCRATCH, ReadRequest
from dcp_nvme.errors import ChecksumMismatchError, ManifestError, ShapeMismatchError
from dcp_nvme.format.checksums import items_in
from dcp_nvme.format.container import align_down, align_up, parse_dtype
from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.load.objects import bytes_for_planner

MAX_DIRECT_RUNS = 64
"""Above this many runs a slice is read as the whole rows that cover it, then narrowed."""


def _run_split(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """Index of the outermost dimension from which the slice is one contiguous run."""
    split = len(shape)
    while split > 0 and offsets[split - 1] == 0 and lengths[split - 1] == shape[split - 1]:
        split -= 1
    return max(split - 1, 0)


def count_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """How many contiguous byte runs a row-major slice touches (0 for an empty slice)."""
    if any(n == 0 for n in lengths):
        return 0
    return math.prod(lengths[: _run_split(shape, offsets, lengths)])


def slice_runs(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> list[tuple[int, int, int]]:
    """The runs of a slice of a row-major array: ``(src_byte, nbytes, packed_dst_byte)``.

    ``packed_dst_byte`` is the run's place in the slice stored contiguously in row-major order.
    """
    if len(shape) != len(offsets) or len(shape) != len(lengths):
        raise ValueError(f"rank mismatch: shape {shape}, offsets {offsets}, lengths {lengths}")
    for dim, (size, off, n) in enumerate(zip(shape, offsets, lengths)):
        if off < 0 or n < 0 or off + n > size:
            raise ValueError(f"slice [{off}, {off + n}) out of bounds for dim {dim} of {shape}")
    if count_runs(shape, offsets, lengths) == 0:
        return []
    if not shape:
        return [(0, itemsize, 0)]
    split = _run_split(shape, offsets, lengths)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    run_bytes = lengths[split] * strides[split] * itemsize
    runs: list[tuple[int, int, int]] = []
    index = [0] * split
    packed = 0
    while True:
        element = sum((offsets[d] + index[d]) * strides[d] for d in range(split))
        element += offsets[split] * strides[split]
        if runs and runs[-1][0] + runs[-1][1] == element * itemsize:
            src, n, dst = runs[-1]
            runs[-1] = (src, n + run_bytes, dst)
        else:
            runs.append((element * itemsize, run_bytes, packed))
        packed += run_bytes
        for d in reversed(range(split)):  # odometer over the outer dimensions
            index[d] += 1
            if index[d] < lengths[d]:
                break
            index[d] = 0
        else:
            return runs


def covering_rows(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """The contiguous byte range of whole dim-0 rows that holds a slice: ``(src_byte, nbytes)``."""
    if not shape:
        return 0, itemsize
    row = math.prod(shape[1:]) * itemsize
    return offsets[0] * row, lengths[0] * row


@dataclass(frozen=True)
class Need:
    """Bytes ``[file_offset, file_offset + length)`` go to ``dest`` at ``dest_offset``."""

    file_offset: int
    length: int
    dest: int
    dest_offset: int


@dataclass(frozen=True)
class FileBlocks:
    """What a reader knows about one container to plan verified reads."""

    data_start: int
    data_size: int
    block_size: int
    crcs: Sequence[int]


def _split_overlaps(needs: Sequence[Need]) -> tuple[list[Need], list[Need]]:
    """Needs that do not overlap each other, and the rest (planned in another pass)."""
    kept, deferred = [], []
    end = -1
    for need in sorted(needs, key=lambda n: (n.file_offset, n.length)):
        if need.length == 0:
            continue
        if need.file_offset < end:
            deferred.append(need)
        else:
            kept.append(need)
            end = need.file_offset + need.length
    return kept, deferred


def plan_reads(
    file: str,
    needs: Sequence[Need],
    *,
    max_request: int,
    blocks: FileBlocks | None = None,
    max_gap: int = 0,
) -> list[ReadRequest]:
    """Sort, merge and cut the needs of one file into requests of at most ``max_request`` bytes.

    With ``blocks`` every request covers whole checksum blocks (the unwanted bytes go to
    SCRATCH) and carries the checks for them. Needs closer than ``max_gap`` share a request.
    """
    kept, deferred = _split_overlaps(needs)
    if not kept:
        return []
    granule = blocks.block_size if blocks else 1
    if blocks and max_request % granule:
        raise ValueError(f"max_request {max_request} is not a multiple of {granule}")
    base = blocks.data_start if blocks else 0

    def expand(start: int, end: int) -> tuple[int, int]:
        if not blocks:
            return start, end
        if start < blocks.data_start or end > blocks.data_start + blocks.data_size:
            raise ValueError(f"range [{start}, {end}) is outside the data region of {file}")
        lo = base + align_down(start - base, granule)
        hi = min(base + align_up(end - base, granule), base + blocks.data_size)
        return lo, hi

    spans: list[list[int]] = []  # merged [start, end) ranges to read
    for need in kept:
        lo, hi = expand(need.file_offset, need.file_offset + need.length)
        if spans and lo <= spans[-1][1] + max_gap:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])

    requests: list[ReadRequest] = []
    cursor = 0  # index into kept
    for lo, hi in spans:
        start = lo
        while start < hi:
            # cut at a multiple of max_request from the block base keeps requests block-aligned
            end = min(hi, start + max_request)
            request = ReadRequest(file, start, end - start)
            position = start
            while cursor < len(kept) and kept[cursor].file_offset < end:
                need = kept[cursor]
                need_end = need.file_offset + need.length
                piece_start = max(need.file_offset, position)
                if piece_start > position:
                    request.pieces.append((SCRATCH, 0, piece_start - position))
                piece_end = min(need_end, end)
                request.pieces.append(
                    (need.dest, need.dest_offset + piece_start - need.file_offset, piece_end - piece_start)
                )
                position = piece_end
                if need_end <= end:
                    cursor += 1
                else:
                    break
            if position < end:
                request.pieces.append((SCRATCH, 0, end - position))
            if blocks:
                first = (start - base) // granule
                for index in range(first, -(-(end - base) // granule)):
                    block_lo = base + index * granule
                    block_hi = min(block_lo + granule, base + blocks.data_size)
                    request.checks.append((block_lo - start, block_hi - block_lo, blocks.crcs[index]))
            requests.append(request)
            start = end
    return requests + plan_reads(
        file, deferred, max_request=max_request, blocks=blocks, max_gap=max_gap
    )


class Batch:
    """Reads planned together: destinations, their needs, and what to do after the bytes land."""

    def __init__(self) -> None:
        self.dests: list[torch.Tensor] = []
        self.needs: dict[str, list[Need]] = {}
        self.after: list[Callable[[], None]] = []
        self.temp_bytes = 0
        self.owners: dict[str, list[tuple[int, int, str]]] = {}  # file -> (start, end, item)

    def add_dest(self, tensor: torch.Tensor) -> int:
        self.dests.append(tensor)
        return len(self.dests) - 1

    def need(self, chunk: ChunkRecord, start: int, length: int, dest: int, dest_offset: int = 0) -> None:
        if length <= 0:
            return
        self.needs.setdefault(chunk.file, []).append(Need(chunk.byte_offset + start, length, dest, dest_offset))
        self.owners.setdefault(chunk.file, []).append(
            (chunk.byte_offset, chunk.byte_offset + chunk.length, chunk.key))

    def add_item(self, item: ReadItem, chunk: ChunkRecord, planner: LoadPlanner, location: str,
                 allow_pickle: bool) -> None:
        """The byte ranges of ``item``, stored as ``chunk``, and what to do once they landed:
        DCP's ``load_bytes``, or a copy of a slice into its tensor and ``commit_tensor``."""
        if item.type == LoadItemType.BYTE_IO:
            dest = torch.empty(chunk.length, dtype=torch.uint8)
            self.need(chunk, 0, chunk.length, self.add_dest(dest))
            self.temp_bytes += chunk.length
            self.after.append(lambda: planner.load_bytes(item, bytes_for_planner(
                dest.numpy().tobytes(), item.dest_index.fqn, location, allow_pickle=allow_pickle)))
            return
        stored = parse_dtype(chunk.dtype)
        itemsize = stored.itemsize  # no tensor made: no warning for an experimental dtype
        shape, offsets, lengths = chunk.sizes, tuple(item.storage_offsets), tuple(item.lengths)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise ShapeMismatchError(f"{item.dest_index.fqn}: destination shape {tuple(target.shape)} "
                                     f"does not match the requested slice {lengths}")
        runs = count_runs(shape, offsets, lengths)

        def commit() -> None:
            planner.commit_tensor(item, target)

        if runs == 0:
            self.after.append(commit)
            return
        # device targets too: the kvikio engine reads straight into them, POSIX bounces
        direct = runs == 1 and target.is_contiguous() and target.dtype == stored
        if direct:
            (src, nbytes, _), = slice_runs(shape, offsets, lengths, itemsize)
            self.need(chunk, src, nbytes, self.add_dest(tensor_bytes(target)))
            self.after.append(commit)
            return
        if runs <= MAX_DIRECT_RUNS:
            temp = torch.empty(lengths, dtype=stored, device=target.device)
            temp_dest = self.add_dest(tensor_bytes(temp))
            for src, nbytes, dst in slice_runs(shape, offsets, lengths, itemsize):
                self.need(chunk, src, nbytes, temp_dest, dst)
            view = temp
        else:
            src, nbytes = covering_rows(shape, offsets, lengths, itemsize)
            temp = torch.empty((lengths[0], *shape[1:]), dtype=stored, device=target.device)
            self.need(chunk, src, nbytes, self.add_dest(tensor_bytes(temp)))
            view = temp
            for dim in range(1, len(shape)):
                view = view.narrow(dim, offsets[dim], lengths[dim])
        self.temp_bytes += temp.numel() * itemsize

        def copy_then_commit() -> None:
            target.copy_(view)
            commit()

        self.after.append(copy_then_commit)

    def requests(self, files: Mapping[str, FileRecord], config: IOConfig,
                 where: Callable[[FileRecord], str]) -> tuple[list[ReadRequest], int]:
        """The batch's requests, each read from ``where(record)`` of its file, and the largest
        request size they were cut to."""
        requests, largest = [], config.block_size
        for name, needs in self.needs.items():
            record = files[name]  # read_manifest checked that every row's file is listed
            blocks, max_request = None, config.block_size
            if config.verify:
                blocks = FileBlocks(record.data_start, record.data_size, record.checksum_block, record.crcs)
                # whole checksum blocks per request, as close to block_size as they allow
                granule = record.checksum_block
                max_request = max(granule, max_request // granule * granule)
                largest = max(largest, max_request)
            requests += plan_reads(where(record), needs, max_request=max_request, blocks=blocks)
        return requests, largest

    def items_in(self, exc: ChecksumMismatchError) -> str:
        """The items of this batch the damaged range of ``exc`` holds, for its message."""
        name = os.path.basename(exc.path)
        hits = items_in(self.owners.get(name, []), exc.start, exc.end)
        return ", ".join(hits) if hits else "none of the requested items (a neighbouring block)"


def check_one_save(plans: list[LoadPlan]) -> None:
    """The coordinator: every rank loads the same save (a restart that took each node's newest
    step would load one model from two steps); else an error naming what each rank read."""
    ranks: dict[tuple[str, str], list[str]] = {}
    for rank, tag in enumerate(plan.storage_data for plan in plans):
        if isinstance(tag, tuple) and len(tag) == 3:
            ranks.setdefault((tag[0], tag[1]), []).append(f"{rank} (node {tag[2]})")
    if len({key for key, _ in ranks}) <= 1:
        return
    held = "; ".join(f"{path} (save {key}) on ranks {', '.join(who[:8])}{' ...' if len(who) > 8 else ''}"
                     for (key, path), who in ranks.items())
    raise ManifestError(f"the ranks are loading different saves, which would make one model of several steps: "
                        f"{held}. Load one step on every rank: dcp_nvme.latest(run, agree=True) on every rank "
                        "picks the newest step every node can load")
