"""One save committed on the disk of every node, when nodes do not share the directory.

DCP calls ``finish()`` on the coordinator only; the other ranks wait meanwhile in DCP's broadcast
of its outcome and get no call after it. So each node whose directory the coordinator cannot
see (``host.job``) has one *node writer* rank, which starts a thread in ``write_data`` that
commits that node's copy of the metadata, and the coordinator's ``finish`` runs the rounds
below with those threads over the job's key-value store (the one ``init_process_group`` made;
keys are named by the save key, so a round of a failed save can never be mistaken for another):

  1. coordinator  tables written, manifest prepared (temp name, fsynced) on its own node;
                  ``meta``: the manifest and both tables
  2. node writer  its node holds each of its ranks' data files at the size the manifest says;
                  tables written, manifest prepared; ``vote/<rank>``: ok, or what is wrong
  3. coordinator  every vote ok: ``decision`` commit, then its own manifest renamed into place;
                  else ``decision`` abort, its temps removed, SaveError naming the nodes
  4. node writer  commit: manifest renamed into place, files of other saves removed; abort:
                  this save's files on the node removed; ``done/<rank>``
  5. coordinator  returns once every node said done: "saved" holds on every node's disk.

A save that fails before ``finish`` (a rank's write failed) never sends ``meta``: each node
writer's thread waits until the next save on its writer, ``timeout`` or the process's exit
(``settle``), then removes the save's files from its node; the coordinator's process removes
those on its own node at exit (``save_begins``). A crash between the first and the last rename
of step 3/4 (a few milliseconds) can leave nodes that disagree on the newest step;
docs/design.md says how a restart tells.
"""

from __future__ import annotations

import atexit
import json
import logging
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from dcp_nvme.errors import ManifestError, SaveError
from dcp_nvme.format.container import MANIFEST, check_name
from dcp_nvme.save.after_commit import AfterCommit
from dcp_nvme.storage.local_dir import (
    LocalStore,
    commit_prepared,
    discard_prepared,
    remove_save_files,
    write_commit_file,
    write_prepared,
)
from dcp_nvme.storage.save_lock import SaveLock

log = logging.getLogger(__name__)

TIMEOUT = 1800.0
"""Seconds a round waits for the other side when the store says no timeout: DCP's and gloo's
default collective timeout."""


def store_timeout(store: Any) -> float:
    """The job store's timeout, which ``init_process_group(timeout=...)`` sets: the rounds fail
    when the process group's collectives would, not later."""
    try:
        seconds = float(store.timeout.total_seconds())
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return TIMEOUT
    return seconds if 0 < seconds < 10 * TIMEOUT else TIMEOUT
_POLL_MAX = 0.2


# --------------------------------------------------------------------------- the payload (pure)


def encode_payload(manifest: bytes, tables: Sequence[tuple[str, bytes]]) -> bytes:
    """The manifest and the tables in one value: a JSON head (names, sizes), then the bytes."""
    head = json.dumps({"manifest": len(manifest), "tables": [[n, len(d)] for n, d in tables]}).encode()
    return struct.pack("<I", len(head)) + head + manifest + b"".join(d for _, d in tables)


def decode_payload(data: bytes, key: str) -> tuple[bytes, list[tuple[str, bytes]]]:
    """What ``encode_payload`` made, checked: it comes from another process."""
    try:
        (length,) = struct.unpack_from("<I", data)
        head = json.loads(data[4:4 + length])
        offset, sizes = 4 + length, [head["manifest"]] + [size for _, size in head["tables"]]
        if any(type(s) is not int or s < 0 for s in sizes) or offset + sum(sizes) != len(data):
            raise ValueError("sizes do not add up")
        manifest = data[offset:offset + head["manifest"]]
        offset += head["manifest"]
        tables = []
        for name, size in head["tables"]:
            kind = name.split(".", 1)[0]
            tables.append((check_name(name, kind, key, "the node commit"), data[offset:offset + size]))
            offset += size
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"the metadata sent for save {key} is malformed: {exc}") from None
    return manifest, tables


# --------------------------------------------------------------------------- waiting on the store


def _wait(store: Any, keys: Sequence[str], deadline: float, cancelled: threading.Event | None = None) -> bool:
    """Whether every key exists before ``deadline`` (and before ``cancelled``)."""
    pause = 0.005
    while True:
        if store.check(list(keys)):
            return True
        if time.monotonic() >= deadline or (cancelled is not None and cancelled.is_set()):
            return False
        if cancelled is not None:
            cancelled.wait(pause)  # a cancel (the process exits: its clean-up) wakes it at once
        else:
            time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)


