"""How figures are shown to a person: byte sizes and progress bars, one way each for the CLI,
``tune`` and the bench."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

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


def progress_bar(total: int, enabled: bool, desc: str = "", unit: str = "B") -> tqdm:
    """A progress bar on stderr (``update(n)``, ``set_description``, ``close``), removed when
    done; a silent one when not ``enabled``. ``unit="B"`` counts bytes in binary units."""
    from tqdm import tqdm  # when drawn, not when the CLI starts

    return tqdm(total=total, disable=not enabled, desc=desc or None, unit=unit, file=sys.stderr,
                leave=False, unit_scale=unit == "B", unit_divisor=1024)
