"""Rank collectives for the bench: gloo when there are several ranks, no-ops for one."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any


class Group:
    """Collectives when there are several ranks, no-ops for one."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    @property
    def is_dist(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.is_dist:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        if not self.is_dist:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Start every rank together; the slowest rank's seconds (the aggregate's wall time)."""
        self.barrier()
        started = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - started
        return max(self.gather(elapsed)), result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