def _get_all(store: Any, keys: Sequence[str]) -> dict[str, bytes]:
    return {key: store.get(key) for key in keys if store.check([key])}


# --------------------------------------------------------------------------- coordinator side


def commit_on_every_node(store: Any, directory: str, key: str, manifest: bytes,
                         tables: Sequence[tuple[str, bytes]], writers: dict[int, str], *,
                         timeout: float | None = None) -> None:
    """Steps 1, 3 and 5 on the coordinator (its tables already written). ``writers``: the
    node writer rank of each other node -> the node's name. Raises SaveError naming the nodes.
    Each round waits at most ``timeout``, by default the process group's (its store's)."""
    prefix = f"{key}/"
    timeout = store_timeout(store) if timeout is None else timeout
    write_prepared(directory, MANIFEST, manifest, key)
    store.set(prefix + "meta", encode_payload(manifest, tables))
    deadline = time.monotonic() + timeout
    votes = [f"{prefix}vote/{rank}" for rank in writers]
    _wait(store, votes, deadline)
    said = _get_all(store, votes)
    problems = {rank: said.get(f"{prefix}vote/{rank}", b"no answer within %d s" % timeout).decode(errors="replace")
                for rank in writers}
    problems = {rank: why for rank, why in problems.items() if why != "ok"}
    if problems:
        store.set(prefix + "decision", b"abort")
        discard_prepared(directory, MANIFEST, key)
        raise SaveError("the save could not be committed on every node, so it is committed on none: "
                        + "; ".join(f"node {writers[r]} (rank {r}): {why}" for r, why in sorted(problems.items())))
    store.set(prefix + "decision", b"commit")
    commit_prepared(directory, MANIFEST, key)
    done = [f"{prefix}done/{rank}" for rank in writers]
    _wait(store, done, deadline)
    said = _get_all(store, done)
    missing = {rank: said.get(f"{prefix}done/{rank}", b"no answer").decode(errors="replace")
               for rank in writers if said.get(f"{prefix}done/{rank}") != b"ok"}
    store.delete_key(prefix + "meta")  # the largest value; the rest are a few bytes
    if missing:
        raise SaveError(f"{directory}: save {key} is committed on the coordinator's node but not on "
                        + "; ".join(f"node {writers[r]} (rank {r}): {why}" for r, why in sorted(missing.items())))


def abort_everywhere(store: Any, key: str) -> None:
    """The coordinator's finish failed before the decision: release every node writer now."""
    try:
        store.set(f"{key}/meta", b"abort")
        store.set(f"{key}/decision", b"abort")
    except Exception as exc:  # noqa: BLE001  (the original failure is what the user must see)
        log.warning("dcp_nvme: could not tell the nodes that save %s failed: %s", key, exc)


# --------------------------------------------------------------------------- node writer side


_live: dict[str, NodeCommitter] = {}
_live_lock = threading.Lock()


EXIT_TIMEOUT = 60.0
"""Seconds interpreter exit waits, in all, for the node commits in their round to end."""


def settle(*, give_up_waiting: bool, timeout: float = EXIT_TIMEOUT) -> None:
    """Let this process's node commits end, for interpreter exit. Each committer in its round
    (it voted) runs to its end, for at most ``timeout`` s in all: it commits (and submits its
    node's drain), or removes an aborted save's files. With ``give_up_waiting`` (atexit: every
    save of this process has returned) one still waiting for its round gives up and removes its
    save's files from this node: that save failed on some rank (DCP skipped ``finish``), and
    nothing votes for this node once the process has ended."""
    with _live_lock:
        committers = list(_live.values())
    deadline = time.monotonic() + timeout
    for committer in committers:
        if give_up_waiting:
            committer.cancel_if_waiting()
        elif not committer._voted.is_set():
            continue
        committer.join(max(0.0, deadline - time.monotonic()))


# a job that exits right after a failed save leaves none of its files on this node
atexit.register(settle, give_up_waiting=True)


def end_waiting(directory: str) -> None:
    """End a committer of an earlier save of ``directory`` that still waits for its round: a new
    save there means the coordinator gave that one up. Returns once it has let go of the lock."""
    with _live_lock:
        earlier = _live.get(directory)
    if earlier is not None:
        earlier.cancel_if_waiting()
        earlier.join(60)


def start_committer(committer: NodeCommitter) -> NodeCommitter:
    with _live_lock:
        _live[committer.directory] = committer
    return committer.start()


