"""CRC32C libraries on the checksum path's own work: 256 KiB blocks of writable memory (a
tensor's bytes, seen through a memoryview), one thread and two.

    python benchmarks/crc32c_backends.py --size 256MiB --json crc.json

Prints its configuration and GB/s per library, and writes them as JSON. A library that is not
installed is reported as skipped. ``google_crc32c`` (1.9) accepts only ``bytes``, so each block
is copied first, as dcp_nvme would have to; ``zlib.crc32`` is another polynomial, shown as the
floor of what the standard library offers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np

from dcp_nvme.config import parse_size

BLOCK = 256 << 10


def _backends() -> dict[str, Callable[[memoryview], int] | str]:
    found: dict[str, Callable[[memoryview], int] | str] = {}
    try:
        import crc32c

        found["crc32c (LGPL-2.1, any buffer)"] = crc32c.crc32c
    except ImportError as exc:
        found["crc32c (LGPL-2.1, any buffer)"] = f"not installed: {exc}"
    try:
        import google_crc32c

        found["google_crc32c (Apache-2.0, bytes copy)"] = lambda view: google_crc32c.value(bytes(view))
    except ImportError as exc:
        found["google_crc32c (Apache-2.0, bytes copy)"] = f"not installed: {exc}"
    try:
        from awscrt import checksums

        found["awscrt (Apache-2.0, any buffer)"] = checksums.crc32c
    except ImportError as exc:
        found["awscrt (Apache-2.0, any buffer)"] = f"not installed: {exc}"
    found["zlib.crc32 (not CRC32C; the standard library)"] = zlib.crc32
    return found


def _rate(fn: Callable[[memoryview], int], blocks: list[memoryview], threads: int, repeat: int) -> float:
    def work(part: list[memoryview]) -> None:
        for view in part:
            fn(view)

    best = float("inf")
    for _ in range(repeat):
        workers = [threading.Thread(target=work, args=(blocks[k::threads],)) for k in range(threads)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = min(best, time.perf_counter() - started)
    return len(blocks) * BLOCK / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MiB", help="bytes checksummed per pass (default 256MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="passes; the fastest counts (default 3)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    size = parse_size(args.size) // BLOCK * BLOCK
    memory = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)  # writable, like a tensor
    view = memoryview(memory).cast("B")
    blocks = [view[i : i + BLOCK] for i in range(0, size, BLOCK)]
    config = {"bytes": size, "block": BLOCK, "repeat": args.repeat, "cpus": os.cpu_count(),
              "machine": platform.machine(), "python": platform.python_version()}
    print(f"crc32c backends: {size >> 20} MiB in {BLOCK >> 10} KiB blocks of writable memory, "
          f"best of {args.repeat}, {config['cpus']} CPU(s)")
    results = {}
    for name, fn in _backends().items():
        if isinstance(fn, str):
            results[name] = {"skipped": fn}
            print(f"  {name:<48} skipped ({fn})")
            continue
        figures = {f"threads_{n}_gbps": round(_rate(fn, blocks, n, args.repeat), 2) for n in (1, 2)}
        results[name] = figures
        print(f"  {name:<48} " + ", ".join(f"{v:.2f} GB/s ({k.split('_')[1]} thread(s))"
                                             for k, v in figures.items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": config, "results": results}, handle, indent=1)
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
