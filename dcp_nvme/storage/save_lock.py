"""One save at a time per checkpoint directory: ``<dir>/.save.lock``.

The rule (docs/design.md, "One save at a time"):

- The coordinator creates the lock file with ``O_CREAT | O_EXCL`` in ``prepare_global_plan``,
  before any rank writes a byte. It names the holder: host, pid, save key, since when. A save
  that finds it held fails at once with :class:`CheckpointLockedError` (DCP hands that error to
  every rank, so no rank hangs). The lock is released after the commit and its cleanup, or
  when the save fails on the coordinator.
- A held lock is *stale*, and is broken by the next save, when
    * its holder ran in this pid namespace of this host (same boot) and that pid is gone, a
      zombie, or now another process (its start time differs);
    * its holder is this very process and no live save of this process holds it (a save that
      failed on another rank: DCP never tells the coordinator's writer);
    * its holder is on another host (or in another container) and its heartbeat, the lock
      file's mtime, which the holder refreshes every ``HEARTBEAT_S`` seconds, is older than
      ``STALE_AFTER_S``. Clocks of the hosts must agree to within a minute or so.
    * it is a regular file that does not parse as a lock (a creator killed before it wrote,
      or forged) and its mtime is older than ``STALE_AFTER_S``: until then it is not provably
      held, but may be a lock being created.
  Anything else is live. An entry that is not a regular file (a FIFO, link, directory) is no
  save's: it is never opened through (it could hang or lead out) and a save refuses it.
  ``dcp-nvme unlock DIR`` breaks a stale lock and removes such an entry (never a link's target),
  and with ``--force`` any lock (the operator vouches that its save is dead).

The lock file is not fsynced: live processes see it through the page cache (an NFS client
flushes it at close), and after a crash its holder is dead anyway: a lock that survived whole
is stale by the rule above, one that did not (empty or gone) is unreadable and stale by its age.

``O_EXCL`` creation is atomic on local filesystems, NFSv3+ and Lustre (unlike ``flock``, which
some NFS clients keep local to one host); breaking a lock renames it away first and checks it
took the lock it judged stale (putting back one taken meanwhile). Before its commit and before
its cleanup a save checks the lock is still its own, so even a lock lost in a race of breakers
costs a failed save, never a mixed directory.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import secrets
import socket
import stat
import threading
import time
import weakref
from dataclasses import asdict, dataclass

from dcp_nvme.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    LockFileError,
    ManifestError,
    StorageError,
)
from dcp_nvme.host.files import file_kind, open_regular

log = logging.getLogger(__name__)

LOCK_NAME = ".save.lock"
HEARTBEAT_S = 30.0
"""How often a holder refreshes its lock file's mtime."""
STALE_AFTER_S = 300.0
"""A lock of another host (or an unreadable one) whose mtime is older than this is stale."""
MAX_LOCK_BYTES = 64 * 1024
"""A save lock is one short JSON line: a longer file is not one and is never read."""
PID_MAX = 2**31 - 1
"""The largest pid_t: a lock naming a larger (or non-positive) pid names no process."""
LATEST_UNIX = 1e11
"""Seconds since the epoch past which a lock's ``since_unix`` is not a time (year 5138)."""


# --------------------------------------------------------------------------- who holds it


def _read_text(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _pid_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), to tell a reused pid; Linux only."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rpartition(")")[2].split()
    return int(fields[19]) if len(fields) > 19 else None


def _pid_space() -> str:
    """Processes are comparable by pid only within one pid namespace of one boot of one host."""
    boot = _read_text("/proc/sys/kernel/random/boot_id") or ""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}|{boot}|{namespace}"


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about the save holding it."""

    host: str
    pid: int
    save_key: str
    since_unix: float
    token: str
    pid_space: str
    pid_start: int | None
    heartbeat_unix: float = 0.0
    """The lock file's mtime (refreshed by the holder), not part of its contents."""

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.since_unix, datetime.timezone.utc)
        return (f"host {self.host}, pid {self.pid}, save key {self.save_key}, "
                f"since {since.isoformat(timespec='seconds')}")

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc.pop("heartbeat_unix")
        return json.dumps(doc).encode()


