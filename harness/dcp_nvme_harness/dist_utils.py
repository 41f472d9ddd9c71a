"""Run a function on N real processes joined by a gloo process group on loopback."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.reduction import DupFd
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from dcp_nvme_harness.ports import reserve_port

# The ranks are forked from a server that imported these once, instead of each spawned rank
# importing torch again (about 4 s of CPU per rank on 2 cores: most of the suite's time). The
# server is a fresh process that ran no test, so every rank still starts from clean state.
_PRELOAD = ["torch", "torch.distributed.checkpoint", "dcp_nvme", "dcp_nvme.format.manifest", "dcp_nvme_harness.dist_utils"]


def preload_in_forkserver(*modules: str) -> None:
    """Have the fork server import ``modules`` too; it starts at this process's first run."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    multiprocessing.set_forkserver_preload(_PRELOAD)


preload_in_forkserver()


def free_port() -> int:
    return reserve_port()


def _adopt_stdio(stdout: Any, stderr: Any) -> None:
    os.dup2(stdout.detach(), 1)
    os.dup2(stderr.detach(), 2)


class CallerStdio:
    """The caller's stdout and stderr, handed to a forked rank: a rank inherits the fork server's
    (the capture file of whichever test started it), so a failing test would not show its ranks'
    output. Unpickling this in the rank points its fds 1 and 2 at the caller's."""

    def __reduce__(self):
        return _adopt_stdio, (DupFd(1), DupFd(2))


def adopt_caller(environ: dict[str, str], cwd: str) -> None:
    """A forked rank has the server's environment and directory: take the caller's, as spawn would."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
           caller: tuple[CallerStdio, dict[str, str], str]) -> None:
    _stdio_adopted_on_unpickling, environ, cwd = caller
    adopt_caller(environ, cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def caller_state() -> tuple[CallerStdio, dict[str, str], str]:
    """What a forked rank takes from the process that starts it (stdio, environment, directory)."""
    return CallerStdio(), dict(os.environ), os.getcwd()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on each rank; re-raises the first rank's failure.

    ``fn`` must be importable (a module-level function) because the ranks unpickle it.
    """
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, caller_state()),
                       nprocs=world_size, join=True, start_method="forkserver")
