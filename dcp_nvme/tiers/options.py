"""How a drain behaves (``DrainOptions``): apart from the drain's code, so the parts of the drain
that take options import them without importing the drain."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_nvme.config import COMPRESS_MODES
from dcp_nvme.errors import InvalidInputError
from dcp_nvme.tiers.codec import DEFAULT_LEVEL

MiB = 1 << 20

VERIFY_MODES = ("sent", "readback")


@dataclass(frozen=True)
class DrainOptions:
    """How a drain behaves. Defaults suit a shared network: 4 transfers, 64 MiB pieces, no cap.

    max_transfers: pieces in flight at once (across files).
    part_size: bytes per piece (multipart part on S3; at least 5 MiB there, and larger for a
        file that would need more than S3's 10,000 parts). A file whose transfer an interrupted
        drain began keeps the part size it was planned with.
    bandwidth: bytes/s cap for the whole drain (token bucket), None for no cap.
    verify: "sent" checks every piece's bytes against the blocks table before sending it;
        "readback" also reads every byte back from the target and checks it.
    retries: attempts after the first before the drain is marked failed.
    backoff, backoff_max: seconds of the first wait between attempts, and the cap (doubling).
    """

    max_transfers: int = 4
    part_size: int = 64 * MiB
    bandwidth: float | None = None
    verify: str = "sent"
    retries: int = 5
    backoff: float = 2.0
    backoff_max: float = 60.0
    compress: str = "off"
    """"off", "bytegroup" (send byte-grouped .dcz files), or "auto" (bytegroup when the codec,
    measured on a sample, makes the drain finish sooner over a link of ``bandwidth`` or
    ``link_rate`` bytes/s). See docs/tiers.md."""
    level: int = DEFAULT_LEVEL
    codec_threads: int | None = None
    """Threads coding for the drain (None: half the cores, at most 2)."""
    link_rate: float | None = None
    """The link's bytes/s for ``auto`` when no ``bandwidth`` cap says it."""
    delta_every: int = 8
    """``compress="delta"``: a full checkpoint at least every this many (the chain a load reads)."""
    node_wait: float = 3600.0
    """A node-local checkpoint: seconds a node's drain waits, its own files sent, for the other
    nodes' drains before the mirror commits (each node drains the files on its own disk)."""
    node_silence: float = 600.0
    """A node-local checkpoint: while a node's drain runs it writes a heartbeat on the target; a
    node waiting for another node's files gives up (an error naming it, not retried) when that
    node's heartbeat has not changed for this many seconds: it died, or its drain of this save
    ended without its files (or has not begun: it is still draining an earlier save)."""

    def __post_init__(self) -> None:
        if self.compress not in COMPRESS_MODES:
            raise InvalidInputError(f"compress must be one of {COMPRESS_MODES}, got {self.compress!r}")
        if self.delta_every < 1:
            raise InvalidInputError(f"delta_every must be >= 1, got {self.delta_every}")
        if self.codec_threads is not None and self.codec_threads < 1:
            raise InvalidInputError(f"codec_threads must be >= 1, got {self.codec_threads}")
        if self.verify not in VERIFY_MODES:
            raise InvalidInputError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.max_transfers < 1:
            raise InvalidInputError(f"max_transfers must be >= 1, got {self.max_transfers}")
        if self.part_size < 1:
            raise InvalidInputError(f"part_size must be >= 1, got {self.part_size}")
        if self.retries < 0:
            raise InvalidInputError(f"retries must be >= 0, got {self.retries}")
        if not self.node_wait > 0:
            raise InvalidInputError(f"node_wait must be > 0 seconds, got {self.node_wait}")
        if not self.node_silence > 0:
            raise InvalidInputError(f"node_silence must be > 0 seconds, got {self.node_silence}")

