"""Where a restoring rank finds each file: this node's disk, a replica here, a peer, the mirror.

A node that lost its disk (a replacement node), or a rank that needs another node's files
(a restart at another world size), gets each file from the nearest copy that verifies:

  1. this node's checkpoint directory (a data file at its manifest size; its blocks are
     checked as they are read, and a block that fails makes the file come from the next source);
  2. a complete replica on this node (``.replicas/<node>/``, marker written);
  3. a peer: every node's first reader serves its directory (``peers.server``) and
     publishes the address in the job's store; the node that wrote the file first, then the
     others, each asked for its own copy and for its replica of the writer's node;
  4. the mirror (``NVMeReader(mirror=...)``): ranged reads, ``queue_depth`` x ``block_size`` in
     flight.

Each copy is checked against the blocks table piece by piece as it arrives (``fetch_file``)
and written into this node's directory under a temp name, fsynced and renamed: the node keeps
what it fetched, so the next restart reads it locally. A copy that fails its checksum is
never used: a warning names it and the next source is asked. The manifest and tables come the
same way when this node has none (they are validated as a whole before they are written,
manifest last). ``last_stats["sources"]`` of the reader says, per source, files, bytes, seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

from dcp_nvme.config import IOConfig
from dcp_nvme.errors import ChecksumMismatchError, DCPNVMeError, ManifestError, PeerError
from dcp_nvme.format.container import MANIFEST, REPLICAS_DIR, check_node_name
from dcp_nvme.format.manifest import Manifest, read_files, read_manifest
from dcp_nvme.host.files import create_no_follow
from dcp_nvme.host.job import job_store, leads_its_node
from dcp_nvme.peers.client import (
    LocalSource,
    MirrorSource,
    PeerSource,
    fetch_file,
    fetch_metadata,
    server_address,
    write_metadata,
)
from dcp_nvme.peers.server import process_server, replica_files
from dcp_nvme.storage.fsspec_dir import open_store
from dcp_nvme.storage.local_dir import LocalStore

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 600.0
"""Seconds the ranks of a restore wait for each other to publish their servers."""
_generations: dict[str, int] = {}


def _wait_count(store: Any, key: str, count: int, deadline: float) -> None:
    pause = 0.005
    while store.add(key, 0) < count:
        if time.monotonic() >= deadline:
            raise PeerError(f"not every rank of the restore joined within {JOIN_TIMEOUT:.0f} s "
                            f"({store.add(key, 0)} of {count}); pass mirror= (or peers=True) on every rank")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def join_peers(path: str, node: str) -> list[dict[str, Any]]:
    """Every rank of the job: the node's first rank serves ``path`` and publishes its server;
    all wait for all; returns the servers of the other nodes. Only with ``torch.distributed``
    initialized and more than one rank (else no peers)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return []
    store, world = job_store(), dist.get_world_size()
    path = os.path.abspath(path)
    _generations[path] = generation = _generations.get(path, 0) + 1  # the same on every rank
    scope = f"restore/{path}/{generation}"
    if leads_its_node():
        server = process_server(server_address())
        server.register(path)
        index = store.add(f"{scope}/servers", 1) - 1
        store.set(f"{scope}/server/{index}", json.dumps({**server.info(), "node": node}).encode())
    store.add(f"{scope}/arrived", 1)
    _wait_count(store, f"{scope}/arrived", world, time.monotonic() + JOIN_TIMEOUT)
    found = []
    for index in range(store.add(f"{scope}/servers", 0)):
        info = json.loads(store.get(f"{scope}/server/{index}"))
        if isinstance(info, dict) and info.get("node") != node:
            found.append(info)
    return found


