"""How figures are shown to a person: byte sizes and progress bars, one way each for the CLI,
``tune`` and the bench."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_size(nbytes: float | None) -> str:
    """``8 MiB``, ``1.5 GiB``, ``312 B`` (binary units, as ``config.parse_size`` reads them);
    ``-`` for an unknown size."""
    if nbytes is None:
        return "-"
    for unit, scale in _UNITS:
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


PROGRESS_MIN_BYTES = 256 << 20
"""Below this a byte count is done before a bar would say anything: no bar."""


def progress_bar(total: int, enabled: bool, desc: str = "", unit: str = "B") -> tqdm:
    """A progress bar on stderr (``update(n)``, ``set_description``, ``close``), removed when
    done; a silent one when not ``enabled``, when stderr is not a terminal (a SLURM log or a
    pipe gets no carriage-return redraws) or for fewer than ``PROGRESS_MIN_BYTES`` bytes.
    ``unit="B"`` counts bytes in binary units."""
    from tqdm import tqdm  # when drawn, not when the CLI starts

    shown = enabled and _is_terminal(sys.stderr) and (unit != "B" or total >= PROGRESS_MIN_BYTES)
    return tqdm(total=total, disable=not shown, desc=desc or None, unit=unit, file=sys.stderr,
                leave=False, unit_scale=unit == "B", unit_divisor=1024)


def _is_terminal(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def print_json(value: Any, checkpoint: str | os.PathLike | None = None) -> None:
    """What every ``--json`` prints: one object per checkpoint, whose ``checkpoint`` key names
    it (the path or URL as given), or a list of them for a command about many (``list``,
    ``status`` of a run directory)."""
    if checkpoint is not None:
        value = {"checkpoint": os.fspath(checkpoint), **value}
    print(json.dumps(value, indent=2, default=str))
