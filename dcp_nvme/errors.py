"""Errors a user can meet, each saying which file or item and what to do.

Every one is importable from here; ``dcp_nvme`` itself exports only those users catch (the base
DCPNVMeError, CheckpointExists/Locked/NotFound/NotCommittedError, ChecksumMismatchError,
InvalidInputError, UnsafeItemError)."""

from __future__ import annotations

import pickle
from typing import Any


class DCPNVMeError(Exception):
    """Base class of every error raised by dcp_nvme.

    Each one pickles with its message and attributes: DCP gathers a failed rank's exception to
    every rank by pickling it, and the default reduce calls ``__init__`` with the message alone,
    which a subclass taking other arguments refuses."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[DCPNVMeError], args: tuple[Any, ...], state: dict[str, Any]) -> DCPNVMeError:
    """An error of ``cls`` as pickled, built without the subclass's ``__init__`` (its signature is
    its own): the built-in base's ``__new__``/``__init__`` take ``args`` as raised, which keeps an
    OSError's ``errno``."""
    builtin = next(c for c in cls.__mro__ if not issubclass(c, DCPNVMeError))
    error = builtin.__new__(cls, *args)
    builtin.__init__(error, *args)
    error.__dict__.update(state)
    return error


class CheckpointNotFoundError(DCPNVMeError, FileNotFoundError):
    """The path holds no loadable dcp_nvme checkpoint."""


class CheckpointNotCommittedError(CheckpointNotFoundError):
    """Data files exist but the manifest was never committed: the save did not finish."""


class CheckpointExistsError(DCPNVMeError, FileExistsError):
    """A committed checkpoint is already at the path and ``overwrite`` is off."""


class ManifestError(DCPNVMeError, ValueError):
    """The manifest is unreadable, from an unknown format version, or inconsistent."""


class ChecksumMismatchError(DCPNVMeError):
    """Bytes read back differ from what was written."""

    def __init__(self, path: str, start: int, end: int, expected: int, actual: int, items: str = ""):
        self.path, self.start, self.end = path, start, end
        self.expected, self.actual, self.items = expected, actual, items
        where = f" (item {items})" if items else ""
        super().__init__(
            f"checksum mismatch in {path} bytes [{start}, {end}){where}: expected crc32c "
            f"{expected:#010x}, read {actual:#010x}; the file is corrupt or was modified after the "
            "save. Restore it from another copy, or load an earlier checkpoint."
        )

    def with_items(self, items: str) -> ChecksumMismatchError:
        return ChecksumMismatchError(self.path, self.start, self.end, self.expected, self.actual, items)


class EngineUnavailableError(DCPNVMeError, RuntimeError):
    """The requested I/O engine cannot run on this machine."""


class TableError(ManifestError):
    """A table named by manifest.json is missing, or its bytes differ from the size and crc32c
    recorded there; ``name`` is the table's file name."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(message)


class StagingBusyError(DCPNVMeError, RuntimeError):
    """Every staging arena is still being written by an earlier save (``on_busy="error"``)."""


class DrainError(DCPNVMeError, RuntimeError):
    """A drain gave up; ``cause`` is the one-line reason also recorded in the drain state."""

    def __init__(self, location: str, target: str, cause: str) -> None:
        self.location, self.target, self.cause = location, target, cause
        super().__init__(f"drain of {location} to {target} failed: {cause}. The local checkpoint is "
                         "intact; fix the cause and run `dcp-nvme drain` on it to resume.")


class MissingDependencyError(DCPNVMeError, ImportError):
    """An optional package a URL or feature needs is not installed; the message names the
    ``pip install`` that adds it."""


class BucketMissingError(DCPNVMeError, FileNotFoundError):
    """The object-store bucket a drain targets does not exist."""


class CheckpointLockedError(DCPNVMeError, RuntimeError):
    """Another save holds the checkpoint directory's save lock (see dcp_nvme.storage.save_lock)."""


class LockFileError(DCPNVMeError, ValueError):
    """``<dir>/.save.lock`` is not a save lock as a save writes it: ``regular`` is False for a
    FIFO, link, directory or device (no save creates one), True for a regular file that does not
    parse (torn by a crash, forged, or one a save is creating this very moment)."""

    def __init__(self, message: str, *, regular: bool) -> None:
        self.regular = regular
        super().__init__(message)


class UnsafeItemError(DCPNVMeError, pickle.UnpicklingError):
    """A non-tensor item would run code (or is not a weights-only pickle) and pickle is not allowed."""


class ItemKindError(DCPNVMeError, TypeError):
    """The checkpoint holds an item of another kind (tensor vs object) than the destination."""


class InvalidInputError(DCPNVMeError, ValueError):
    """An argument, option, environment value or input file that cannot be used as given; the
    message names it, the value, and what would work."""


class UnknownOptionError(DCPNVMeError, TypeError):
    """An option name that the call does not take; the message lists the ones it does."""


class UnsupportedItemError(DCPNVMeError, TypeError):
    """A state-dict item that cannot be saved (a sparse or meta tensor, a planner's non-tensor
    where a tensor was planned); the message names the item."""


class MissingItemError(DCPNVMeError, KeyError):
    """A load asked for an item (or a chunk of one) that the checkpoint does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(DCPNVMeError, ValueError):
    """A destination tensor whose shape or dtype disagrees with what the checkpoint holds."""


class CodecError(ManifestError):
    """Coded (compressed) checkpoint bytes that cannot be decoded: damaged, truncated, or of a
    codec or version this dcp_nvme does not read."""


class StorageError(DCPNVMeError, OSError):
    """A file operation of a save failed (full disk, permissions, a read-only mount): the
    message names the file and the step; ``errno`` is the system's."""


class SaveError(DCPNVMeError, RuntimeError):
    """A save that cannot commit because what the ranks wrote does not match the plan."""


class BenchError(DCPNVMeError, RuntimeError):
    """A measurement of ``dcp-nvme bench`` or ``dcp-nvme tune`` failed (fio, a worker process,
    a loaded state that differs from the saved one)."""


class PeerError(DCPNVMeError, OSError):
    """A copy of a file from another source (a replica on this node, the mirror) was not made:
    the source could not give it, or the copy was cancelled."""
