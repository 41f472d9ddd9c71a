"""One way to run I/O tasks on a bounded number of threads, used by every engine and tool."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def run_bounded(depth: int, tasks: Iterable[T], work: Callable[[T], object], name: str = "dcp-nvme-io") -> None:
    """Run ``work(task)`` for each task with at most ``depth`` in flight, on ``depth`` threads.

    Tasks are drawn lazily (a generator of millions of requests costs no memory); after the first
    failure no new task starts, the running ones finish, and that failure is re-raised.
    """
    slots = threading.BoundedSemaphore(depth)
    failure: list[BaseException] = []

    def done(future: Future) -> None:
        error = future.exception()
        if error is not None and not failure:
            failure.append(error)
        slots.release()

    with ThreadPoolExecutor(depth, thread_name_prefix=name) as pool:
        for task in tasks:
            slots.acquire()
            if failure:
                slots.release()
                break
            pool.submit(work, task).add_done_callback(done)
    if failure:
        raise failure[0]