class RestoreSources:
    """The copies one reader may use, in order of nearness, and what it took from each."""

    def __init__(self, path: str, node: str, peers: list[dict[str, Any]], mirror: str | None,
                 mirror_options: dict[str, Any] | None, config: IOConfig) -> None:
        self.path, self.node, self.peers, self.config = path, node, peers, config
        self.mirror_url = mirror
        self.mirror_options = mirror_options
        self._mirror: MirrorSource | None | bool = None if mirror else False
        self.taken: dict[str, dict[str, float]] = {}
        """source kind -> {"files", "bytes", "seconds"}."""
        self.damaged: list[str] = []

    # ------------------------------------------------------------------ the sources

    def mirror(self) -> MirrorSource | None:
        """The mirror as a source (``mirror_source``), looked up once."""
        if self._mirror is None:
            self._mirror = mirror_source(self.path, self.mirror_url, self.mirror_options) or False
        return self._mirror or None

    def _local_replicas(self, owner: str | None) -> list[LocalSource]:
        root = os.path.join(self.path, REPLICAS_DIR)
        try:
            held = sorted(os.listdir(root))
        except OSError:
            return []
        if owner is not None:
            held = [owner] if owner in held else []
        out = []
        for name in held:
            try:
                check_node_name(name, root)
            except ManifestError:
                continue
            if replica_files(self.path, name) is not None:
                out.append(LocalSource(os.path.join(root, name)))
        return out

    def _peer_sources(self, owner: str | None) -> list[PeerSource]:
        ordered = sorted(self.peers, key=lambda info: info.get("node") != owner)  # the writer's node first
        out = []
        for info in ordered:
            node = str(info.get("node", "?"))
            try:
                out.append(PeerSource(info, self.path, "", node))
                if owner is not None and owner != node:
                    out.append(PeerSource(info, self.path, check_node_name(owner, "manifest"), node))
            except (PeerError, ManifestError) as exc:
                log.warning("dcp_nvme: %s", exc)
        return out

    def _candidates(self, owner: str | None) -> list[Any]:
        mirror = self.mirror()
        return [*self._local_replicas(owner), *self._peer_sources(owner), *([mirror] if mirror else [])]

    def _took(self, kind: str, nbytes: int, seconds: float) -> None:
        entry = self.taken.setdefault(kind, {"files": 0, "bytes": 0, "seconds": 0.0})
        entry["files"] += 1
        entry["bytes"] += nbytes
        entry["seconds"] += seconds

    def _damaged(self, where: str, exc: BaseException) -> None:
        self.damaged.append(where)
        log.warning("dcp_nvme: damaged copy %s is not used (%s); trying the next copy", where, exc)

    # ------------------------------------------------------------------ metadata

    def ensure_metadata(self) -> None:
        """This node's directory holds a manifest that reads back valid, or gets one (and its
        tables) from the nearest copy that does."""
        local = LocalStore(self.path)
        try:
            read_manifest(local, self.path)
            return
        except (DCPNVMeError, OSError) as exc:
            if local.has(MANIFEST):
                self._damaged(local.path(MANIFEST), exc)
            problem: BaseException = exc
        for source in self._candidates(None):
            began = time.perf_counter()
            try:
                manifest_bytes, tables, _ = fetch_metadata(source, self.path)
            except (FileNotFoundError, PeerError) as exc:
                problem = exc
                continue
            except (DCPNVMeError, OSError, ValueError) as exc:
                self._damaged(source.describe(MANIFEST), exc)
                problem = exc
                continue
            finally:
                source.close()
            os.makedirs(self.path, exist_ok=True)
            write_metadata(self.path, manifest_bytes, tables)  # the manifest last: the local commit
            self._took(source.kind, len(manifest_bytes) + sum(len(d) for _, d in tables),
                       time.perf_counter() - began)
            log.info("dcp_nvme: %s: the manifest came from %s", self.path, source.describe())
            return
        raise problem

    # ------------------------------------------------------------------ data files

    def ensure_files(self, manifest: Manifest, names: Iterable[str]) -> None:
        """Every file in ``names`` is in this node's directory at its manifest size."""
        local, files = LocalStore(self.path), read_files(LocalStore(self.path), manifest, self.path)
        for name in sorted(set(names)):
            record = files[name]
            try:
                size = local.size(name)
            except (OSError, ManifestError):
                size = None
            if size == record.size:
                self._took("local", record.size, 0.0)
                continue
            with node_turn(self.path, name):  # one rank of the node copies it, the others wait
                try:
                    size = local.size(name)
                except (OSError, ManifestError):
                    size = None
                if size == record.size:  # another rank of this node has just fetched it
                    self._took("local", record.size, 0.0)
                else:
                    self.fetch(manifest, name)

    def fetch(self, manifest: Manifest, name: str) -> None:
        """``name`` copied into this node's directory from the nearest other copy that verifies."""
        record = read_files(LocalStore(self.path), manifest, self.path)[name]
        owner = manifest.node_of(record.rank)
        problem: BaseException | None = None
        for source in self._candidates(owner):
            began = time.perf_counter()
            try:
                copied = fetch_file(source, record, self.path, queue_depth=self.config.queue_depth,
                                    block_size=self.config.block_size)
            except (FileNotFoundError, PeerError) as exc:
                problem = exc
                continue
            except (ChecksumMismatchError, ManifestError) as exc:
                self._damaged(source.describe(name), exc)
                problem = exc
                continue
            finally:
                source.close()
            self._took(source.kind, copied, time.perf_counter() - began)
            log.info("dcp_nvme: %s came from %s", name, source.describe(name))
            return
        error = manifest.missing_file_error(name, record.rank, self.path)
        raise type(error)(f"{error} (no replica or mirror holds a copy that verifies: {problem})") from None

    def replace_damaged(self, manifest: Manifest, exc: ChecksumMismatchError) -> bool:
        """A block of this node's copy failed while it was read: fetch the file again from the
        next copy. False when the damaged bytes are not one of this directory's files."""
        name = os.path.basename(exc.path)
        if os.path.dirname(os.path.abspath(exc.path)) != os.path.abspath(self.path):
            return False
        self._damaged(exc.path, exc)
        self.fetch(manifest, name)  # never this directory's own copy: it is the damaged one
        return True

    def stats(self, read: Any = None, read_seconds: float = 0.0) -> dict[str, Any]:
        """Per source kind: files, bytes, seconds, GB/s of what came from it; ``read``: the
        load's own read from this node's disk afterwards (every byte, fetched or not)."""
        out: dict[str, Any] = {}
        if read is not None:
            out["read"] = {"bytes": int(read.bytes), "seconds": round(read_seconds, 6),
                           "gbps": round(read.bytes / read_seconds / 1e9, 3) if read_seconds > 0 else None}
        for kind, entry in self.taken.items():
            seconds = entry["seconds"]
            out[kind] = {"files": int(entry["files"]), "bytes": int(entry["bytes"]), "seconds": round(seconds, 6),
                         "gbps": round(entry["bytes"] / seconds / 1e9, 3) if seconds > 0 else None}
        if self.damaged:
            out["damaged"] = list(self.damaged)
        return out


