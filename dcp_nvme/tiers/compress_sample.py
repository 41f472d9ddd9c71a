"""Whether compression pays: a sample spread across the checkpoint, coded and timed, against
the link the drain sends over (``compress="auto"``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from dcp_nvme.format.pieces import Piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.tiers.encoder import DEPTH, Encoder, Window, chunks_in, regions
from dcp_nvme.tiers.source import DrainSource

SAMPLE = 8 << 20
"""Bytes ``auto`` codes to measure the codec on this machine."""


SAMPLE_WINDOW = 1 << 20
"""``auto`` codes its sample in windows this long, spread over the checkpoint (rounded up to
whole checksum blocks)."""


MIN_SPEEDUP = 1.02
"""``auto`` codes only when that makes the drain at least this much sooner."""


@dataclass(frozen=True)
class Measure:
    """The codec on a sample of this checkpoint: decoded bytes per second and ratio."""

    throughput: float
    ratio: float


def pays(measure: Measure, link: float | None) -> tuple[bool, str]:
    """Whether coding a file while sending it finishes sooner than sending it plain.

    The drain sends coded pieces while later ones are coded, so time per byte is the slower
    stage: max(1/E, 1/(r*L)) against 1/L plain (E codec throughput, r ratio, L the link's
    bytes/s: the bandwidth cap or ``link_rate``); it must be at least ``MIN_SPEEDUP`` sooner
    (a ratio of 1.00001x is not worth the CPU). Without a known link the drain sends plain
    (say ``compress="bytegroup"`` to force it).
    """
    figures = f"codec {measure.throughput / 1e6:.0f} MB/s at {measure.ratio:.2f}x"
    if not link:
        return False, f"{figures}; link speed unknown (set bandwidth or link_rate): sending plain"
    coded = max(1 / measure.throughput, 1 / (measure.ratio * link))
    if coded * MIN_SPEEDUP <= 1 / link:
        return True, f"{figures} beats the {link / 1e6:.0f} MB/s link ({1 / link / coded:.2f}x sooner)"
    return False, f"{figures} does not beat the {link / 1e6:.0f} MB/s link: sending plain"


@dataclass(frozen=True)
class SamplePick:
    """One window of a checkpoint ``auto`` codes: ``length`` bytes of ``file`` at ``offset``."""

    file: str
    offset: int
    length: int


def plan_sample(records: Sequence[FileRecord], budget: int = SAMPLE,
                window: int = SAMPLE_WINDOW) -> list[SamplePick]:
    """Where ``auto`` samples a checkpoint, at most ``budget`` bytes in windows of ``window``
    (whole checksum blocks), each inside a file's data region and aligned on its blocks (read
    and verified on its own). A checkpoint of ``budget`` bytes or less is sampled whole; a
    larger one in windows centred on the middles of equal stretches of its files' data taken
    end to end, so each file gets its share by size. Pure and deterministic."""
    spans = [r for r in records if r.size > r.data_start]
    total = sum(r.data_size for r in spans)
    if total <= budget:
        return [SamplePick(r.name, at, min(step, r.size - at)) for r in spans
                for step in [_blocks(window, r.checksum_block)] for at in range(r.data_start, r.size, step)]
    unit = max(_blocks(window, r.checksum_block) for r in spans)
    count = max(1, budget // unit)
    picks: list[SamplePick] = []
    for i in range(count):
        spot = (2 * i + 1) * total // (2 * count)
        for record in spans:
            if spot < record.data_size:
                break
            spot -= record.data_size
        length = min(record.data_size, _blocks(window, record.checksum_block))
        start = min(max(0, spot - length // 2), record.data_size - length)
        start -= start % record.checksum_block
        pick = SamplePick(record.name, record.data_start + start, length)
        if pick not in picks:
            picks.append(pick)
    return picks


def _blocks(length: int, block: int) -> int:
    """``length`` rounded up to whole checksum blocks."""
    return max(1, -(-length // block)) * block


def measure(source: DrainSource, encoder: Encoder, picks: Sequence[SamplePick] | None = None) -> Measure:
    """Code a sample of the checkpoint (``plan_sample``'s windows unless ``picks`` are given),
    each window read and checked like a drained piece; the aggregate ratio and the wall-clock
    throughput of coding them all on the encoder's threads."""
    if picks is None:
        picks = plan_sample([source.files[name] for name in source.manifest.file_names])
    windows: list[Window] = []
    for pick in picks:
        record = source.files[pick.file]
        piece = Piece(0, pick.offset, pick.length)
        windows.append((source.piece(record, piece), chunks_in(regions(source.manifest, pick.file), piece),
                        pick.offset, None))
    sampled = sum(len(data) for data, *_ in windows)
    if not sampled:
        return Measure(float("inf"), 1.0)  # nothing to code: no data, nothing to gain
    started = time.perf_counter()
    stored = sum(len(s) for coded in encoder.code_windows(windows, depth=max(DEPTH, len(windows)))
                 for s, _ in coded)
    seconds = max(time.perf_counter() - started, 1e-9)
    return Measure(sampled / seconds, sampled / (stored or 1))