class NodeCommitter:
    """Steps 2 and 4 for one save on one node writer rank, on a thread of its own; after a
    commit, the save's ``after_commit.AfterCommit`` under the node's save lock."""

    def __init__(self, store: Any, directory: str, key: str, rank: int, node: str,
                 after_commit: AfterCommit, lock: SaveLock, *, timeout: float = TIMEOUT) -> None:
        self.store, self.directory, self.key, self.rank, self.node = store, directory, key, rank, node
        self.after_commit, self.timeout = after_commit, timeout
        self.lock = lock
        """This node's save lock, held until the thread ends: the after-commit work runs under it."""
        self.cancelled = threading.Event()
        self._voted = threading.Event()
        self.outcome: str | None = None
        """``committed``, ``aborted`` or ``abandoned`` (no round came) once the thread ended."""
        self._thread = threading.Thread(target=self._serve, name=f"dcp-nvme-node-commit-{key}", daemon=True)

    def start(self) -> NodeCommitter:
        self._thread.start()
        return self

    def cancel_if_waiting(self) -> None:
        """Give up waiting for a round that will not come (this save failed elsewhere); a round
        under way (voted) runs to its end."""
        if not self._voted.is_set():
            self.cancelled.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _serve(self) -> None:
        prefix = f"{self.key}/"
        try:
            deadline = time.monotonic() + self.timeout
            if not _wait(self.store, [prefix + "meta"], deadline, self.cancelled):
                self.outcome = "abandoned"
                return
            meta = self.store.get(prefix + "meta")
            self._voted.set()
            problem = "aborted by the coordinator" if meta == b"abort" else self._prepare(meta)
            self.store.set(f"{prefix}vote/{self.rank}", b"ok" if problem is None else problem.encode())
            if not _wait(self.store, [prefix + "decision"], deadline):
                self.outcome = "abandoned"
                return
            if self.store.get(prefix + "decision") == b"commit" and problem is None:
                commit_prepared(self.directory, MANIFEST, self.key)
                self.outcome = "committed"
                self.store.set(f"{prefix}done/{self.rank}", b"ok")
                try:
                    self.after_commit.run(self.key, self.lock)
                except Exception as exc:  # noqa: BLE001  the save is committed: what follows must not undo it
                    log.error("dcp_nvme: node %s: save %s is committed, but what follows a commit (drain, "
                              "replication) failed: %s", self.node, self.key, exc)
            else:
                self.outcome = "aborted"
        except Exception as exc:  # noqa: BLE001  (a thread's failure is reported through the store)
            log.error("dcp_nvme: node %s: committing save %s failed: %s", self.node, self.key, exc)
            if self.outcome != "committed":  # a committed copy is never removed
                self.outcome = "aborted"
            try:
                self.store.set(f"{prefix}done/{self.rank}", f"{type(exc).__name__}: {exc}".encode())
            except Exception:  # noqa: BLE001
                pass
        finally:
            if self.outcome != "committed":
                remove_save_files(self.directory, self.key)
            self.lock.release()
            with _live_lock:
                if _live.get(self.directory) is self:
                    del _live[self.directory]

    def _prepare(self, meta: bytes) -> str | None:
        """Step 2: None when this node's copy is prepared, else what is wrong."""
        try:
            manifest, tables = decode_payload(meta, self.key)
            doc = json.loads(manifest)
            problem = _missing_here(self.directory, doc, self.node)
            if problem:
                return problem
            for name, data in tables:
                write_commit_file(self.directory, name, data, self.key)
            write_prepared(self.directory, MANIFEST, manifest, self.key)
        except Exception as exc:  # noqa: BLE001  (the vote carries it to the coordinator)
            return f"{type(exc).__name__}: {exc}"
        return None


def _missing_here(directory: str, doc: dict[str, Any], node: str) -> str | None:
    """Whether ``directory`` holds every data file the manifest places on ``node``, at its size."""
    topology = doc.get("topology") or {}
    nodes, rank_nodes = topology.get("nodes", []), topology.get("rank_nodes", [])
    store = LocalStore(directory)
    wrong = []
    for entry in doc.get("files", []):
        rank = entry.get("rank")
        if not (isinstance(rank, int) and 0 <= rank < len(rank_nodes) and nodes[rank_nodes[rank]] == node):
            continue
        try:
            size = store.size(entry["name"])
        except (OSError, ManifestError):
            size = None
        if size != entry.get("size"):
            wrong.append(f"{entry['name']} ({'missing' if size is None else f'{size} bytes'}, "
                         f"the manifest says {entry.get('size')})")
    if wrong:
        return f"{directory} lacks data files of this node: {', '.join(wrong[:4])}"
    return None
