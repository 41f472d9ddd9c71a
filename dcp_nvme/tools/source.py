"""Where a checkpoint's bytes come from: a local directory or an fsspec URL.

A source is a ``store`` (``exists/has/names/read/size``, what ``dcp_nvme.manifest`` reads the
manifest through) plus ranged reads, which is all the tools need. Local paths use ``preadv``
(GIL released, so threads overlap); anything with ``://`` goes through fsspec.
"""

from __future__ import annotations

import os
import posixpath
from typing import Protocol

from ..store import LocalStore


class Source(Protocol):
    location: str
    is_local: bool

    def exists(self) -> bool: ...
    def has(self, name: str) -> bool: ...
    def names(self) -> list[str]: ...
    def read(self, name: str) -> bytes: ...
    def size(self, name: str) -> int: ...

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; returns the bytes read (fewer at end of file)."""
        ...


class LocalSource(LocalStore):
    is_local = True

    def __init__(self, root: str | os.PathLike) -> None:
        super().__init__(root)
        self.location = os.fspath(root)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        fd = os.open(self.path(name), os.O_RDONLY)
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


class FsspecSource:
    """A checkpoint directory behind an fsspec URL (``s3://``, ``gs://``, ``memory://`` ...)."""

    is_local = False

    def __init__(self, url: str) -> None:
        import fsspec

        self.location = url
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def _path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def exists(self) -> bool:
        return self.fs.isdir(self.root)

    def has(self, name: str) -> bool:
        return self.fs.isfile(self._path(name))

    def names(self) -> list[str]:
        if not self.exists():
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def size(self, name: str) -> int:
        return int(self.fs.size(self._path(name)))

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        data = self.fs.cat_file(self._path(name), start=offset, end=offset + len(buffer))
        buffer[: len(data)] = data
        return len(data)


def is_url(location: str | os.PathLike) -> bool:
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def open_source(location: str | os.PathLike) -> Source:
    """The source for a local path (``file://`` allowed) or an fsspec URL."""
    text = os.fspath(location)
    if is_url(text):
        return FsspecSource(text)
    return LocalSource(text.removeprefix("file://"))
