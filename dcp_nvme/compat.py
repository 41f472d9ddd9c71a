"""The torch versions dcp_nvme runs on, and every torch name it uses that torch does not promise
to keep (not in its module's ``__all__``, or named with a leading underscore), in one place.

When a torch release moves one of these, this table is where to look, and
``tests/cross/test_compat.py`` is the test that says so. The public DCP API (``StorageWriter``,
``StorageReader``, ``Metadata``, the planners) is used directly elsewhere and is not listed.
Nothing here imports torch until a name is asked for.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

TESTED_TORCH = ("2.13", "2.15")
"""The oldest and newest torch releases (major.minor) the test suite has run on."""

MIN_TORCH = "2.13"
"""The declared floor (``pyproject.toml``): the oldest release the tests run on."""

PRIVATE_NAMES: dict[str, str] = {
    "torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION":
        "the DCP version the stock writer records; ours records the same (save/writer.py)",
    "torch.distributed.checkpoint.metadata.STATE_DICT_TYPE":
        "the state_dict type of AsyncStager.stage (save/stager.py)",
    "torch.distributed.distributed_c10d._get_default_store":
        "the process group's key-value store, how the node-local commit tells every node "
        "(host/job.py job_store, for save/node_commit.py); torch's own checkpoint code "
        "reaches it the same way",
    "torch.distributed.PrefixStore":
        "a namespace of our own in that store (host/job.py)",
    "torch.distributed.checkpoint.planner_helpers._create_chunk_list":
        "a local tensor's chunks, as DefaultLoadPlanner finds them (load/load_planner.py)",
    "torch.distributed.checkpoint.planner_helpers._create_read_item_for_tensor":
        "one ReadItem for an overlap, as DefaultLoadPlanner builds it (load/load_planner.py)",
    "torch.distributed.checkpoint.planner_helpers._create_read_items":
        "the ReadItems of a non-tensor or a bytes entry (load/load_planner.py)",
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict":
        "the keys a checkpoint from before torch 2.4 used (load/load_planner.py)",
    "torch.distributed.checkpoint._version":
        "its ``_derived_version``, set while those old keys are computed, as DefaultLoadPlanner "
        "does (load/load_planner.py)",
    "torch.distributed.ProcessGroup._get_backend":
        "the default group's gloo backend, whose ``options._timeout`` is the job's timeout "
        "(``init_process_group(timeout=...)``): the groups dcp_nvme makes get it too (job_timeout)",
}
"""Fully qualified name -> what dcp_nvme uses it for."""

RELIED_ON: dict[str, str] = {
    "torch.distributed.checkpoint.api.CheckpointException":
        "its ``failures`` (rank -> error): a failed save shown as one line (dcp_nvme.cli)",
    "torch.distributed.checkpoint.default_planner.DefaultLoadPlanner":
        "its ``state_dict`` after ``set_up_planner``: the destination, to refuse an object "
        "over a tensor (load/objects.py)",
    "torch.serialization.get_unsafe_globals_in_checkpoint":
        "what a non-tensor item would import: named at save time and when it is refused "
        "(format/container.py)",
}
"""Attributes of public classes whose behaviour dcp_nvme depends on (documented by torch, but
easy to change in passing)."""


def resolve(dotted: str) -> Any:
    """The object a name of ``PRIVATE_NAMES`` (or any dotted module attribute) names, imported
    now; ImportError/AttributeError as torch raises them when a release moved it."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            value = getattr(value, attr)
        return value
    raise ModuleNotFoundError(f"no module of {dotted!r} can be imported")


@functools.cache
def dcp_version() -> str:
    """The DCP format version the installed torch's FileSystemWriter records (looked up once)."""
    return resolve("torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION")


def default_store() -> Any:
    """The default process group's key-value store (torch.distributed must be initialised)."""
    return resolve("torch.distributed.distributed_c10d._get_default_store")()


def run_before_thread_pools_stop(hook: Any) -> bool:
    """Call ``hook`` at interpreter exit while thread pools still take work; False when the
    interpreter is exiting already (too late to wait for anything).

    The one touch of a private Python API: ``threading._register_atexit`` (Python >= 3.9) hooks
    run, last registered first, once the main thread has ended and before non-daemon threads
    are joined; ``concurrent.futures`` registers there the hook that stops every pool, so a
    caller imports it first and its hook then runs before that one. ``atexit`` hooks run only
    after it (the fallback, where the name is gone)."""
    import atexit
    import concurrent.futures.thread  # noqa: F401  its exit hook first: ours runs before it
    import threading

    try:
        getattr(threading, "_register_atexit", atexit.register)(hook)
    except RuntimeError:
        return False
    return True


def job_timeout() -> Any:
    """The job's timeout (a timedelta): ``init_process_group(timeout=...)``, as the default group
    holds it; None when it cannot be read. ``new_group`` without a timeout gets torch's default
    (30 min for gloo), not the job's: a peer that stops answering would hold a receive that long."""
    import torch
    import torch.distributed as dist

    try:
        backend = resolve("torch.distributed.ProcessGroup._get_backend")(dist.group.WORLD, torch.device("cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def new_gloo_group(ranks: list[int] | None = None) -> Any:
    """A gloo group of ``ranks`` (every rank: None) whose operations fail after the job's timeout."""
    import torch.distributed as dist

    timeout = job_timeout()
    if timeout is None:
        return dist.new_group(ranks=ranks, backend="gloo")
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
