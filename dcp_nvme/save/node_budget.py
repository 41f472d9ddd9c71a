"""The node budget: the ranks on one node share one drive, so they share its queue.

With ``node_queue_depth`` set, each of a node's L ranks keeps ``max(1, node_queue_depth // L)``
requests in flight, so the drive sees about the depth ``dcp-nvme tune --ranks L`` measured
instead of ``queue_depth x L``. L is ``LOCAL_WORLD_SIZE`` (torchrun sets it) or else the count
the coordinator agrees on while planning: every rank's local plan carries its host name
(``topology.NodeTag``), and the coordinator counts ranks per host and hands each rank its count
back in its plan. That rides on DCP's own plan gather: no extra collective, nothing to hang on.

With ``node_write_order="staggered"`` the ranks of a node write one at a time instead, each with
the whole budget: a turn is an exclusive ``flock`` on a node-local file named after the drive
(``node_turn``). The kernel drops a flock when its holder exits, so a killed rank never blocks
the others, and nothing crosses nodes (the file lives in /dev/shm, not on shared storage).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from ..config import IOConfig
from ..errors import InvalidInputError, StorageError

LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


def this_host() -> str:
    return socket.gethostname()


def ranks_per_host(hosts: list[str | None]) -> list[int]:
    """For each rank, how many ranks share its host (a rank that did not say counts alone)."""
    counts = Counter(h for h in hosts if h is not None)
    return [counts[h] if h is not None else 1 for h in hosts]


def local_ranks(agreed: int | None = None) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` when set, else ``agreed``, else 1."""
    raw = os.environ.get(LOCAL_WORLD_SIZE, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise InvalidInputError(f"environment variable {LOCAL_WORLD_SIZE}={raw!r}: expected a positive "
                             "integer (ranks on this node); unset it to count ranks by host name")
        return value
    return max(1, agreed or 1)


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
