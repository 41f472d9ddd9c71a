"""What state a checkpoint directory is in, from its small files only (no data read)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from dcp_nvme.errors import CheckpointNotCommittedError, CheckpointNotFoundError, DCPNVMeError
from dcp_nvme.format.container import DCP_METADATA, MANIFEST, save_key_of
from dcp_nvme.format.manifest import Manifest
from dcp_nvme.host.files import file_kind, open_regular
from dcp_nvme.storage.intact import checked, one_line
from dcp_nvme.storage.local_dir import LocalStore, Store

COMMITTED = "committed"
INCOMPLETE = "incomplete"
CORRUPT = "corrupt"
DAMAGED = "damaged"  # committed, but a listed file is missing or has the wrong size
FOREIGN = "foreign"  # written by DCP's FileSystemWriter
MISSING = "missing"
NOT_A_CHECKPOINT = "not a checkpoint"


@dataclass
class CheckpointState:
    location: str
    state: str
    reason: str = ""
    manifest: Manifest | None = None
    data_files: list[str] = field(default_factory=list)
    """dcp_nvme data files present in the directory (of any save)."""
    elsewhere: list[str] = field(default_factory=list)
    """Of a node-local checkpoint: the nodes whose files this directory does not hold (they
    are on those nodes' own disks)."""

    @property
    def ok(self) -> bool:
        return self.state == COMMITTED


def checkpoint_state(source: Store) -> CheckpointState:
    """Read the manifest and index if there are any; never raises for a bad checkpoint."""
    location = source.location
    if not source.exists():
        if isinstance(source, LocalStore) and os.path.lexists(location):
            return CheckpointState(location, NOT_A_CHECKPOINT, f"{location} is {what_file_is(location)}; a "
                                   "dcp_nvme checkpoint is a directory holding manifest.json")
        return CheckpointState(location, MISSING, f"{location} does not exist")
    names = source.names()
    data_files = [n for n in names if n.endswith(".safetensors") and save_key_of(n)]
    try:
        manifest, problems, elsewhere = checked(source, location)  # what latest() judges by too
    except CheckpointNotCommittedError as exc:
        return CheckpointState(location, INCOMPLETE, str(exc), data_files=data_files)
    except CheckpointNotFoundError as exc:
        state = FOREIGN if DCP_METADATA in names else NOT_A_CHECKPOINT
        return CheckpointState(location, state, str(exc), data_files=data_files)
    except Exception as exc:  # any damage to the manifest or index: report it, never crash
        return CheckpointState(location, CORRUPT, one_line(exc), data_files=data_files)
    if problems:
        return CheckpointState(location, DAMAGED, "; ".join(problems), manifest, data_files, elsewhere)
    return CheckpointState(location, COMMITTED, "", manifest, data_files, elsewhere)


def what_file_is(path: str) -> str:
    """What a path that is not a directory holds, from its name and first bytes, for messages."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "unreadable"
    if not stat.S_ISREG(mode):
        return file_kind(mode)
    parent, name = os.path.split(os.path.abspath(path))
    if name in (MANIFEST, DCP_METADATA) or (name.endswith(".safetensors") and save_key_of(name)):
        if os.path.isfile(os.path.join(parent, MANIFEST)) or os.path.isfile(os.path.join(parent, DCP_METADATA)):
            return f"a file of the checkpoint {parent} (inspect that directory)"
    try:
        fd = open_regular(path)
        try:
            head, size = os.pread(fd, 16, 0), os.fstat(fd).st_size
        finally:
            os.close(fd)
    except (OSError, DCPNVMeError):
        return "a file that cannot be read"
    if head.startswith(b"PK\x03\x04"):
        return ("a zip archive, such as a torch.save file (load it with torch.load, or convert it: "
                f"dcp-nvme convert {path} OUT --to nvme)")
    if len(head) > 8 and 0 < int.from_bytes(head[:8], "little") < size and head[8:9] == b"{":
        return "a safetensors file (one file, not a checkpoint directory)"
    if head.startswith(b"\x80"):
        return "a pickle file (torch.save's legacy format?)"
    return f"a file of {size} bytes"

