"""A checkpoint's location and the small-file side of its directory: which locations a reader
or writer takes (``reader_location``, ``writer_location``: local path or URL), and a local
directory's list, read, remove and all-or-nothing write (``LocalStore``, ``write_commit_file``).

Bulk data goes through an engine; this is for the manifest, the index and cleanup. The file
primitives under it (no link followed, no FIFO opened) are ``host.files``.
"""

from __future__ import annotations

import atexit
import os
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from dcp_nvme.config import check_url
from dcp_nvme.errors import (
    InvalidInputError,
    SaveError,
    StorageError,
)
from dcp_nvme.format.container import (
    MANIFEST,
    RANGES_DIR,
    REPLICAS_DIR,
    SPANS_SUFFIX,
    save_key_of,
    temp_name,
    temp_of,
)
from dcp_nvme.host.files import (
    bare_name,
    create_no_follow,
    fsync_dir,
    list_below,
    not_regular,
    open_regular,
    read_regular,
    remove_below,
    unlink_below,
    unlink_quietly,
    write_file_fresh,
)


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
    def has(self, name: str) -> bool:
        """Whether ``name`` is a regular file here (a FIFO, device or link is not)."""
        ...
    def names(self) -> list[str]: ...
    def read(self, name: str, max_size: int | None = None) -> bytes:
        """The whole file; a ManifestError when it is not a regular file or over ``max_size``."""
        ...
    def size(self, name: str) -> int: ...

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; returns the bytes read (fewer at end of file)."""
        ...


class LocalStore:
    """A checkpoint directory on a local (or locally mounted) filesystem."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.location = os.fspath(root)  # as the user wrote it, for messages

    def path(self, name: str) -> str:
        return str(self.root / bare_name(name))

    def exists(self) -> bool:
        return self.root.is_dir()

    def has(self, name: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.path(name)).st_mode)
        except OSError:
            return False

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []

    def read(self, name: str, max_size: int | None = None) -> bytes:
        return read_regular(self.path(name), max_size)

    def size(self, name: str) -> int:
        path = self.path(name)
        mode = os.lstat(path)
        if not stat.S_ISREG(mode.st_mode):
            raise not_regular(path, mode.st_mode)
        return mode.st_size

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        fd = open_regular(self.path(name))
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
        temp = self.root / f".{bare_name(name)}.tmp-{os.getpid()}"
        write_file_fresh(temp, data)  # a link planted under the temp name is removed, never followed
        os.replace(temp, final)
        fsync_dir(self.root)

    def remove(self, name: str) -> None:
        try:
            (self.root / name).unlink()
        except FileNotFoundError:
            pass

    def sync(self) -> None:
        fsync_dir(self.root)


def write_commit_file(directory: str | os.PathLike, name: str, data: bytes, save_key: str) -> None:
    """Write ``directory/name`` all or nothing: temp file, write, fsync, rename, fsync of the dir.

    A failure removes the temp file and raises StorageError naming the file and the step (the
    errno is kept: ENOSPC stays ENOSPC). Until the rename nothing under ``name`` changed."""
    write_prepared(directory, name, data, save_key)
    commit_prepared(directory, name, save_key)


def write_prepared(directory: str | os.PathLike, name: str, data: bytes, save_key: str) -> str:
    """The first half of ``write_commit_file``: ``data`` durable under the temp name of ``name``
    (which names the save), nothing under ``name`` changed. Returns the temp path."""
    directory = os.fspath(directory)
    temp = os.path.join(directory, temp_name(name, save_key))
    step = "create"
    try:
        fd = create_no_follow(temp, os.O_WRONLY, fresh=True)
        try:
            step = "write"
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            step = "fsync"
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        unlink_quietly(temp)
        raise StorageError(exc.errno, f"cannot {step} {temp} while saving: {exc.strerror or exc}") from exc
    return temp


def commit_prepared(directory: str | os.PathLike, name: str, save_key: str) -> None:
    """The second half: the prepared temp file renamed into place, then the directory fsynced."""
    directory = os.fspath(directory)
    temp = os.path.join(directory, temp_name(name, save_key))
    final = os.path.join(directory, name)
    try:
        os.replace(temp, final)
    except OSError as exc:
        unlink_quietly(temp)
        raise StorageError(exc.errno, f"cannot rename into place {final} while saving: "
                                      f"{exc.strerror or exc}") from exc
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise StorageError(exc.errno, f"{final} was renamed into place but the fsync of {directory} "
                                      f"failed: {exc.strerror or exc}; it may not survive a power loss") from exc


