"""Errors a user can meet, each saying which file or item and what to do."""

from __future__ import annotations


class DCPNVMeError(Exception):
    """Base class of every error raised by dcp_nvme."""


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


class CheckpointLockedError(DCPNVMeError, RuntimeError):
    """Another save holds the checkpoint directory's save lock (see dcp_nvme.savelock)."""
