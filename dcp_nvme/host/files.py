"""File primitives every layer uses: opens that never follow a link or block on a FIFO, files
created fresh (``O_EXCL | O_NOFOLLOW``) or written whole, directory fsyncs, names that must stay
inside their directory. Nothing here knows about checkpoints."""

from __future__ import annotations

import errno
import os
import stat

from dcp_nvme.errors import (
    ManifestError,
    StorageError,
)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bare_name(name: str) -> str:
    """``name`` if it names an entry of the directory itself: no separator, not ``.``/``..``.

    Names read from a checkpoint are checked against their exact form in ``format.container.check_name``;
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
        unlink_quietly(os.fspath(path))
        if isinstance(exc, StorageError):
            raise
        raise StorageError(exc.errno, f"cannot write {os.fspath(path)}: {exc.strerror or exc}") from exc
    os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# Removal below a directory others may write to: every step is opened relative to the last
# (``dir_fd``) with O_NOFOLLOW, so a link planted anywhere on the way is an entry to remove at
# most, never a way into the folder it points to.

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NO_FOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_dir_below(directory: str | os.PathLike, *names: str) -> int | None:
    """An fd of ``directory/names...`` with no link followed below ``directory``; None when a
    step is missing, a link or not a directory. The caller closes it."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for name in names:
            inner = os.open(bare_name(name), _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
    except OSError:  # ELOOP/ENOTDIR for a link or a file on the way: nothing to list or remove there
        os.close(fd)
        return None
    return fd


def list_below(directory: str | os.PathLike, *names: str) -> list[str]:
    """The entries of ``directory/names...`` (see ``open_dir_below``); [] when it is not a real directory."""
    fd = open_dir_below(directory, *names)
    if fd is None:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _remove_at(fd: int, name: str) -> None:
    if not stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
        os.unlink(name, dir_fd=fd)  # a link goes, never its target
        return
    inner = os.open(name, _DIR_FLAGS, dir_fd=fd)  # O_NOFOLLOW: swapped for a link since, it fails
    try:
        for entry in os.listdir(inner):
            _remove_at(inner, entry)
    finally:
        os.close(inner)
    os.rmdir(name, dir_fd=fd)


def remove_below(directory: str | os.PathLike, *names: str) -> bool:
    """Remove the entry ``directory/names...`` (a file, a link or a whole tree) without following
    any link below ``directory``. False when it was not there or could not be removed."""
    if not names:
        raise ValueError("remove_below removes an entry below the directory, never the directory itself")
    fd = open_dir_below(directory, *names[:-1])
    if fd is None:
        return False
    try:
        _remove_at(fd, bare_name(names[-1]))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def unlink_below(directory: str | os.PathLike, *names: str) -> bool:
    """Unlink the file (or link) ``directory/names...`` with no link followed on the way; a
    directory there is left alone. False when nothing was removed."""
    fd = open_dir_below(directory, *names[:-1])
    if fd is None:
        return False
    try:
        os.unlink(bare_name(names[-1]), dir_fd=fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