def write_commit_files(directory: str | os.PathLike, files: list[tuple[str, bytes]], save_key: str,
                       owed: Sequence[str] = ()) -> None:
    """Write ``files`` all or nothing, the last one the commit (the manifest): each under its
    temp name, all fsynced together with the files at the paths ``owed`` (data files whose
    fsync was deferred to the commit: ``engines.small``), then the renames in order and one
    fsync of the directory.

    The durability rule (docs/design.md, "Durability rule"): every file's bytes are fsynced before
    the rename that makes the last one visible, and the directory once after it. The fsyncs run
    at once, so the filesystem joins them into one journal commit rather than one each. A
    failure removes every temp file and raises StorageError naming the file and the step."""
    directory = os.fspath(directory)
    temps = [os.path.join(directory, temp_name(name, save_key)) for name, _ in files]
    try:
        fds: list[int] = []
        try:
            for temp, (_, data) in zip(temps, files):
                step, path = "create", temp
                fds.append(create_no_follow(temp, os.O_WRONLY, fresh=True))
                step, view = "write", memoryview(data)
                while view:
                    view = view[os.write(fds[-1], view):]
            for path in owed:
                step = "open"
                fds.append(open_regular(path))
            failures = _fsync_together(fds)
            if failures:
                index, exc = failures[0]
                step, path = "fsync", [*temps, *owed][index]
                raise exc
        finally:
            for fd in fds:
                os.close(fd)
    except OSError as exc:
        for temp in temps:
            unlink_quietly(temp)
        raise StorageError(exc.errno, f"cannot {step} {path} while saving: {exc.strerror or exc}") from exc
    for temp, (name, _) in zip(temps[:-1], files[:-1]):
        try:
            os.replace(temp, os.path.join(directory, name))
        except OSError as exc:
            for leftover in temps:
                unlink_quietly(leftover)
            raise StorageError(exc.errno, f"cannot rename into place {os.path.join(directory, name)} while "
                                          f"saving: {exc.strerror or exc}") from exc
    commit_prepared(directory, files[-1][0], save_key)


def _fsync_together(fds: list[int]) -> list[tuple[int, OSError]]:
    """fsync every one of ``fds`` at once (the first on this thread); the failures, by index."""
    failures: list[tuple[int, OSError]] = []

    def sync(index: int) -> None:
        try:
            os.fsync(fds[index])
        except OSError as exc:
            failures.append((index, exc))

    helpers = [threading.Thread(target=sync, args=(i,), daemon=True) for i in range(1, len(fds))]
    for helper in helpers:
        helper.start()
    if fds:
        sync(0)
    for helper in helpers:
        helper.join()
    return sorted(failures, key=lambda failure: failure[0])


def discard_prepared(directory: str | os.PathLike, name: str, save_key: str) -> None:
    unlink_quietly(os.path.join(os.fspath(directory), temp_name(name, save_key)))


def _location_text(location: object, what: str, expected: str) -> str:
    """``location`` as a string; anything but a str or path is refused: "``what`` must be ``expected``"."""
    if not isinstance(location, (str, os.PathLike)):
        raise InvalidInputError(f"{what} must be {expected}, not {type(location).__name__} {location!r}")
    return os.fspath(location)


def reader_location(location: str | os.PathLike | None) -> str | None:
    """A reader's checkpoint: a local directory, or a URL fsspec can serve (read over fsspec)."""
    if location is None:
        return None
    text = _location_text(location, "a checkpoint location", "a path or URL")
    if is_remote_url(text):
        return check_url("checkpoint_id", text)
    return local_path(text)


def writer_location(location: str | os.PathLike | None) -> str | None:
    """A writer's checkpoint directory: local only. A URL is refused here, before anything is
    created, rather than becoming a local directory named after it (``./s3:/bucket/x``)."""
    if location is None:
        return None
    text = _location_text(location, "a checkpoint directory", "a path")
    if is_remote_url(text):
        name = text.rstrip("/").rsplit("/", 1)[-1] or "step_N"
        raise InvalidInputError(
            f"NVMeWriter saves to a local directory (node-local NVMe), not to {text}: save locally and "
            f"mirror there, NVMeWriter('/nvme/run/{name}', mirror={text!r}); the mirror drains in the "
            "background after each commit (NVMeReader loads from the URL directly)")
    return local_path(text)


