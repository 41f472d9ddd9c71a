"""Run a function on N real processes joined by a gloo process group on loopback."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on each rank; re-raises the first rank's failure.

    ``fn`` must be importable (a module-level function) because the ranks are spawned.
    """
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
