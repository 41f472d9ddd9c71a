"""The machine under the figures: page-cache eviction and residency of files under test, and
what a reader of a measurement needs to know about where it was taken. Used by ``tune`` and
the bench; no I/O engine here."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
from pathlib import Path
from typing import Any

from dcp_nvme.config import ALIGN

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
    """Share of sampled pages in the page cache, or None where it cannot be told. Asked of the
    kernel with ``mincore`` over a mapping of the file, which reads nothing (a probe by read
    would bring pages in, and with readahead the next samples' too)."""
    libc = _libc()
    if libc is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    hits = tried = 0
    for path in paths:
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        if size < ALIGN:
            continue
        pages = -(-size // page)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                resident = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), resident) != 0:
                    return None
            finally:
                libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        finally:
            os.close(fd)
        step = max(1, pages // samples)
        picked = resident[::step]
        tried += len(picked)
        hits += sum(b & 1 for b in picked)
    return hits / tried if tried else None


def _libc() -> Any:
    """libc with mmap/mincore/munmap typed, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


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
