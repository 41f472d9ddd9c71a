"""The second tier: a checkpoint at any fsspec URL (``s3://``, ``gs://``, ``file://``...).

``FsspecStore`` has the methods of ``store.LocalStore`` (the small-file side: manifest, tables,
listing, cleanup). ``FsspecEngine`` is the engine protocol's read half over fsspec: each
``ReadRequest`` is one ranged GET (``cat_file(path, start, end)``), ``queue_depth`` of them in
flight, checked against the request's crc32c blocks before its bytes reach a destination.
Writes to a remote tier go through the drain (``dcp_nvme.tiers``), not through an engine.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np
import torch

from .concurrency import run_bounded
from .config import IOConfig
from .engines.posix import check_length, verify_checks
from .errors import ManifestError
from .layout import SCRATCH, ReadRequest
from .stats import IOStats
from .store import LocalStore, bare_name, fsync_dir, is_remote_url, local_path


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """(fsspec filesystem, root path inside it) for a URL; storage options go to the backend."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
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


def open_store(location: str | os.PathLike, storage_options: dict[str, Any] | None = None):
    """LocalStore for local paths (and ``file://``), FsspecStore for other URLs."""
    text = os.fspath(location)
    if is_remote_url(text):
        return FsspecStore(text, storage_options)
    return LocalStore(local_path(text))


class FsspecEngine:
    """Ranged reads over fsspec into destination tensors, ``queue_depth`` requests in flight.

    ``request.file`` is a path inside ``fs`` (what ``FsspecStore.path`` returns). Every request
    is checked against its crc32c blocks (``ReadRequest.checks``) before any byte is copied out.
    """

    name = "fsspec"

    def __init__(self, fs, config: IOConfig) -> None:
        self.fs = fs
        self.config = config

    def write_file(self, path, header, sources, checksum_block):  # noqa: ANN001
        raise NotImplementedError("the fsspec tier is written by the drain (dcp_nvme.tiers), "
                                  "not by NVMeWriter; save locally with mirror=URL")

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats:
        stats = IOStats("read")
        started = time.perf_counter()

        def run(request: ReadRequest) -> None:
            begun = stats.begin()
            data = self.fs.cat_file(request.file, start=request.file_offset,
                                    end=request.file_offset + request.length)
            stats.end(begun, len(data), len(data))
            check_length(request, request.file_offset + len(data))
            verify_checks(request, [memoryview(data)])
            source = np.frombuffer(data, dtype=np.uint8)
            position = 0
            for dest, dest_offset, length in request.pieces:
                if dest != SCRATCH and length:
                    _copy_into(dests[dest], dest_offset, source, position, length)
                position += length

        run_bounded(self.config.queue_depth, requests, run, "dcp-nvme-fsspec")
        stats.seconds = time.perf_counter() - started
        return stats

    def close(self) -> None:
        pass


def _copy_into(dest: torch.Tensor, offset: int, source: np.ndarray, position: int, length: int) -> None:
    if dest.device.type == "cpu":
        ctypes.memmove(dest.data_ptr() + offset, source.ctypes.data + position, length)
    else:  # device memory: one host tensor per piece, copied by torch
        dest[offset : offset + length].copy_(torch.from_numpy(source[position : position + length].copy()))