def read_holder(directory: str | os.PathLike) -> LockHolder | None:
    """The holder named by ``directory``'s lock file; None when there is no lock file.

    Raises LockFileError (a ValueError) when something else is there: a FIFO, link, directory
    or device (never opened through, so it cannot hang or lead out), or a file that does not
    parse (torn by a crash, or foreign), read no further than ``MAX_LOCK_BYTES``."""
    path = os.path.join(directory, LOCK_NAME)
    read = _read_lock(path)
    return None if read is None else _parse(*read, path)


def _read_lock(path: str) -> tuple[bytes, float] | None:
    """The lock file's bytes and mtime; None when there is none."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except ManifestError:
        raise LockFileError(f"{path} is {_entry_kind(path)}, not a save lock (a save creates a regular "
                            "file)", regular=False) from None
    try:
        info = os.fstat(fd)
        if info.st_size > MAX_LOCK_BYTES:
            raise LockFileError(f"{path} does not parse as a save lock: it has {info.st_size} bytes, more "
                                f"than the {MAX_LOCK_BYTES} one may have", regular=True)
        return os.pread(fd, MAX_LOCK_BYTES, 0), info.st_mtime
    finally:
        os.close(fd)


def _entry_kind(path: str) -> str:
    try:
        return file_kind(os.lstat(path).st_mode)
    except FileNotFoundError:
        return "gone"


def _parse(data: bytes, mtime: float, path: str) -> LockHolder:
    try:
        doc = json.loads(data)
        holder = LockHolder(
            host=str(doc["host"]), pid=_pid(doc["pid"]), save_key=str(doc["save_key"]),
            since_unix=_unix_time(doc["since_unix"]), token=str(doc["token"]),
            pid_space=str(doc["pid_space"]),
            pid_start=None if doc.get("pid_start") is None else _count(doc["pid_start"], "pid_start"),
            heartbeat_unix=mtime,
        )
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        raise LockFileError(f"{path} does not parse as a save lock ({exc.__class__.__name__}: "
                            f"{str(exc)[:200]}): a crash while it was being created, or not ours",
                            regular=True) from None
    return holder


def _count(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} {str(value)[:40]} is not a count")
    return value


def _pid(value: object) -> int:
    pid = _count(value, "pid")  # value itself, checked to be an int
    if not 0 < pid <= PID_MAX:
        raise ValueError(f"pid {value} is not a process id")
    return pid


def _unix_time(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 <= value <= LATEST_UNIX):
        raise ValueError(f"since_unix {str(value)[:40]} is not a time")
    return float(value)


def _process_gone(pid: int, start: int | None) -> str | None:
    """Why ``pid`` is no longer the process that took the lock, or None if it still is."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} is gone"
    except PermissionError:
        pass  # alive, another user's
    stat = _read_text(f"/proc/{pid}/stat")
    if stat and stat.rpartition(")")[2].split()[:1] == ["Z"]:
        return f"pid {pid} has exited (zombie)"
    now_start = _pid_start(pid)
    if start is not None and now_start is not None and now_start != start:
        return f"pid {pid} is now another process"
    return None


def stale_reason(holder: LockHolder, now: float | None = None) -> str | None:
    """Why ``holder``'s lock is stale by the documented rule, or None when it is live."""
    if holder.pid_space == _pid_space():
        if holder.pid == os.getpid():
            return None if _held_here(holder.token) else "no save of this process holds it any more"
        return _process_gone(holder.pid, holder.pid_start)
    age = (time.time() if now is None else now) - holder.heartbeat_unix
    if age > STALE_AFTER_S:
        return f"its holder on {holder.host} last refreshed it {age:.0f} s ago (> {STALE_AFTER_S:.0f} s)"
    return None


# --------------------------------------------------------------------------- the locks this process holds

_HELD: dict[str, weakref.ref] = {}
_HELD_GUARD = threading.Lock()
_BEAT: threading.Thread | None = None


def _held_here(token: str) -> bool:
    with _HELD_GUARD:
        ref = _HELD.get(token)
    lock = ref() if ref else None
    return lock is not None and not lock.released


def beat_all() -> None:
    """Refresh the heartbeat of every lock this process holds (the heartbeat thread's step)."""
    with _HELD_GUARD:
        locks = [ref() for ref in _HELD.values()]
    for lock in locks:
        if lock is not None and not lock.released:
            lock.beat()


def _beat_forever() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            beat_all()
        except Exception:  # a heartbeat must never kill the thread
            log.exception("dcp_nvme: save lock heartbeat failed")


