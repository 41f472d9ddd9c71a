"""The bench's data: its options, one measured row, and the exception a row raises to skip."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


class Skip(Exception):
    """A row that cannot run here; the message says why and lands in the report."""


@dataclass
class BenchOptions:
    size: int = 512 << 20
    ranks: int = 1
    directory: str = "."
    optim: bool = False
    queue_depth: int | None = None
    block_size: int | None = None
    direct_io: bool | None = None
    node_queue_depth: int | None = None
    node_write_order: str | None = None
    repeat: int = 1
    quick: bool = False
    keep: bool = False
    progress: bool = True
    seed: int = 0


@dataclass
class Row:
    """One measured line of the report."""

    key: str
    label: str
    op: str  # write | read | copy | reshard
    role: str  # ours | peer | limit | floor
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    """Set when the row raised (single-rank runs carry on; the report shows the error)."""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.median / 1e9 if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.update(median_seconds=round(self.median, 6), gbps=round(self.gbps, 4),
                   seconds=[round(s, 6) for s in self.seconds])
        return doc
