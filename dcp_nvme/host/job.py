"""Who this process is in the job: the one place that reads the launcher's variables.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
(the node rank). Each is checked here, with one rule for all: unset or empty means "not
launched that way", anything else must be a non-negative integer (positive for the sizes), or
an InvalidInputError names the variable, its value and what to do.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from dcp_nvme.errors import InvalidInputError

MAX_DIGITS = 9
"""A rank or a count of ranks has at most 9 digits; more is a typo."""


def _env_int(name: str, environ: Mapping[str, str] | None, *, positive: bool, what: str) -> int | None:
    """Variable ``name`` as an integer, None when unset or empty; refused, naming it, otherwise."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > MAX_DIGITS or (positive and int(raw) == 0):
        kind = "a positive integer" if positive else "a non-negative integer"
        raise InvalidInputError(f"environment variable {name}={raw!r}: expected {kind} ({what}, as torchrun "
                                f"sets it); unset it to run without it")
    return int(raw)


def local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This rank's index on its node (``LOCAL_RANK``), None when the launcher did not say.

    ``torch.distributed.get_node_local_rank`` reads the same variable; it is used where torch has
    it, and the check above still names a bad value."""
    value = _env_int("LOCAL_RANK", environ, positive=False, what="this rank's index on its node")
    if value is None or environ is not None:
        return value
    import torch.distributed as dist

    getter = getattr(dist, "get_node_local_rank", None)
    return int(getter(fallback_rank=value)) if getter is not None else value


def local_world_size(agreed: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` when set, else ``agreed`` (counted from the
    ranks' host names), else 1."""
    value = _env_int("LOCAL_WORLD_SIZE", environ, positive=True, what="ranks on this node")
    return value if value is not None else max(1, agreed or 1)


def launched_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The job's rank count the launcher announced (``WORLD_SIZE``), 1 when it announced none."""
    value = _env_int("WORLD_SIZE", environ, positive=True, what="ranks in the job")
    return 1 if value is None else value


def leads_its_node(environ: Mapping[str, str] | None = None) -> bool:
    """This rank acts for its node: ``LOCAL_RANK`` 0, or any rank when it is unset."""
    return _env_int("LOCAL_RANK", environ, positive=False, what="this rank's index on its node") in (None, 0)


def host_name() -> str:
    return socket.gethostname()


def node_identity(environ: Mapping[str, str] | None = None) -> str:
    """This node's name: torchrun's ``GROUP_RANK`` (the node rank) when set, else the host name."""
    value = _env_int("GROUP_RANK", environ, positive=False, what="this node's rank")
    return host_name() if value is None else str(value)


def job_store() -> Any:
    """The job's key-value store (``torch.distributed``'s default store), under ``dcp_nvme/``.

    ``_get_default_store`` is how torch's own subsystems reach the store ``init_process_group``
    created, for any init method."""
    from torch.distributed import PrefixStore

    from dcp_nvme.compat import default_store

    return PrefixStore("dcp_nvme/", default_store())
