"""The small-file side of a checkpoint directory: list, read, write atomically, remove.

Bulk data goes through an engine; this is for the manifest, the index and cleanup.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol


def is_remote_url(location: Any) -> bool:
    """A URL with a scheme other than ``file://`` (those are plain local paths here)."""
    if not isinstance(location, (str, os.PathLike)):
        return False
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def is_local_path(location: Any) -> bool:
    return isinstance(location, (str, os.PathLike)) and not is_remote_url(location)


def local_path(location: str | os.PathLike) -> str:
    """A local path, with a ``file://`` prefix removed."""
    return os.fspath(location).removeprefix("file://")


class Store(Protocol):
    """What readers and tools need of a checkpoint directory, local or behind fsspec."""

    location: str

    def exists(self) -> bool: ...
    def has(self, name: str) -> bool: ...
    def names(self) -> list[str]: ...
    def read(self, name: str) -> bytes: ...
    def size(self, name: str) -> int: ...

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; returns the bytes read (fewer at end of file)."""
        ...


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A checkpoint directory on a local (or locally mounted) filesystem."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.location = os.fspath(root)  # as the user wrote it, for messages

    def path(self, name: str) -> str:
        return str(self.root / name)

    def exists(self) -> bool:
        return self.root.is_dir()

    def has(self, name: str) -> bool:
        return (self.root / name).is_file()

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        fd = os.open(self.root / name, os.O_RDONLY)
        try:
            total = 0
            while total < len(buffer):
                got = os.preadv(fd, [buffer[total:]], offset + total)
                if got == 0:
                    break
                total += got
            return total
        finally:
            os.close(fd)

    def make(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Temp name, fsync, rename, fsync of the directory: readers see all of it or none."""
        final = self.root / name
        temp = self.root / f".{name}.tmp-{os.getpid()}"
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
        fsync_dir(self.root)

    def remove(self, name: str) -> None:
        try:
            (self.root / name).unlink()
        except FileNotFoundError:
            pass

    def sync(self) -> None:
        fsync_dir(self.root)