def require_location(cls: type, location: str | None, call: str) -> str:
    """The checkpoint location, once DCP starts using the object; a clear error when none was given."""
    if location is None:
        raise InvalidInputError(
            f"{cls.__name__} has no checkpoint directory: give one, {cls.__name__}('/nvme/run/step_10'), or "
            f"pass checkpoint_id='/nvme/run/step_10' to {call}")
    return location


# --------------------------------------------------------------------------- removing a save's files


_unfinished: set[tuple[str, str]] = set()
"""(directory, save key) of each save this process coordinates whose ``finish`` has not begun.
DCP skips ``finish`` when a rank's write fails and tells no writer, so the files of such a
save (every rank's in a shared directory; the coordinator's node's in a node-local one, where
each other node's committer removes its own) go when the process exits."""
_unfinished_lock = threading.Lock()
_exiting = False


def save_begins(directory: str, key: str) -> None:
    """The coordinator planned save ``key`` in ``directory``: its ranks write from now on."""
    with _unfinished_lock:
        _unfinished.add((directory, key))


def finish_begins(directory: str, key: str) -> None:
    """The coordinator's ``finish`` of save ``key``: from here on the save's own code removes its
    files if it fails. Raises SaveError when the exit removed them already (a save on a thread
    that was still running when the interpreter exited: nothing of it may commit)."""
    with _unfinished_lock:
        if _exiting:
            raise SaveError(f"{directory}: the process is exiting; save {key} was not committed")
        _unfinished.discard((directory, key))


def _remove_unfinished_at_exit() -> None:
    """atexit: every save of this process has returned by now (threads and pools are joined), so
    one that never began its ``finish`` failed; its files are provably nobody else's (their
    names carry its random key)."""
    global _exiting
    with _unfinished_lock:
        _exiting = True
        saves = sorted(_unfinished)
        _unfinished.clear()
    for directory, key in saves:
        remove_save_files(directory, key)


def _forget_in_child() -> None:
    """In the child of a fork(): the parent's saves are the parent's; the child's exit must not
    remove their files."""
    global _unfinished_lock
    _unfinished_lock = threading.Lock()  # another thread may have held it at the fork
    _unfinished.clear()


atexit.register(_remove_unfinished_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)


def remove_other_saves_copies(directory: str, key: str) -> None:
    """After save ``key`` committed here: the replicas (``.replicas/<node>/``) and kept ranges
    (``.ranges/``) of any other save in ``directory`` go too -- a replica left from before an
    overwrite must never stand in for this save's files or metadata."""
    # listed and removed relative to the directory, never through a link planted on the way
    for holder in list_below(directory, REPLICAS_DIR):
        names = list_below(directory, REPLICAS_DIR, holder)  # [] for a link or a file: it goes
        if any((owner := save_key_of(name)) and owner != key for name in names) or not names:
            remove_below(directory, REPLICAS_DIR, holder)
    drop_kept(directory, lambda name: save_key_of(name) == key)


def drop_kept(directory: str, keep: Callable[[str], bool]) -> None:
    """Remove the kept ranges whose file name ``keep`` refuses (those of another save)."""
    for entry in list_below(directory, RANGES_DIR):
        name = entry[: -len(SPANS_SUFFIX)] if entry.endswith(SPANS_SUFFIX) else entry
        if not keep(name):
            unlink_below(directory, RANGES_DIR, entry)


def remove_save_files(directory: str, key: str) -> None:
    """Every file of save ``key`` in ``directory``: data, tables, temps (their names carry the
    save's random key, so they are provably nobody else's). Used by the coordinator's failed
    commit too."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        temp = temp_of(name)
        if save_key_of(name) == key or (temp and temp[1] == key):
            unlink_below(directory, name)


def refuse_run_dir(path: str) -> None:
    """A directory whose subdirectories hold checkpoints is a run directory: a save into it
    would make it a checkpoint itself, and ``list`` and ``latest()`` would then see it, not its steps."""
    try:
        with os.scandir(path) as entries:
            steps = sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
                           and os.path.lexists(os.path.join(e.path, MANIFEST)))
    except OSError:
        return  # not there yet (made next) or unreadable (the save says so next)
    if steps:
        shown = ", ".join(steps[:3]) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")
        raise InvalidInputError(f"{path} holds checkpoints in directories ({shown}): it is a run directory, "
                                "and a save into it would hide them; save each step into a directory of its own "
                                f"under it, e.g. {os.path.join(path, 'step_000100')}")
