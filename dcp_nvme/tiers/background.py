"""The background drain: ``Drainer`` drains checkpoints one at a time in submission order,
and the process-wide one that ``NVMeWriter(mirror=...)`` hands its commits to."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from dcp_nvme.tiers.drainer import DrainResult, drain
from dcp_nvme.tiers.journal import drain_state
from dcp_nvme.tiers.options import DrainOptions

log = logging.getLogger(__name__)


class Drainer:
    """Drains checkpoints in the background, one at a time, in submission order.

    ``submit`` returns a Future resolving to a DrainResult (or raising DrainError). With
    ``keep_last=K`` the parent directory of each drained checkpoint is pruned to the K newest
    local checkpoints after every success; checkpoints not yet mirrored are never removed.
    The worker thread is not a daemon: a process that ends waits for queued drains.
    """

    def __init__(self, options: DrainOptions | None = None, *, keep_last: int | None = None) -> None:
        self.options = options or DrainOptions()
        self.keep_last = keep_last
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-drain")
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, local: str | os.PathLike, target: str, *, storage_options: dict[str, Any] | None = None,
               filesystem: Any = None, compress: str | None = None) -> Future[DrainResult]:
        options = self.options if compress is None else replace(self.options, compress=compress)

        def run() -> DrainResult:
            result = drain(local, target, storage_options=storage_options, filesystem=filesystem,
                           options=options)
            if self.keep_last is not None:
                from dcp_nvme.tiers.retention import apply_retention

                run_dir = os.path.dirname(os.path.abspath(os.fspath(local)))
                try:  # the drain succeeded: a broken sibling must not turn it into a failure
                    apply_retention(run_dir, self.keep_last, storage_options=storage_options)
                except Exception as exc:  # noqa: BLE001
                    log.error("dcp_nvme: %s is mirrored, but retention in %s failed: %s", local, run_dir, exc)
                    result.errors.append(f"retention in {run_dir}: {type(exc).__name__}: {exc}")
            return result

        future = self._pool.submit(run)
        future.add_done_callback(_log_failure)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [future]
        return future

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted drain has finished; re-raise the first failure."""
        with self._lock:
            futures = list(self._futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in futures:
            future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def state(self, local: str | os.PathLike):
        return drain_state(local)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("dcp_nvme: background drain failed: %s", future.exception())


_default: Drainer | None = None


_default_lock = threading.Lock()


def default_drainer() -> Drainer:
    """The process-wide Drainer used by ``NVMeWriter(mirror=...)``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Drainer()
        return _default


def set_default_drainer(drainer: Drainer | None) -> Drainer | None:
    """Replace the process-wide Drainer (e.g. ``Drainer(DrainOptions(bandwidth=...), keep_last=3)``);
    returns the one it replaces (None: a default one is made on first use)."""
    global _default
    with _default_lock:
        previous, _default = _default, drainer
    return previous
