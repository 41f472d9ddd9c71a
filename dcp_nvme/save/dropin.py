"""What NVMeWriter keeps of DCP's stock writer: FileSystemWriter's arguments
(``writer_stock_options``), the overwrite refusal in the stock wording (for a stock checkpoint
too, whose files an overwrite removes: ``is_stock_file``), DCP's plan cache
(``with_cached_plans``), the pointer a stock ``dcp.load`` user finds (``write_pointer``), and
after a commit the removal of other saves' files, ours and a stock checkpoint's
(``remove_other_saves``).

Each stock argument is accepted where its value is what NVMeWriter does anyway, and otherwise
refused with a message naming the option of ours that does that job (the rules shared with the
reader are in ``config``, the location checks in ``storage.local_dir``).
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan

from dcp_nvme.config import refuse_positional, unknown_option
from dcp_nvme.errors import CheckpointExistsError, InvalidInputError
from dcp_nvme.format.container import DCP_METADATA, MANIFEST, save_key_of, temp_of
from dcp_nvme.host.job import launched_world_size
from dcp_nvme.storage.local_dir import LocalStore, remove_other_saves_copies
from dcp_nvme.storage.save_lock import SaveLock

log = logging.getLogger(__name__)

STOCK_WRITER_POSITIONAL = ("single_file_per_rank", "sync_files", "thread_count", "per_thread_copy_ahead",
                           "cache_staged_state_dict", "overwrite", "_extensions", "serialization_format")
"""FileSystemWriter's arguments after the path, in its order."""

_STAGER = ("dcp.async_save(state_dict, storage_writer=NVMeWriter(path), async_stager=NVMeStager()), "
           "which keeps pinned staging memory across saves")


def _refusal(name: str, value: Any) -> str | None:
    """Why ``name=value`` (a FileSystemWriter argument) cannot be honoured, or None when it is
    what NVMeWriter does anyway."""
    if name == "single_file_per_rank":
        return None if value is True else "NVMeWriter always writes one container per rank"
    if name == "sync_files":
        return None if value is True else (
            "NVMeWriter fsyncs every file before the commit (a checkpoint a crash can tear is never "
            f"committed); to take the save off the training loop use {_STAGER}")
    if name == "thread_count":
        return ("NVMeWriter keeps queue_depth requests in flight per rank (default 8, env "
                "DCP_NVME_QUEUE_DEPTH, or what `dcp-nvme tune` measured); pass queue_depth=N")
    if name == "per_thread_copy_ahead":
        return ("NVMeWriter copies device memory through queue_depth bounce buffers of block_size bytes; "
                "pass block_size= (e.g. '8MiB') and queue_depth=")
    if name == "cache_staged_state_dict":
        return None if value is False else f"staging is NVMeStager's job: {_STAGER}"
    if name == "_extensions":
        return None if not value else (
            "NVMeWriter applies no stream extensions: the local checkpoint is plain safetensors; to "
            "store the mirror compressed pass mirror=URL, compress='auto'")
    if name == "serialization_format":
        if getattr(value, "name", value) == "SAFETENSORS":
            return None
        return ("NVMeWriter writes safetensors containers (SerializationFormat.SAFETENSORS); for a "
                "torch.save file convert the checkpoint: dcp-nvme convert DIR OUT --to torch")
    return ""


def writer_stock_options(cls: type, args: tuple[Any, ...], extra: dict[str, Any]) -> None:
    """Accept or refuse the FileSystemWriter arguments that NVMeWriter does not take itself."""
    refuse_positional(cls, "FileSystemWriter", STOCK_WRITER_POSITIONAL, args)
    for name, value in extra.items():
        why = _refusal(name, value)
        if why == "":
            raise unknown_option(cls, name, value)
        if why is not None:
            raise InvalidInputError(f"{cls.__name__}: {name}={value!r} (a FileSystemWriter option) is not "
                                    f"supported: {why}")


class CheckpointExistsRefusal(CheckpointExistsError, CheckpointException):
    """The overwrite refusal raised before DCP's collectives: one line, and still the
    ``CheckpointException`` that code written for the stock writer catches."""

    def __init__(self, message: str) -> None:
        CheckpointExistsError.__init__(self, message)
        self._failures = {0: (CheckpointExistsError(message), traceback.StackSummary())}

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> Any:
        return (type(self), (str(self.args[0]),))


_STOCK_FILE = re.compile(r"^(?:__\d+_\d+\.distcp|(?:__\d+)?\.metadata(?:\.tmp)?)$")
"""FileSystemWriter's files: ``__<rank>_<n>.distcp`` data, ``.metadata`` (``__<rank>.metadata``
without rank coordination) and their temps."""


def is_stock_file(name: str) -> bool:
    """A file of a stock DCP checkpoint: after a commit it is another save's, removed like ours."""
    return _STOCK_FILE.match(name) is not None


def remove_other_saves(directory: str, key: str, lock: SaveLock | None, label: str) -> None:
    """After save ``key`` committed in ``directory``: the files of other saves (ours and a stock
    checkpoint's) are garbage, provided ``lock`` is still held (no other save can be live then)
    and our manifest is the committed one."""
    if lock is not None and not lock.held():
        log.warning("dcp_nvme: %s: the save lock was broken during the commit of %s; files of "
                    "other saves are left in place", label, key)
        return
    store = LocalStore(directory)
    for name in store.names():
        owner = save_key_of(name)
        temp = temp_of(name)
        if (owner and owner != key) or (temp and temp[1] != key) or is_stock_file(name):
            store.remove(name)
    remove_other_saves_copies(directory, key)


