"""The drain journal: ``<checkpoint>/.drain.json``, rewritten atomically after every piece.

It names the target, the save key it describes, the state (``draining``, ``mirrored``,
``failed``), the last cause, and per data file the part size it was planned with and the byte
range of each piece that reached the target (plus the multipart upload id and part ETags on
S3). It is a hint for what a resumed drain may skip, never proof: every piece it names is
confirmed on the target again before it is skipped. A checkpoint with no journal (or one about
another save or target) is in state ``local``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from dcp_nvme.config import without_credentials
from dcp_nvme.errors import CheckpointNotFoundError
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.manifest import MAX_MANIFEST, missing_manifest_error
from dcp_nvme.format.pieces import Piece
from dcp_nvme.host.files import create_no_follow, read_regular
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.storage.run_dir import DCP, DCP_MARKER, committed_kind
from dcp_nvme.tiers.transfer import piece_entry

log = logging.getLogger(__name__)

JOURNAL = ".drain.json"
LOCK = ".drain.lock"
"""flock'd for the whole of a drain: one drain per checkpoint at a time (it holds the journal)."""
OPTIONS = "storage_options"
"""The journal's entry of the target's storage options, credentials left out."""
JOURNAL_VERSION = 2
"""Version 2 records byte ranges; an older journal (piece numbers only) is started afresh."""
LOCAL, DRAINING, MIRRORED, FAILED, UNCOMMITTED = "local", "draining", "mirrored", "failed", "uncommitted"
FOREIGN = "foreign"
"""A directory committed by DCP's own FileSystemWriter: not ours to drain."""


@dataclass
class DrainState:
    """Where one local checkpoint stands with its mirror. ``str()`` gives ``failed: <cause>``."""

    state: str
    target: str | None = None
    cause: str = ""
    bytes_sent: int = 0
    bytes_total: int = 0
    attempts: int = 0
    updated_unix: float | None = None
    pid: int | None = None
    delta: dict[str, Any] | None = None
    """A mirrored ``compress="delta"`` drain: against what, and how much of the items' bytes
    were delta-coded (``fraction``, ``full_items``, or ``why`` everything was coded full)."""
    restored_from: str | None = None
    """The mirror this step was restored from (its manifest came from there), when it was."""

    def __str__(self) -> str:
        return f"{self.state}: {self.cause}" if self.state == FAILED and self.cause else self.state

    @property
    def interrupted(self) -> bool:
        """Journal says draining but the process that wrote it is gone (resume with dcp-nvme drain)."""
        return self.state == DRAINING and self.pid is not None and not _alive(self.pid)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "interrupted": self.interrupted, "text": str(self)}


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_journal(path: str | os.PathLike) -> dict[str, Any] | None:
    try:
        doc = json.loads(read_regular(os.path.join(path, JOURNAL), MAX_MANIFEST))  # no FIFO, no link
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a torn journal cannot happen (atomic rename); a foreign one is ignored
    return doc if isinstance(doc, dict) else None


def _local_save_key(path: str | os.PathLike) -> tuple[str | None, str]:
    """(save key, "") of a committed checkpoint, or (None, why not). Never raises for a bad file:
    a sibling's broken manifest must not break status or retention of the others."""
    try:
        doc = json.loads(read_regular(os.path.join(path, MANIFEST), MAX_MANIFEST))  # no FIFO, no link
    except FileNotFoundError:
        return None, f"no committed {MANIFEST}"
    except (OSError, ValueError) as exc:
        return None, f"{MANIFEST} is unreadable ({type(exc).__name__})"
    key = doc.get("save_key") if isinstance(doc, dict) else None
    if not isinstance(key, str) or not key:
        return None, f"{MANIFEST} is not a dcp_nvme manifest"
    return key, ""


def drain_state(path: str | os.PathLike) -> DrainState:
    """The drain state of a local checkpoint: local, draining, mirrored, failed (or uncommitted,
    or stock DCP: a directory of DCP's FileSystemWriter)."""
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    key, why = _local_save_key(path)
    if key is None and committed_kind(path, (DCP,)) and not os.path.lexists(os.path.join(path, MANIFEST)):
        return DrainState(FOREIGN, cause=f"a stock DCP checkpoint, written by DCP's FileSystemWriter "
                          f"({DCP_MARKER}), not by dcp_nvme: it has no drain; to mirror it convert it first: "
                          f"dcp-nvme convert {path} OUT --to nvme")
    if key is None:
        return DrainState(UNCOMMITTED, cause=why)
    doc = load_journal(path)
    if doc is None or doc.get("save_key") != key:
        return DrainState(LOCAL)
    if doc.get("state") == MIRRORED and doc.get("version") != JOURNAL_VERSION:
        return DrainState(LOCAL, doc.get("target"), "mirrored by an older dcp_nvme that did not confirm "
                          "the target; run `dcp-nvme drain` to confirm it (nothing confirmed is resent)")
    coded = doc.get("compression") if doc.get("state") == MIRRORED else None
    delta = coded.get("delta") if isinstance(coded, dict) else None
    try:
        return DrainState(
            str(doc.get("state", LOCAL)), doc.get("target"), str(doc.get("cause", "")),
            int(doc.get("bytes_sent", 0)), int(doc.get("bytes_total", 0)),
            int(doc.get("attempts", 0)), doc.get("updated_unix"),
            doc.get("pid") if isinstance(doc.get("pid"), int) else None,
            delta if isinstance(delta, dict) else None,
            doc["restored_from"] if isinstance(doc.get("restored_from"), str) else None,
        )
    except (TypeError, ValueError):
        return DrainState(LOCAL, cause=f"{JOURNAL} is malformed")