def _start_heartbeat() -> None:
    global _BEAT
    with _HELD_GUARD:
        if _BEAT is None or not _BEAT.is_alive():
            _BEAT = threading.Thread(target=_beat_forever, name="dcp_nvme-lock-heartbeat", daemon=True)
            _BEAT.start()


class SaveLock:
    """A held lock on one checkpoint directory. Released explicitly, or when garbage collected
    (a writer dropped after a save that failed elsewhere) or at interpreter exit."""

    def __init__(self, directory: str, holder: LockHolder) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.holder = holder
        self.released = False
        self._finalizer = weakref.finalize(self, _release_file, self.path, holder.token, holder.pid)

    @property
    def save_key(self) -> str:
        return self.holder.save_key

    def held(self) -> bool:
        """True while the lock file is still ours (nobody broke it)."""
        try:
            current = read_holder(self.directory)
        except ValueError:
            return False
        return not self.released and current is not None and current.token == self.holder.token

    def beat(self) -> None:
        now = time.time()
        try:
            os.utime(self.path, (now, now), follow_symlinks=False)  # our clock; never a swapped-in link's target
        except FileNotFoundError:
            log.warning("dcp_nvme: the save lock %s vanished while held", self.path)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._finalizer()

    def __repr__(self) -> str:
        return f"SaveLock({self.path!r}, {self.holder.describe()})"


def _release_file(path: str, token: str, pid: int) -> None:
    with _HELD_GUARD:
        _HELD.pop(token, None)
    if os.getpid() == pid:  # a forked child exiting never releases its parent's lock
        _take_away(path, token, why="released")


def _take_away(path: str, token: str | None, why: str) -> bool:
    """Remove the lock at ``path`` if it is still the one with ``token`` (None: whatever it is).

    Renames it to a unique name first, then checks what it took: a lock created in between by
    someone else is put back, so a stale lock is broken once, never a live one."""
    aside = f"{path}.{secrets.token_hex(4)}.{why}"
    try:
        os.rename(path, aside)  # a link is renamed itself, never its target
    except FileNotFoundError:
        return False
    try:
        read = _read_lock(aside)
        taken = _parse(*read, path).token if read else None
    except (OSError, ValueError):
        taken = None
    if token is not None and taken != token:
        try:
            os.link(aside, path)  # not ours: put it back unless a newer lock exists already
        except OSError:
            pass
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True


def _create(path: str, holder: LockHolder) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, holder.to_json())  # no fsync: the lock matters to live processes only (see above)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def acquire(directory: str | os.PathLike, save_key: str) -> SaveLock:
    """Take the save lock of ``directory`` for the save ``save_key``, breaking a stale one.

    Raises CheckpointLockedError naming the directory and the live holder."""
    directory = os.fspath(directory)
    path = os.path.join(directory, LOCK_NAME)
    me = LockHolder(
        host=socket.gethostname(), pid=os.getpid(), save_key=save_key, since_unix=time.time(),
        token=secrets.token_hex(8), pid_space=_pid_space(), pid_start=_pid_start(os.getpid()),
    )
    for _ in range(5):  # each round either takes the lock, fails, or removed a stale one
        try:
            _create(path, me)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot create the save lock {path}: {exc.strerror}") from exc
        else:
            lock = SaveLock(directory, me)
            lock.beat()  # the mtime by our clock, not the file server's, from the start
            with _HELD_GUARD:
                _HELD[me.token] = weakref.ref(lock)
            _start_heartbeat()
            return lock
        _break_if_stale(directory, path)
    raise CheckpointLockedError(f"{directory}: could not take the save lock {path}: other saves "
                                "keep taking it; only one save at a time may write a directory")


def _break_if_stale(directory: str, path: str) -> None:
    """Return when the lock is gone or was stale and is now removed; raise if it is live."""
    try:
        holder = read_holder(directory)
    except LockFileError as exc:
        age = _age(path)
        if age is None:
            return
        if not exc.regular or age <= STALE_AFTER_S:
            raise CheckpointLockedError(_malformed_message(directory, exc, age)) from None
        _take_away(path, None, "stale")
        log.warning("dcp_nvme: removed an unreadable stale save lock %s", path)
        return
    if holder is None:
        return
    reason = stale_reason(holder)
    if reason is None:
        raise CheckpointLockedError(_locked_message(directory, holder))
    if _take_away(path, holder.token, "stale"):
        log.warning("dcp_nvme: broke the stale save lock of %s (%s): %s", directory,
                    holder.describe(), reason)


