"""Work on a thread of its own, its result or error handed over in a ``Future``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_background(fn: Callable[[], T], name: str) -> Future[T]:
    """``fn()`` on a daemon thread named ``name``; its result or exception in the future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001  handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
