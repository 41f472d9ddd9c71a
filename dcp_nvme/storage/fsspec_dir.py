"""The second tier: a checkpoint at any fsspec URL (``s3://``, ``gs://``, ``file://``...).

``FsspecStore`` has the methods of ``store.LocalStore`` (the small-file side: manifest, tables,
listing, cleanup). Bulk reads go through ``engines.fsspec.FsspecEngine``; writes to a remote
tier go through the drain (``dcp_nvme.tiers``), not through an engine.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from dcp_nvme import seams
from dcp_nvme.config import IOConfig, missing_backend
from dcp_nvme.errors import ManifestError
from dcp_nvme.host.files import bare_name, fsync_dir
from dcp_nvme.storage.local_dir import LocalStore, is_remote_url, local_path


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """(fsspec filesystem, root path inside it) for a URL; storage options go to the backend."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:  # fsspec's "Install s3fs to access S3": say which extra adds it
        raise missing_backend(url.split("://", 1)[0], url, str(exc)) from exc
    return fs, root.rstrip("/")


def is_local_fs(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


class FsspecStore:
    """A checkpoint directory (an object prefix on object stores) behind an fsspec filesystem.

    Listings are always refreshed: another process (the drain) writes here, and fsspec's
    listing cache would otherwise hide its objects.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, fs=None) -> None:
        self.url = os.fspath(url).rstrip("/")
        self.location = self.url
        if fs is None:
            fs, root = filesystem(self.url, storage_options)
        else:
            root = fs._strip_protocol(self.url).rstrip("/")
        self.fs, self.root = fs, root
        self.local = is_local_fs(fs)

    def path(self, name: str) -> str:
        return f"{self.root}/{bare_name(name)}"

    def _refresh(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path or self.root)

    def exists(self) -> bool:
        self._refresh()
        try:
            return bool(self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return False

    def has(self, name: str) -> bool:
        self._refresh()
        try:
            return self.fs.info(self.path(name))["type"] == "file"
        except FileNotFoundError:
            return False

    def names(self) -> list[str]:
        self._refresh()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "file")

    def read(self, name: str, max_size: int | None = None) -> bytes:
        size = self.size(name)  # a regular file, and not larger than its kind allows
        if max_size is not None and size > max_size:
            raise ManifestError(f"{self.path(name)} is {size} bytes, more than the {max_size} a file of "
                                "its kind may have; the checkpoint is damaged or not a dcp_nvme checkpoint")
        return self.fs.cat_file(self.path(name), start=0, end=size)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path(name), start=start, end=end)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        data = self.read_range(name, offset, offset + len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def size(self, name: str) -> int:
        """The size of a regular file (fs.info checked before any read: no FIFO, device or link)."""
        path = self.path(name)
        self._refresh(path)
        info = self.fs.info(path)
        if info.get("type") != "file" or info.get("islink"):
            raise ManifestError(f"{path} is a {info.get('type')}{' link' if info.get('islink') else ''}, "
                                "not a regular file; a checkpoint holds only regular files, so it is refused")
        return int(info["size"])

    def make(self) -> None:
        # Object stores have no directories; makedirs there would even create a missing bucket.
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Readers see all of it or none: one PUT on object stores, temp+fsync+rename locally."""
        if self.local:
            LocalStore(self.root).write_atomic(name, data)
        else:
            self.fs.pipe_file(self.path(name), data)

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass

    def sync(self) -> None:
        if self.local:
            fsync_dir(self.root)

    def read_engine(self, config: IOConfig) -> Any:
        """The engine of this store's bulk reads (an ``S3Store`` has its own)."""
        from dcp_nvme.engines.fsspec import FsspecEngine  # torch: only a load imports it

        return FsspecEngine(self.fs, config)


def open_store(location: str | os.PathLike, storage_options: dict[str, Any] | None = None):
    """LocalStore for local paths (and ``file://``), FsspecStore for other URLs."""
    text = os.fspath(location)
    if is_remote_url(text):
        if text.startswith("s3://") and seams.object_store.plugged:  # botocore itself, where it can
            store = seams.object_store(text, storage_options)
            if store is not None:
                return store
        return FsspecStore(text, storage_options)
    return LocalStore(local_path(text))
