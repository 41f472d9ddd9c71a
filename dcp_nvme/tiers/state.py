"""The drain journal: ``<checkpoint>/.drain.json``, rewritten atomically after every piece.

It names the target, the save key it describes, the state (``draining``, ``mirrored``,
``failed``), the last cause, and per data file which pieces have reached the target (plus the
multipart upload id and part ETags on S3), so a drain that died resumes where it stopped.
A checkpoint with no journal (or one about another save or target) is in state ``local``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import CheckpointNotFoundError
from ..manifest import MANIFEST, MAX_MANIFEST
from ..store import LocalStore, read_regular

JOURNAL = ".drain.json"
LOCAL, DRAINING, MIRRORED, FAILED, UNCOMMITTED = "local", "draining", "mirrored", "failed", "uncommitted"


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


def _local_save_key(path: str | os.PathLike) -> str | None:
    try:
        doc = json.loads(read_regular(os.path.join(path, MANIFEST), MAX_MANIFEST))  # no FIFO, no link
        return doc.get("save_key") if isinstance(doc, dict) else None
    except (FileNotFoundError, ValueError):
        return None


def drain_state(path: str | os.PathLike) -> DrainState:
    """The drain state of a local checkpoint: local, draining, mirrored, failed (or uncommitted)."""
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    key = _local_save_key(path)
    if key is None:
        return DrainState(UNCOMMITTED, cause="no committed manifest.json")
    doc = load_journal(path)
    if doc is None or doc.get("save_key") != key:
        return DrainState(LOCAL)
    return DrainState(
        doc.get("state", LOCAL), doc.get("target"), doc.get("cause", ""),
        int(doc.get("bytes_sent", 0)), int(doc.get("bytes_total", 0)),
        int(doc.get("attempts", 0)), doc.get("updated_unix"), doc.get("pid"),
    )


class Journal:
    """The journal of one drain, shared by its transfer threads (every update is saved)."""

    def __init__(self, path: str, doc: dict[str, Any]) -> None:
        self.store = LocalStore(path)
        self.doc = doc
        self.lock = threading.RLock()

    @classmethod
    def open(cls, path: str, target: str, save_key: str) -> Journal:
        """The existing journal when it describes this save and target, else a fresh one."""
        doc = load_journal(path)
        if doc is None or doc.get("save_key") != save_key or doc.get("target") != target:
            doc = {"target": target, "save_key": save_key, "state": LOCAL, "cause": "",
                   "files": {}, "bytes_sent": 0, "bytes_total": 0, "attempts": 0}
        return cls(path, doc)

    def file(self, name: str) -> dict[str, Any]:
        with self.lock:
            return self.doc["files"].setdefault(name, {"done": False, "pieces": {}})

    def update(self, **fields: Any) -> None:
        with self.lock:
            self.doc.update(fields)
            self.save()

    def piece_done(self, name: str, index: int, nbytes: int, tag: str = "") -> None:
        with self.lock:
            self.file(name)["pieces"][str(index)] = tag
            self.doc["bytes_sent"] = self.doc.get("bytes_sent", 0) + nbytes
            self.save()

    def save(self) -> None:
        with self.lock:
            self.doc["updated_unix"] = time.time()
            self.store.write_atomic(JOURNAL, json.dumps(self.doc).encode())