def journal_options(path: str | os.PathLike) -> dict[str, Any]:
    """The storage options (without credentials) the journal of ``path`` kept for its target;
    {} when none (or the entry is not an object of option names)."""
    kept = (load_journal(path) or {}).get(OPTIONS)
    return kept if isinstance(kept, dict) and all(isinstance(k, str) for k in kept) else {}


def journal_restored(path: str, target: str, save_key: str, storage_options: dict[str, Any] | None) -> None:
    """``path`` was restored from its mirror at ``target`` (its manifest came from there): the
    mirror holds this save, so the step is journaled as mirrored, as a drain would have left
    it (retention may remove it, ``dcp-nvme drain PATH`` confirms it with no ``--to``). Its
    files are confirmed on the target by the next drain, never taken on trust."""
    doc = {"version": JOURNAL_VERSION, "target": target, "save_key": save_key, "state": MIRRORED,
           "cause": "", "files": {}, "bytes_sent": 0, "bytes_total": 0, "attempts": 0,
           "restored_from": target, "updated_unix": time.time()}
    if storage_options:
        doc[OPTIONS] = without_credentials(storage_options)
    LocalStore(path).write_atomic(JOURNAL, json.dumps(doc).encode())


class DrainBusy(RuntimeError):
    """Another drain of the same checkpoint holds its lock."""


@contextmanager
def drain_lock(path: str | os.PathLike, target: str) -> Iterator[None]:
    """Hold ``<checkpoint>/.drain.lock`` (flock, exclusive, non-blocking) for one drain.

    A second drain of the checkpoint, from any process, fails at once with DrainBusy naming
    the holder's pid and target. The kernel drops the lock when its holder dies, so a killed
    drain never leaves the checkpoint locked. Where the filesystem has no flock (a Lustre
    mount without ``-o flock``) the drain runs unlocked, with a warning.

    A directory without a manifest (empty, a stock DCP checkpoint, a save that never
    committed) has nothing to drain: CheckpointNotFoundError says why, and no lock file is
    left in a directory that is not a dcp_nvme checkpoint.
    """
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    if not os.path.lexists(os.path.join(path, MANIFEST)):  # one in any form: the drain says what is wrong
        raise missing_manifest_error(LocalStore(path), os.fspath(path))
    lock_path = os.path.join(path, LOCK)
    fd = create_no_follow(lock_path, os.O_RDWR)  # a planted link is refused, never written through
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            raise DrainBusy(f"another drain of {path} is running (holder: {holder}); wait for it to "
                            "finish or stop that process, then drain again") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            log.warning("dcp_nvme: %s: no file locks here (%s); draining without the drain lock", lock_path, exc)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}, draining to {target}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


class Journal:
    """The journal of one drain, shared by its transfer threads (every update is saved)."""

    def __init__(self, path: str, doc: dict[str, Any]) -> None:
        self.store = LocalStore(path)
        self.doc = doc
        self.lock = threading.RLock()

    @classmethod
    def open(cls, path: str, target: str, save_key: str, storage_options: dict[str, Any] | None = None) -> Journal:
        """The existing journal when it describes this save and target, else a fresh one. It
        keeps ``storage_options`` without credentials (``config.without_credentials``): a later
        ``dcp-nvme drain PATH`` needs only those given again."""
        doc = load_journal(path)
        if (doc is None or doc.get("version") != JOURNAL_VERSION or doc.get("save_key") != save_key
                or doc.get("target") != target or not isinstance(doc.get("files"), dict)):
            doc = {"version": JOURNAL_VERSION, "target": target, "save_key": save_key, "state": LOCAL,
                   "cause": "", "files": {}, "bytes_sent": 0, "bytes_total": 0, "attempts": 0}
        if storage_options:
            doc[OPTIONS] = without_credentials(storage_options)
        for counter in ("bytes_sent", "bytes_total", "attempts"):  # counters only: never trusted
            if not isinstance(doc.get(counter), int):
                doc[counter] = 0
        return cls(path, doc)

    def file(self, name: str) -> dict[str, Any]:
        """The entry of one data file: ``part_size``, ``pieces`` {index: {offset, length, tag}},
        ``upload_id`` on S3, ``done`` once complete on the target."""
        with self.lock:
            entry = self.doc["files"].get(name)
            if not isinstance(entry, dict) or not isinstance(entry.get("pieces"), dict):
                entry = self.doc["files"][name] = {"done": False, "pieces": {}}
            return entry

    def update(self, **fields: Any) -> None:
        with self.lock:
            self.doc.update(fields)
            self.save()

    def piece_done(self, name: str, piece: Piece, tag: str = "") -> None:
        """Record that ``piece`` of ``name`` is durable on the target (call after, never before)."""
        with self.lock:
            self.file(name)["pieces"][str(piece.index)] = piece_entry(piece, tag)
            self.doc["bytes_sent"] = self.doc.get("bytes_sent", 0) + piece.length
            self.save()

    def save(self) -> None:
        with self.lock:
            self.doc["updated_unix"] = time.time()
            self.store.write_atomic(JOURNAL, json.dumps(self.doc).encode())
