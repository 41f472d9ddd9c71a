"""A drain in its own process that SIGKILLs itself at an exact point (tests/tiers/test_drain_*.py).

    python drain_child.py LOCAL TARGET PART_SIZE POINT NTH [STORAGE_OPTIONS_JSON]

POINT is a drain hook point (``piece-sent``, ``piece-journaled``, ``file-finished``,
``before-commit``); the process dies with SIGKILL the NTH time the drain reaches it (no
cleanup, no journal update: as a killed node would). Exits 3 if the point is never reached.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from dcp_nvme.config import parse_size
from dcp_nvme.tiers import DrainOptions, drain
from dcp_nvme.tiers.drainer import set_drain_hook


def main() -> int:
    local, target, part_size, point, nth = sys.argv[1:6]
    storage_options = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    seen = [0]

    def hook(at: str, info: dict) -> None:
        if at == point:
            seen[0] += 1
            if seen[0] == int(nth):
                os.kill(os.getpid(), signal.SIGKILL)

    set_drain_hook(hook)
    drain(local, target, storage_options=storage_options,
          options=DrainOptions(part_size=parse_size(part_size), max_transfers=1, retries=0))
    return 3


if __name__ == "__main__":
    sys.exit(main())
