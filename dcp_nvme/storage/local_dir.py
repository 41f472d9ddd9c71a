"""The small-file side of a checkpoint directory: list, read, write atomically, remove.

Bulk data goes through an engine; this is for the manifest, the index and cleanup.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, Protocol

from ..errors import (
    ManifestError,
    StorageError,
)
from ..format.names import (
    temp_name,
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


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bare_name(name: str) -> str:
    """``name`` if it names an entry of the directory itself: no separator, not ``.``/``..``.

    Names read from a checkpoint are checked against their exact form in ``format.check_name``;
    this is the last guard before a name is joined onto the directory."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ManifestError(f"{name!r} is not a file name inside the checkpoint directory")
    return name


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``, of ``lstat`` for links) is, for messages."""
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a regular file" if stat.S_ISREG(mode)
            else "not a regular file")


def not_regular(path: str, mode: int) -> ManifestError:
    return ManifestError(f"{path} is {file_kind(mode)}; a checkpoint holds only regular files, so it is refused")


def open_regular(path: str | os.PathLike, extra_flags: int = 0) -> int:
    """An fd of ``path`` for reading, only if it is a regular file (never a link, FIFO or device).

    O_NONBLOCK so that opening a FIFO cannot hang; O_NOFOLLOW so that a link cannot lead out."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= extra_flags
    try:
        fd = os.open(path, flags)
    except OSError:
        if os.path.islink(path):
            raise not_regular(os.fspath(path), stat.S_IFLNK) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_regular(os.fspath(path), mode)
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str | os.PathLike, max_size: int | None = None) -> bytes:
    """All of a regular file, refusing it when over ``max_size`` before reading a byte."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if max_size is not None and size > max_size:
            raise ManifestError(f"{os.fspath(path)} is {size} bytes, more than the {max_size} a file of "
                                "its kind may have; the checkpoint is damaged or not a dcp_nvme checkpoint")
        data = bytearray(size)
        view, total = memoryview(data), 0
        while total < size:
            got = os.preadv(fd, [view[total:]], total)
            if got == 0:
                break
            total += got
        return bytes(data[:total])
    finally:
        os.close(fd)


NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _link_refused(path: str, what: str) -> StorageError:
    return StorageError(errno.ELOOP, f"{path} is a symbolic link; dcp_nvme never writes {what} through a "
                                     "link (it could lead outside the directory), so it was refused: remove "
                                     "the link and run again")


def create_no_follow(path: str | os.PathLike, flags: int = os.O_WRONLY, mode: int = 0o644, *,
                     fresh: bool = False) -> int:
    """The one way dcp_nvme creates or rewrites a file in a directory others may write to.

    Opens ``path`` with O_CREAT | O_NOFOLLOW (plus ``flags``): a symbolic link there is refused
    with a StorageError naming it, never followed, and anything but a regular file (a FIFO, a
    device) is refused too. ``fresh`` is for a scratch or temp file the caller owns: whatever is
    under the name (a leftover, a planted link: unlinking a link never touches its target) is
    removed first and the file is created with O_EXCL, so only a file made here is written."""
    path = os.fspath(path)
    flags |= os.O_CREAT | NO_FOLLOW | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK
    if fresh:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise StorageError(errno.EISDIR, f"{path} is a directory where dcp_nvme writes a file; "
                                             "remove it and run again") from None
        except OSError as exc:
            if not os.path.isdir(path) or os.path.islink(path):
                raise StorageError(exc.errno, f"cannot remove the leftover {path}: {exc.strerror or exc}") from exc
            raise StorageError(errno.EISDIR, f"{path} is a directory where dcp_nvme writes a file; "
                                             "remove it and run again") from None
        flags |= os.O_EXCL
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if os.path.islink(path):
            raise _link_refused(path, "a file") from None
        if exc.errno == errno.EEXIST:  # a fresh file raced by another writer of this name
            raise StorageError(exc.errno, f"{path} appeared while dcp_nvme was creating it; another "
                                          "process writes there: stop it and run again") from exc
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise StorageError(exc.errno, f"{path} is a FIFO; dcp_nvme writes only regular files, "
                                          "so it was refused: remove it and run again") from exc
        raise StorageError(exc.errno, f"cannot create {path}: {exc.strerror or exc}") from exc
    mode_now = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode_now):
        os.close(fd)
        raise StorageError(errno.EINVAL, f"{path} is {file_kind(mode_now)}; dcp_nvme writes only regular "
                                         "files, so it was refused: remove it and run again")
    os.set_blocking(fd, True)
    return fd


def make_private_dir(path: str | os.PathLike) -> str:
    """``path`` as a directory (made here if missing), never a symbolic link to one.

    An existing link is refused with a StorageError naming it: files are later created inside
    by name, and a link would put them wherever it points."""
    path = os.fspath(path)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot create the directory {path}: {exc.strerror or exc}") from exc
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise _link_refused(path, "into a directory")
    if not stat.S_ISDIR(info.st_mode):
        raise StorageError(errno.ENOTDIR, f"{path} is {file_kind(info.st_mode)} where dcp_nvme keeps a "
                                          "directory; remove it and run again")
    return path


def pwrite_all(fd: int, buffer: memoryview | bytes, offset: int) -> None:
    """pwrite until every byte is written (a regular file may take fewer at a time)."""
    buffer = memoryview(buffer)
    while len(buffer):
        written = os.pwrite(fd, buffer, offset)
        buffer, offset = buffer[written:], offset + written


def write_file_fresh(path: str | os.PathLike, data: bytes) -> None:
    """``data`` as the new temp or scratch file ``path`` (``create_no_follow(fresh=True)``), fsynced."""
    fd = create_no_follow(path, os.O_WRONLY, fresh=True)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        _unlink_quietly(os.fspath(path))
        if isinstance(exc, StorageError):
            raise
        raise StorageError(exc.errno, f"cannot write {os.fspath(path)}: {exc.strerror or exc}") from exc
    os.close(fd)


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


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
        _unlink_quietly(temp)
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
        _unlink_quietly(temp)
        raise StorageError(exc.errno, f"cannot rename into place {final} while saving: "
                                      f"{exc.strerror or exc}") from exc
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise StorageError(exc.errno, f"{final} was renamed into place but the fsync of {directory} "
                                      f"failed: {exc.strerror or exc}; it may not survive a power loss") from exc


def discard_prepared(directory: str | os.PathLike, name: str, save_key: str) -> None:
    _unlink_quietly(os.path.join(os.fspath(directory), temp_name(name, save_key)))