def _age(path: str) -> float | None:
    """Seconds since the entry at ``path`` (a link itself, not its target) was written."""
    try:
        return time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return None


def _malformed_message(directory: str, exc: LockFileError, age: float) -> str:
    """Why a save (or a plain unlock) leaves an entry that is not a readable lock in place."""
    if not exc.regular:
        return (f"{directory} cannot be saved: {exc}. It is not provably held by any save, but a save does not "
                f"remove what no save created: check who put it there, then `dcp-nvme unlock {directory}` "
                "removes it (the entry itself, never what a link points to)")
    return (f"{directory} is locked by a save lock that cannot be read ({exc}). It is not provably held "
            f"by any save, but a save creating its lock may not have written it yet, so it counts as "
            f"live until {STALE_AFTER_S:.0f} s after it was written ({age:.0f} s ago). If no save is "
            f"running there, run `dcp-nvme unlock --force {directory}`")


def _locked_message(directory: str, holder: LockHolder) -> str:
    if holder.pid_space == _pid_space() and holder.pid == os.getpid():
        who = "another save of this same process"
    elif holder.pid_space == _pid_space():
        who = "another save on this host"
    else:
        who = (f"a save on another host (its lock counts as stale {STALE_AFTER_S:.0f} s after its "
               f"last heartbeat, {time.time() - holder.heartbeat_unix:.0f} s ago)")
    return (f"{directory} is being saved by {who}: {holder.describe()}. Only one save at a time "
            "may write a checkpoint directory: wait for it to finish or save elsewhere. If that "
            f"save is dead, `dcp-nvme unlock {directory}` (or `--force`) removes its lock.")


def unlock(directory: str | os.PathLike, *, force: bool = False) -> tuple[LockHolder | None, str]:
    """Remove ``directory``'s save lock if stale (any lock with ``force``).

    Returns the holder that was removed (None if there was no lock or it was unreadable) and
    why; raises CheckpointLockedError for a live lock without ``force``, and for a lock that
    does not parse and is younger than ``STALE_AFTER_S`` (it may be a save's being created)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):  # "not locked" would pass a mistyped path as unlocked
        kind = _entry_kind(directory)
        what = "it does not exist" if kind == "gone" else f"it is {kind}"
        raise CheckpointNotFoundError(f"{directory} is not a directory ({what}): there is no save lock to "
                                      "remove; give the checkpoint directory the save was writing")
    path = os.path.join(directory, LOCK_NAME)
    try:
        holder = read_holder(directory)
    except LockFileError as exc:
        return None, _remove_malformed(directory, path, exc, force)
    if holder is None:
        return None, "not locked"
    reason = stale_reason(holder)
    if reason is None and not force:
        raise CheckpointLockedError(_locked_message(directory, holder).replace(
            f"`dcp-nvme unlock {directory}` (or `--force`)", f"`dcp-nvme unlock --force {directory}`"))
    if not _take_away(path, holder.token, "forced" if reason is None else "stale"):
        return None, "the lock changed meanwhile; run again"
    return holder, reason or "forced"


def _remove_malformed(directory: str, path: str, exc: LockFileError, force: bool) -> str:
    """Remove what is at the lock's name but is not a readable lock: anything that is not a
    regular file (no save creates one), a regular file when ``force`` or stale by its age. A
    link goes, never its target; a directory only when empty."""
    try:
        entry = os.lstat(path)
    except FileNotFoundError:
        return "not locked"
    if exc.regular and not force and time.time() - entry.st_mtime <= STALE_AFTER_S:
        raise CheckpointLockedError(_malformed_message(directory, exc, time.time() - entry.st_mtime))
    if stat.S_ISDIR(entry.st_mode):  # renaming aside and unlinking is for files
        try:
            os.rmdir(path)
        except OSError as error:
            raise CheckpointLockedError(f"{path} is a directory that is not empty ({error.strerror}), not a "
                                        "save lock: check what it holds and remove it yourself") from None
    elif not _take_away(path, None, "forced" if force else "stale"):
        return "not locked"
    return f"removed {file_kind(entry.st_mode)} that was not a readable save lock: {exc}"
