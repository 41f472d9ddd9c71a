"""Where a one-process restore finds each file: this node's disk, a replica here, the mirror.

A load in one process (``NVMeReader(mirror=...)`` or ``peers=True`` without several ranks) whose
node lost its disk (a replacement node), or that needs another node's files, gets each file
from the nearest copy that verifies:

  1. this node's checkpoint directory (a data file at its manifest size; its blocks are
     checked as they are read, and a block that fails makes the file come from the next source);
  2. a complete replica on this node (``.replicas/<node>/``, marker written): of the node that
     wrote the file (for the manifest and tables, any);
  3. the mirror (``NVMeReader(mirror=...)``): ranged reads, ``queue_depth`` x ``block_size`` in
     flight.

A load on several ranks takes other nodes' bytes over a gloo group instead
(``peers.exchange``); this module gives it ``mirror_source`` and ``node_turn``.

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
from dcp_nvme.format.manifest import MAX_MANIFEST, Manifest, read_files, read_manifest
from dcp_nvme.host.files import create_no_follow
from dcp_nvme.peers.fetching import (
    LocalSource,
    MirrorSource,
    OtherCheckpointError,
    check_this_checkpoint,
    data_keys,
    fetch_file,
    fetch_metadata,
    journal_restored,
    replica_files,
    write_metadata,
)
from dcp_nvme.storage.fsspec_dir import open_store
from dcp_nvme.storage.local_dir import LocalStore

log = logging.getLogger(__name__)

class RestoreSources:
    """The copies one reader may use, in order of nearness, and what it took from each."""

    def __init__(self, path: str, node: str, mirror: str | None, mirror_options: dict[str, Any] | None,
                 config: IOConfig) -> None:
        self.path, self.node, self.config = path, node, config
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
        return self._mirror if isinstance(self._mirror, MirrorSource) else None

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

    def _candidates(self, owner: str | None) -> list[Any]:
        mirror = self.mirror()
        return [*self._local_replicas(owner), *([mirror] if mirror else [])]

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
        tables) from the copy that does; when copies hold different saves of this checkpoint,
        from the newest (``_newest``)."""
        local = LocalStore(self.path)
        try:
            read_manifest(local, self.path)
            return
        except (DCPNVMeError, OSError) as exc:
            if local.has(MANIFEST):
                self._damaged(local.path(MANIFEST), exc)
            problem: BaseException = exc
        keys_here = data_keys(self.path)
        found: list[tuple[Any, bytes, list[tuple[str, bytes]], Manifest, float]] = []
        for source in self._candidates(None):
            began = time.perf_counter()
            try:
                if found and self._same_save(source, found[0][3].save_key):
                    continue  # another copy of the save already read: its tables are not read again
                manifest_bytes, tables, manifest = fetch_metadata(source, self.path)
                check_this_checkpoint(manifest, self.path, keys_here, source.describe(MANIFEST))
            except (FileNotFoundError, PeerError) as exc:
                problem = exc
                continue
            except OtherCheckpointError as exc:
                log.warning("dcp_nvme: %s", exc)
                problem = exc
                continue
            except (DCPNVMeError, OSError, ValueError) as exc:
                self._damaged(source.describe(MANIFEST), exc)
                problem = exc
                continue
            finally:
                source.close()
            found.append((source, manifest_bytes, tables, manifest, time.perf_counter() - began))
        if not found:
            raise problem
        source, manifest_bytes, tables, manifest, seconds = self._newest(found)
        os.makedirs(self.path, exist_ok=True)
        write_metadata(self.path, manifest_bytes, tables)  # the manifest last: the local commit
        journal_restored(self.path, source, manifest.save_key)
        self._took(source.kind, len(manifest_bytes) + sum(len(d) for _, d in tables), seconds)
        log.info("dcp_nvme: %s: the manifest came from %s", self.path, source.describe())

    @staticmethod
    def _same_save(source: Any, key: str) -> bool:
        """Whether ``source``'s manifest names save ``key`` (read alone; anything else, a
        manifest that does not parse included, is fetched and checked as a whole)."""
        try:
            doc = json.loads(source.read(MANIFEST, MAX_MANIFEST))
        except (OSError, ValueError, DCPNVMeError):
            return False
        return isinstance(doc, dict) and doc.get("save_key") == key

    def _newest(self, found: list[tuple[Any, bytes, list[tuple[str, bytes]], Manifest, float]]
                ) -> tuple[Any, bytes, list[tuple[str, bytes]], Manifest, float]:
        """Of copies that hold different saves of this step (a replica left from before an
        overwrite beside the mirror of the overwrite), the one its writer created last. When the
        recorded creation times do not tell, nothing is taken: an older save is never loaded
        in silence."""
        if len(found) == 1:
            return found[0]
        saves = "; ".join(f"{f[0].describe(MANIFEST)} holds save {f[3].save_key} created "
                          f"{'at an unrecorded time' if f[3].created_unix is None else f'at unix {f[3].created_unix:.3f}'}"
                          for f in found)
        times = [f[3].created_unix for f in found]
        if any(t is None for t in times) or len(set(times)) != len(times):
            raise ManifestError(
                f"{self.path}: this node's manifest is damaged and its copies hold different saves of "
                f"the checkpoint ({saves}), and their creation times do not tell which is current: "
                "nothing is loaded. Remove the stale copy, or load the one you mean with "
                "NVMeReader(<its location>)")
        newest = max(found, key=lambda f: f[3].created_unix or 0.0)
        log.warning("dcp_nvme: %s: the copies hold different saves of the checkpoint (%s); the newest, "
                    "from %s, is taken", self.path, saves, newest[0].describe())
        return newest

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
            if _compressed(store.read(MANIFEST, 1 << 26)):
                log.warning("dcp_nvme: the mirror %s is compressed: a restore takes no files from it; "
                            "load it with NVMeReader(%r) instead", candidate, candidate)
                return None
            return MirrorSource(store, options)
        except Exception as exc:  # noqa: BLE001  an unreachable mirror is one source fewer
            log.warning("dcp_nvme: the mirror %s cannot be read: %s", candidate, exc)
            return None
    return None


def _compressed(manifest_bytes: bytes) -> bool:
    """Whether a mirror's manifest records a compression section (the drain's own field). A
    manifest that does not parse is left to ``fetch_metadata``, which names it damaged."""
    try:
        doc = json.loads(manifest_bytes)
    except ValueError:
        return False
    return isinstance(doc, dict) and Manifest(doc).compression is not None


def _join(root: str | None, name: str) -> str | None:
    if root is None:
        return None
    return f"{root.rstrip('/')}/{name}" if "://" in root else os.path.join(root, name)

