"""The machine under the figures: page-cache eviction and residency of files under test, and
what a reader of a measurement needs to know about where it was taken. Used by ``tune`` and
the bench; no I/O engine here."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from ..config import ALIGN

# --------------------------------------------------------------------------- page cache


def evict_from_page_cache(paths: list[str]) -> str:
    """Drop the files' pages from the page cache; return the method used, for the report.

    Each file is fsynced (the kernel drops clean pages only) and given
    ``posix_fadvise(POSIX_FADV_DONTNEED)``: unprivileged, and limited to the files under test,
    where ``/proc/sys/vm/drop_caches`` needs root and empties the cache of the whole machine.
    ``cached_fraction`` checks that it worked.
    """
    if not hasattr(os, "posix_fadvise"):
        return "none (this platform has no posix_fadvise; loads may be served from the page cache)"
    for path in paths:
        if not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file"


def cached_fraction(paths: list[str], samples: int = 64) -> float | None:
    """Share of sampled pages still in the page cache (a non-blocking read tells), or None."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not hasattr(os, "preadv"):
        return None
    hits = tried = 0
    buffer = bytearray(ALIGN)
    for path in paths:
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        if size < ALIGN:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            step = max(ALIGN, (size // samples) // ALIGN * ALIGN)
            for offset in range(0, size - ALIGN + 1, step):
                tried += 1
                try:
                    if os.preadv(fd, [buffer], offset, flag) > 0:
                        hits += 1
                except BlockingIOError:
                    pass
                except OSError:
                    return None  # the filesystem does not support RWF_NOWAIT
        finally:
            os.close(fd)
    return hits / tried if tried else None


def files_under(directory: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


# --------------------------------------------------------------------------- machine


def machine_info(directory: str) -> dict[str, Any]:
    """What a reader of the figures needs to know about where they were taken."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "directory": os.path.abspath(directory),
    }
    try:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    info.update(_filesystem_of(directory))
    return info


def _filesystem_of(directory: str) -> dict[str, Any]:
    """Mount point, filesystem type and block device model of the directory, where /proc tells."""
    found: dict[str, Any] = {}
    path = os.path.realpath(directory)
    try:
        best = ""
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount, fstype = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best = mount
                    found.update(mount=mount, fstype=fstype, device=device)
    except OSError:
        return found
    try:
        dev = os.stat(path).st_dev
        sys_block = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for rel in ("device/model", "../device/model"):
            model = os.path.join(sys_block, rel)
            if os.path.isfile(model):
                found["device_model"] = Path(model).read_text().strip()
                break
        rotational = os.path.join(sys_block, "queue/rotational")
        if os.path.isfile(rotational):
            found["rotational"] = Path(rotational).read_text().strip() == "1"
    except OSError:
        pass
    return found