@contextlib.contextmanager
def node_turn(path: str, name: str) -> Iterator[None]:
    """An exclusive flock per (directory, file) in this node's temp directory: the ranks of a
    node that need one file copy it once. The lock files are a few bytes each, outside the
    checkpoint, reused by later restores."""
    tag = hashlib.sha1(f"{os.path.abspath(path)}/{name}".encode()).hexdigest()[:20]
    fd = create_no_follow(os.path.join(tempfile.gettempdir(), f"dcp_nvme-fetch-{tag}.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def mirror_source(path: str, url: str | None, options: dict[str, Any] | None) -> MirrorSource | None:
    """The mirror of checkpoint ``path`` as a source: ``url`` itself when it holds a manifest,
    else ``url/<the checkpoint's directory name>`` (a run's mirror root); None when neither
    does, or the mirror is compressed (a restore takes no files from it), or cannot be read."""
    for candidate in (url, _join(url, os.path.basename(os.path.normpath(path)))):
        if candidate is None:
            return None
        try:
            store = open_store(candidate, options)
            if not store.has(MANIFEST):
                continue
            if b'"compression"' in store.read(MANIFEST, 1 << 26):
                log.warning("dcp_nvme: the mirror %s is compressed: a restore takes no files from it; "
                            "load it with NVMeReader(%r) instead", candidate, candidate)
                return None
            return MirrorSource(store)
        except Exception as exc:  # noqa: BLE001  an unreachable mirror is one source fewer
            log.warning("dcp_nvme: the mirror %s cannot be read: %s", candidate, exc)
            return None
    return None


def _join(root: str | None, name: str) -> str | None:
    if root is None:
        return None
    return f"{root.rstrip('/')}/{name}" if "://" in root else os.path.join(root, name)


def restore_sources(path: str, node: str, mirror: str | None, mirror_options: dict[str, Any] | None,
                    config: IOConfig) -> RestoreSources:
    """The sources of a load that may take files from this node's replicas, peers or a mirror
    (``seams.restore_sources``): every rank of the job joins the peers here."""
    return RestoreSources(path, node, join_peers(path, node), mirror, mirror_options, config)
