"""Who runs where: who this process is in the job (the one place that reads the launcher's
variables), and the node it shares with other ranks -- whether the ranks share one checkpoint
directory or each node has its own (``decide``, from probe files: ``Topology``), and the queue
budget a node's ranks share (``budgeted``) with their write turns (``node_turn``).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
(the node rank). Each is checked here, with one rule for all: unset or empty means "not
launched that way", anything else must be a non-negative integer (positive for the sizes), or
an InvalidInputError names the variable, its value and what to do.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from dcp_nvme.config import IOConfig
from dcp_nvme.errors import InvalidInputError, StorageError

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
    value = _local_rank_env(environ)
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
    return _local_rank_env(environ) in (None, 0)


def _local_rank_env(environ: Mapping[str, str] | None) -> int | None:
    return _env_int("LOCAL_RANK", environ, positive=False, what="this rank's index on its node")


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


# The node side of a save.
#
# The same path (``/nvme/run1/step_10``) may name one parallel-filesystem directory shared by all
# ranks, or a directory on each node's local NVMe. The writer finds out while DCP plans, with no
# collective of its own: each node's first rank (``LOCAL_RANK`` 0; every rank where torchrun did
# not say) creates a probe file of a random name in the directory and names it in its local plan;
# the coordinator then looks for each node's probe by that name. A node whose probe it sees shares
# its directory; a node whose probe it cannot see has a disk of its own, and must get its own copy
# of the checkpoint's metadata (``save.node_commit``). Looking a fresh random name up by name is
# exact on NFS too (no cached listing or negative entry can hide it).

SHARED = "shared"
NODE_LOCAL = "node-local"
MODES = (SHARED, NODE_LOCAL)
PROBE_PREFIX = ".dcp_nvme-probe."


@dataclass(frozen=True)
class NodeTag:
    """What a rank's local plan tells the coordinator about where it runs."""

    host: str
    node: str
    probe: str | None = None
    """The probe file this rank created in the checkpoint directory (node leaders only)."""
    held: str | None = None
    """Of a node leader: the save key of the checkpoint committed in its directory that can
    load, ``""`` for one that cannot (damaged, or only part of it there), None for none."""
    items: list | None = field(default=None, compare=False)
    """The rank's local plan's items, before the planner's dedup (the same list as the plan's,
    so it costs nothing when the plans are gathered): what a node-local save copies."""


@dataclass(frozen=True)
class Topology:
    """The coordinator's finding, handed to every rank in its plan and kept in the manifest."""

    mode: str
    rank_nodes: tuple[str, ...]
    """The node of each rank."""
    node_writers: tuple[int, ...] = ()
    """One rank per node that does not share the coordinator's directory: it commits the
    metadata there. Empty in shared mode."""

    def to_doc(self) -> dict[str, Any]:
        names = sorted(set(self.rank_nodes), key=_node_order)
        index = {name: i for i, name in enumerate(names)}
        return {"mode": self.mode, "nodes": names, "rank_nodes": [index[n] for n in self.rank_nodes]}

    def ranks_of(self, node: str) -> list[int]:
        return [rank for rank, name in enumerate(self.rank_nodes) if name == node]


def _node_order(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def write_probe(directory: str) -> str:
    """Create a probe file of a fresh random name in ``directory``; return its name."""
    name = PROBE_PREFIX + secrets.token_hex(8)
    try:
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot create {os.path.join(directory, name)} (the probe that "
                                      f"tells whether nodes share the directory): {exc.strerror}") from exc
    return name


def probe_visible(directory: str, name: str) -> bool:
    return os.path.lexists(os.path.join(directory, name))


def remove_probe(directory: str, name: str | None) -> None:
    if name:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def is_probe(name: str) -> bool:
    return name.startswith(PROBE_PREFIX)


def decide(coordinator: int, tags: Sequence[NodeTag | None], visible: Callable[[str], bool]) -> Topology:
    """The topology of a save from every rank's tag (pure, given ``visible``: whether the
    coordinator sees a probe file of that name).

    A rank without a tag (a writer DCP did not plan through ours) counts as on the coordinator's
    node. A node other than the coordinator's is on the coordinator's filesystem when any of its
    probes is visible; otherwise its lowest probing rank commits its copy of the metadata."""
    coordinator_tag = tags[coordinator]
    own = coordinator_tag.node if coordinator_tag is not None else ""
    nodes = tuple(tag.node if tag is not None else own for tag in tags)
    probes: dict[str, list[tuple[int, str]]] = {}
    for rank, tag in enumerate(tags):
        if tag is not None and tag.probe:
            probes.setdefault(tag.node, []).append((rank, tag.probe))
    writers = []
    for node in sorted(set(nodes) - {own}, key=_node_order):
        seen = probes.get(node, [])
        if not seen:
            raise InvalidInputError(
                f"node {node} sent no probe of the checkpoint directory (no rank there has "
                "LOCAL_RANK=0): set LOCAL_RANK and GROUP_RANK as torchrun does, or unset both")
        if not any(visible(probe) for _, probe in seen):
            writers.append(min(rank for rank, _ in seen))
    return Topology(NODE_LOCAL if writers else SHARED, nodes, tuple(writers))


def ranks_per_host(hosts: list[str | None]) -> list[int]:
    """For each rank, how many ranks share its host (a rank that did not say counts alone)."""
    counts = Counter(h for h in hosts if h is not None)
    return [counts[h] if h is not None else 1 for h in hosts]


def effective_queue_depth(config: IOConfig, ranks_on_node: int) -> int:
    """This rank's share of the node budget (all of it when ranks write in turns), or its own
    ``queue_depth`` when there is no budget."""
    if config.node_queue_depth is None:
        return config.queue_depth
    sharing = 1 if config.node_write_order == "staggered" else max(1, ranks_on_node)
    return min(256, max(1, config.node_queue_depth // sharing))


def turn_file(directory: str) -> str:
    """The node-local lock file for the drive under ``directory``: ranks writing to one file
    system take turns on it; other drives, users and nodes are not involved."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"dcp_nvme-turn-{os.getuid()}-{os.stat(directory).st_dev:x}.lock")


@contextmanager
def node_turn(directory: str) -> Iterator[float]:
    """Hold this node's write turn for the drive under ``directory``; yields the seconds waited."""
    path = turn_file(directory)
    try:  # O_NOFOLLOW: a planted symlink must not make us open (and lock) someone else's file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot open the node's write-turn file {path} "
                                 f"(node_write_order=staggered): {exc.strerror}") from exc
    try:
        started = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield time.perf_counter() - started
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def budgeted(config: IOConfig, ranks_on_node: int) -> IOConfig:
    """``config`` with this rank's share of the node budget as its ``queue_depth``."""
    depth = effective_queue_depth(config, ranks_on_node)
    return config if depth == config.queue_depth else replace(config, queue_depth=depth)
