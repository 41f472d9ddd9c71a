"""The background drain: ``Drainer`` drains checkpoints one at a time in submission order,
and the process-wide one that ``NVMeWriter(mirror=...)`` hands its commits to.

Every drain submitted in this process is waited for by ``wait_for_drains`` and, at interpreter
exit, before Python stops its thread pools: the drain (its pieces, the codec) and the fsspec
backends under it need them, and a pool stopped for the exit refuses new work."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from dcp_nvme.compat import run_before_thread_pools_stop
from dcp_nvme.config import EXIT_WAIT_DEFAULT, EXIT_WAIT_ENV, exit_wait
from dcp_nvme.errors import DrainError, InvalidInputError
from dcp_nvme.tiers.drainer import DrainResult, drain
from dcp_nvme.tiers.journal import drain_state
from dcp_nvme.tiers.options import DrainOptions
from dcp_nvme.tiers.transfer import exiting

log = logging.getLogger(__name__)


class Drainer:
    """Drains checkpoints in the background, one at a time, in submission order.

    ``submit`` returns a Future resolving to a DrainResult (or raising DrainError). With
    ``keep_last=K`` the parent directory of each drained checkpoint is pruned to the K newest
    local checkpoints after every success; checkpoints not yet mirrored are never removed.
    A process that ends waits for the queued and running drains (``wait_for_drains``).
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

        try:
            future = self._pool.submit(run)
        except RuntimeError as exc:  # closed, or submitted after the exit stopped the pools
            refused = exiting(exc)
            future = Future()
            future.set_exception(DrainError(os.fspath(local), target, str(refused) if refused is not None
                                            else f"the drainer is closed ({exc})"))
        _track(future, os.fspath(local), target)
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


_pending: dict[Future, tuple[str, str, float]] = {}
"""Every drain submitted in this process, by any Drainer, that has not ended: its checkpoint,
its target and when it was submitted (monotonic)."""
_ended = threading.Condition()


def _track(future: Future, local: str, target: str) -> None:
    with _ended:
        _pending[future] = (local, target, time.monotonic())
    future.add_done_callback(_untrack)  # at once when it has already ended


def _untrack(future: Future) -> None:
    with _ended:
        _pending.pop(future, None)
        if not _pending:
            _ended.notify_all()


def _waiting_for() -> list[str]:
    """What each drain still pending is at: its checkpoint, target, age and journaled state."""
    with _ended:
        pending = list(_pending.values())
    now, out = time.monotonic(), []
    for local, target, since in pending:
        try:
            state = drain_state(local)
            at = f"{state.state}, attempt {state.attempts}" + (f": {state.cause}" if state.cause else "")
        except Exception as exc:  # noqa: BLE001  a line of the log must not stop the exit
            at = f"state unknown ({type(exc).__name__})"
        out.append(f"{local} -> {target} (submitted {now - since:.0f} s ago; {at})")
    return out


def wait_for_drains(timeout: float | None = None) -> bool:
    """Wait until every drain submitted in this process (``NVMeWriter(mirror=...)`` submits one
    per commit; any ``Drainer``) has ended, mirrored or failed. Returns True when none is left,
    False when ``timeout`` seconds passed first. A failure is not raised here: the drain's
    Future (``writer.drain_future``) raises its DrainError, ``drain_state(path)`` says
    ``failed: <cause>``, and the log has it. The same wait runs at interpreter exit."""
    with _ended:
        return _ended.wait_for(lambda: not _pending, timeout)


EXIT_WAIT_SAID = 60.0
"""While the exit waits for drains, it says what it still waits for this often (seconds)."""


_SAVES_FIRST: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("dcp_nvme.save.async_saver", "_drain_at_exit", {}),  # NVMeAsyncSaver's queued saves
    ("dcp_nvme.save.node_commit", "settle", {"give_up_waiting": False}),  # node commits in their round
)
"""What may still submit drains at exit, ended first: (module, function, keyword arguments).
Looked up only when the module is loaded: a process that never imported it has none of them."""


def _wait_at_exit() -> None:
    """At interpreter exit, before the thread pools stop: the saves still under way in this
    process end first (each submits its drain as it commits), then every drain."""
    try:
        for module, name, kwargs in _SAVES_FIRST:
            function = getattr(sys.modules.get(module), name, None)
            try:
                if function is not None:
                    function(**kwargs)
            except Exception as exc:  # noqa: BLE001  the drains already submitted are still waited for
                log.error("dcp_nvme: at exit, %s.%s failed: %s", module, name, exc)
        waiting = _waiting_for()
        if not waiting:
            return
        try:
            bound = exit_wait()
        except InvalidInputError as exc:
            bound = EXIT_WAIT_DEFAULT
            log.error("dcp_nvme: %s; waiting the default %d s", exc, bound)
        log.warning("dcp_nvme: the process waits up to %d s (%s) for %d drain(s) to the mirror before it "
                    "exits: %s", bound, EXIT_WAIT_ENV, len(waiting), "; ".join(waiting))
        deadline = time.monotonic() + bound
        while not wait_for_drains(min(EXIT_WAIT_SAID, max(0.0, deadline - time.monotonic()))):
            waiting = _waiting_for()
            if time.monotonic() >= deadline:
                log.error("dcp_nvme: the process exits without waiting longer than %d s (%s) for %d drain(s): "
                          "%s. What reached each target stays; `dcp-nvme status PATH` tells, `dcp-nvme drain "
                          "PATH` resumes", bound, EXIT_WAIT_ENV, len(waiting), "; ".join(waiting))
                return
            log.warning("dcp_nvme: at exit, still waiting for %d drain(s): %s", len(waiting), "; ".join(waiting))
    except KeyboardInterrupt:
        log.error("dcp_nvme: interrupted at exit: the drains still running stop when Python stops its "
                  "thread pools; `dcp-nvme status PATH` tells, `dcp-nvme drain PATH` resumes")


if not run_before_thread_pools_stop(_wait_at_exit):  # first imported while the interpreter exits
    log.debug("dcp_nvme: no exit hook for drains: the interpreter is already exiting")


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


def _forget_in_child() -> None:
    """In the child of a fork(): the parent's drains run on the parent's threads, so the child's
    exit must not wait for them; the process-wide Drainer's worker did not come along either, so
    the child gets one of its own (same options)."""
    global _ended, _default, _default_lock
    _pending.clear()
    _ended = threading.Condition()  # another thread may have held these at the fork
    _default_lock = threading.Lock()
    if _default is not None:
        _default = Drainer(_default.options, keep_last=_default.keep_last)


os.register_at_fork(after_in_child=_forget_in_child)
