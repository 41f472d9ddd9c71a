"""Every I/O knob in one place: its default, its environment override, its tuned value.

Precedence, highest first: an explicit argument, an environment variable, the file written by
``dcp-nvme tune``, the built-in default. Built-in defaults were measured on the development
machine (ext4 on a virtual NVMe drive, fio O_DIRECT sequential write 2.0-2.6 GB/s at 1-16 MiB
requests and 2-16 in flight, buffered write + fsync 0.63 GB/s): 8 MiB requests, 8 in flight,
O_DIRECT on.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment of the data region, of O_DIRECT buffers, offsets and lengths."""

MAX_CHECKSUM_BLOCK = 256 << 10
"""Checksums cover blocks of at most 256 KiB: a verified partial read costs at most 512 KiB
extra (1 MiB blocks made a resharded quarter-load read 1.9x the bytes it needed)."""

ENGINES = ("auto", "posix", "kvikio")

MAX_NODE_QUEUE_DEPTH = 65536
"""An NVMe queue holds at most 64 Ki entries; a node budget above that is a typo."""

ENV_PREFIX = "DCP_NVME_"
TUNE_FILE_ENV = "DCP_NVME_TUNE_FILE"


def default_tune_file() -> Path:
    """Where ``dcp-nvme tune`` writes its result and where writers and readers look for it."""
    if os.environ.get(TUNE_FILE_ENV):
        return Path(os.environ[TUNE_FILE_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dcp_nvme" / "tune.json"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from ``8388608``, ``"8MiB"`` or ``"8M"`` (binary), or ``"5GB"`` (decimal)."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"not a size: {value!r} (use e.g. 8388608, '8MiB' or '5GB')")
    number, unit, binary, byte = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    decimal = bool(unit) and bool(byte) and not binary
    return int(float(number) * (1000 if decimal else 1024) ** power)


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


@dataclass(frozen=True)
class IOConfig:
    """How a rank talks to its storage.

    ``queue_depth`` requests of ``block_size`` bytes are in flight per rank: that product is the
    write window. With N ranks on one node the device sees N x queue_depth requests, unless
    ``node_queue_depth`` is set: then the node's ranks share that many (``dcp_nvme.node``).
    """

    queue_depth: int = 8
    block_size: int = 8 << 20
    direct_io: bool = True
    engine: str = "auto"
    verify: bool = True
    node_queue_depth: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.queue_depth, int) or self.queue_depth < 1:
            raise ValueError(f"queue_depth must be an integer >= 1, got {self.queue_depth!r}")
        if self.queue_depth > 256:
            raise ValueError(f"queue_depth {self.queue_depth} is above the supported 256")
        if self.block_size < ALIGN or self.block_size % ALIGN:
            raise ValueError(
                f"block_size must be a positive multiple of {ALIGN} bytes, got {self.block_size}"
            )
        if self.node_queue_depth is not None and (
                isinstance(self.node_queue_depth, bool) or not isinstance(self.node_queue_depth, int)
                or not 1 <= self.node_queue_depth <= MAX_NODE_QUEUE_DEPTH):
            raise ValueError(f"node_queue_depth must be an integer from 1 to {MAX_NODE_QUEUE_DEPTH} "
                             f"(requests in flight shared by a node's ranks), got {self.node_queue_depth!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")

    @property
    def checksum_block(self) -> int:
        """Checksum granularity: divides block_size, so every request covers whole blocks."""
        import math

        return math.gcd(self.block_size, MAX_CHECKSUM_BLOCK)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = {
    "queue_depth": int,
    "block_size": parse_size,
    "direct_io": bool,
    "engine": str,
    "verify": bool,
    "node_queue_depth": int,
}


def _from_env() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        raw = os.environ.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        env_name = ENV_PREFIX + name.upper()
        try:
            found[name] = _parse_bool(env_name, raw) if kind is bool else kind(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {env_name}: {exc}") from None
    return found


def _from_tune_file() -> dict[str, Any]:
    path = default_tune_file()
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
        best = doc["best"]
        return {k: best[k] for k in ("queue_depth", "block_size", "direct_io", "node_queue_depth")
                if k in best}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring tune file %s: %s (rerun `dcp-nvme tune`)", path, exc)
        return {}


def resolve_config(**explicit: Any) -> IOConfig:
    """Build an IOConfig: explicit arguments (None means unset) > env > tune file > defaults."""
    unknown = set(explicit) - set(_FIELDS)
    if unknown:
        raise TypeError(f"unknown I/O option(s): {sorted(unknown)}")
    values: dict[str, Any] = {}
    values.update(_from_tune_file())
    values.update(_from_env())
    values.update({k: v for k, v in explicit.items() if v is not None})
    if "block_size" in values:
        values["block_size"] = parse_size(values["block_size"])
    return replace(IOConfig(), **values)