def exists_message(where: str, stock: bool = False) -> str:
    """The refusal, leading with the stock writer's words (scripts and PyTorch's tests match them)."""
    text = (f"Checkpoint already exists at {where} and overwrite=False: pass overwrite=True to replace it "
            "(it stays loadable until the new one commits) or save elsewhere")
    return text + ("; it is a stock DCP checkpoint (FileSystemWriter's .metadata and .distcp files), "
                   "whose files overwrite=True removes once the new one commits" if stock else "")


def existing_refusal(directory: str, where: str, overwrite: bool, whole: bool | None = None) -> str | None:
    """The refusal when ``directory`` holds a committed checkpoint, ours or the stock writer's
    (whose ``.metadata`` ``dcp.load`` would still read beside our manifest), and not ``overwrite``.
    Ours only when it is whole (``whole``, else judged here: ``storage.intact``): a step that
    ``latest()`` passes over, damaged or committed on some nodes only, is replaced, so that a
    resumed job saves it again without ``overwrite``."""
    if overwrite:
        return None
    store = LocalStore(directory)
    if store.has(MANIFEST):
        if whole is None:
            whole = held_key(directory) != ""
        return exists_message(where) if whole else None
    return exists_message(where, stock=True) if store.has(DCP_METADATA) else None


def held_key(directory: str) -> str | None:
    """The save key of the checkpoint committed in ``directory`` when it can load, ``""`` when
    it cannot, None when there is none (``NodeTag.held``)."""
    if not LocalStore(directory).has(MANIFEST):
        return None
    from dcp_nvme.storage.intact import examine  # here: the tables' reader only for a re-save

    why, key = examine(directory)
    return "" if why is not None or key is None else key


def whole_on_every_node(tags: list[Any]) -> bool | None:
    """Whether every node's directory holds the same loadable save of the step (the node
    leaders' ``NodeTag.held``), so that a step committed on some nodes only, or damaged on one,
    is replaced on every node alike; None where no leader found one (one process: judged there)."""
    held = [tag.held for tag in tags if tag is not None and tag.probe is not None]
    if all(h is None for h in held):
        return None
    return all(held) and len(set(held)) == 1


def refuse_existing(directory: str, where: str, overwrite: bool, whole: bool | None = None) -> bool:
    """While planning (the coordinator, a node writer): CheckpointExistsError if ``existing_refusal``;
    else whether a checkpoint found in the directories is replaced (``overwrite``, or not whole)."""
    message = existing_refusal(directory, where, overwrite, whole)
    if message is not None:
        raise CheckpointExistsError(message)
    return overwrite or whole is False


def alone() -> bool:
    """This process saves by itself (no process group of several ranks, none announced by the
    launcher): only then can a rank refuse before DCP's collectives without leaving others waiting."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return False
    return launched_world_size() == 1


def refuse_existing_early(path: str | None, overwrite: bool) -> None:
    """Before any collective: a committed checkpoint at ``path`` refused as its own one-line
    error. With several ranks the coordinator refuses while planning instead (DCP then reports
    it inside a CheckpointException on every rank, its last line this same sentence)."""
    if path is None or overwrite or not alone():
        return
    message = existing_refusal(path, path, overwrite)
    if message is not None:
        raise CheckpointExistsRefusal(message)


def with_cached_plans(plans: list[SavePlan], last: list[SavePlan] | None,
                      where: str) -> tuple[list[SavePlan], bool]:
    """``plans`` with each unusable (cached, unchanged) one replaced by the rank's plan of the
    last save, and whether any was. The planner's stand-ins carry no ``storage_data``, so the
    rank's tag of the last save comes with its plan: the caller keeps that save's topology (its
    probes are gone). Refused when this writer did not plan that save (nothing to resend)."""
    if all(plan.usable for plan in plans):
        return plans, False
    if last is None or len(last) != len(plans):
        raise InvalidInputError(
            f"{where}: the save planner reused cached plans (enable_plan_caching=True), but this "
            "NVMeWriter did not plan the save they come from: reuse one NVMeWriter for every save "
            "with plan caching (pass checkpoint_id= to dcp.save for each step)")
    return [plan if plan.usable else replace(last[rank], usable=True) for rank, plan in enumerate(plans)], True


POINTER = ".metadata.HOW_TO_LOAD.txt"
"""Where DCP looks for its missing .metadata (`ls -a`, tab completion): says how to load this directory."""


POINTER_TEXT = """\
This directory is a dcp_nvme checkpoint (manifest.json), not one in DCP's stock layout (.metadata).
torch.distributed.checkpoint finds no .metadata here: give it dcp_nvme's reader instead,

    from dcp_nvme import NVMeReader
    dcp.load(state_dict, storage_reader=NVMeReader("<this directory>"))

or convert the checkpoint for tools that only read the stock layout or torch.save files:

    dcp-nvme convert <this directory> OUT --to dcp      (or --to torch)
"""


def write_pointer(store: LocalStore) -> None:
    """The pointer for stock DCP users (written once per directory). It is not a part of the
    checkpoint, so it never fails a save: a full disk or a planted link only costs the pointer
    (a link is refused, not followed: O_NOFOLLOW | O_EXCL)."""
    path = store.path(POINTER)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return
    except OSError as exc:
        log.warning("dcp_nvme: %s not written (%s); the checkpoint does not need it", path, exc.strerror or exc)
        return
    try:
        os.write(fd, POINTER_TEXT.encode())
    except OSError as exc:
        log.warning("dcp_nvme: %s not written (%s); the checkpoint does not need it", path, exc.strerror or exc)
        os.close(fd)
        fd = -1
        try:
            os.unlink(path)
        except OSError:
            pass
    finally:
        if fd >= 0:
            os.close(fd)
