"""NVMeAsyncSaver: ``dcp.async_save`` with one long-lived save thread.

``dcp.async_save`` starts a new upload thread for every save, and ``Thread.start()`` waits until
the new thread has run; on a busy host that wait is most of what the call costs the training
loop. The saver starts its thread once: a save walks Stateful values, hands the state to the
stager (``NVMeStager.stage`` returns at once, the copy runs on its staging thread) and queues
the rest for the worker, which waits for the copy and runs ``dcp.save``. It returns torch's own
``AsyncSaveResponse``, so code written for ``dcp.async_save`` keeps working. With an
``NVMeStager`` (not bounded by ``max_bytes``) the save is queued from the staging thread once
its copy is done, so the caller wakes one thread per save, not two: on a busy host each wake-up
can cost the caller a context switch.

Saves run one at a time in submission order. The worker is a daemon thread; at interpreter
exit the saves still queued are finished first (a hook that runs before Python shuts down its
thread pools, which the writers use), as ``dcp.async_save``'s upload thread is. In the child
of a ``fork()`` a saver starts a worker of its own at its first save (the parent's thread and
queue did not come along).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - imported first: its exit hook then runs after ours
import functools
import logging
import os
import queue
import threading
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from dcp_nvme.compat import run_before_thread_pools_stop
from dcp_nvme.errors import InvalidInputError, SaveError
from dcp_nvme.save.stager import PERSISTENT, NVMeStager, save_ended
from dcp_nvme.save.writer import NVMeWriter

log = logging.getLogger(__name__)

__all__ = ["NVMeAsyncSaver", "missing_cpu_backend"]

_WORKERS: dict[threading.Thread, _Channel] = {}
"""Every worker still running and its channel: drained at interpreter exit."""
_WORKERS_LOCK = threading.Lock()


@dataclass
class _Job:
    staged: Any  # the stager's Future (or the staged state itself)
    upload: Future
    checkpoint_id: str | os.PathLike | None
    storage_writer: StorageWriter | None
    planner: SavePlanner | None
    process_group: Any
    no_dist: bool
    use_collectives: bool


class _Channel:
    """The worker's queue, and the saves staged whose job is not queued yet (queued from the
    staging thread when their copy is done). ``stop`` queues the worker's end after them."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._unqueued = 0
        self._stopping = False

    def put(self, job: _Job) -> None:
        self.jobs.put(job)

    def expect(self) -> None:
        """A job will come through ``put_staged``."""
        with self._lock:
            self._unqueued += 1

    def put_staged(self, job: _Job | None) -> None:
        """The job announced by ``expect`` (None: it will not come, its stage() failed)."""
        with self._lock:
            if job is not None:
                self.jobs.put(job)
            self._unqueued -= 1
            last = self._stopping and self._unqueued == 0
        if last:
            self.jobs.put(None)

    def stop(self) -> None:
        """The worker ends after the saves made so far; returns at once (safe on any thread)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            now = self._unqueued == 0
        if now:
            self.jobs.put(None)


def missing_cpu_backend(backend_config: str) -> bool:
    """Whether a process group's ``dist.get_backend_config`` (``"cpu:gloo,cuda:nccl"``) lacks a
    CPU backend: the save thread's collectives run on the staged host tensors."""
    devices = {part.split(":", 1)[0].strip() for part in backend_config.lower().split(",") if ":" in part}
    return "cpu" not in devices


class NVMeAsyncSaver:
    """Asynchronous DCP saves through one persistent worker thread and one stager.

    Args:
        stager: the AsyncStager to stage with (default: a new ``NVMeStager()``, closed by
            :meth:`close`); a stager you pass stays yours to close.

    ``save`` takes ``dcp.async_save``'s arguments (without ``async_checkpointer_type`` and
    ``async_stager``) and returns its ``AsyncSaveResponse``: wait on ``staging_completion``
    before the optimizer step changes the tensors, on ``upload_completion`` (``dcp.save``'s
    Metadata, or its exception) for durability. Use it as a context manager, or call
    :meth:`close` after the last save.
    """

    def __init__(self, stager: AsyncStager | None = None) -> None:
        if stager is not None and not isinstance(stager, AsyncStager):
            raise InvalidInputError(f"stager must be an AsyncStager such as NVMeStager(), got "
                                    f"{type(stager).__name__}")
        self.stager: AsyncStager = stager if stager is not None else NVMeStager()
        self._owned = self.stager if stager is None else None
        self._lock = threading.Lock()
        self._closed = False
        self._worker: threading.Thread | None = None
        self._start()
        _SAVERS.add(self)

    def _start(self) -> None:
        """A new channel and worker thread: at creation, and at the first save in a forked child."""
        self._channel = _Channel()
        self._worker = threading.Thread(target=_work, args=(self._channel, self._owned), name="dcp-nvme-saver",
                                        daemon=True)
        setattr(self._worker, PERSISTENT, True)
        with _WORKERS_LOCK:
            _WORKERS[self._worker] = self._channel
        self._worker.start()
        # dropped without close(): the worker finishes the saves made, then ends
        self._finalizer = weakref.finalize(self, self._channel.stop)
        self._finalizer.atexit = False  # interpreter exit is _drain_at_exit's

    def _forked(self) -> None:
        """In the child of a fork(): the worker thread is the parent's and did not come along, and
        the saves queued are the parent's (the child must not write them again). The child's
        first save starts a worker of its own; an NVMeStager resets itself (stager.py)."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._finalizer.detach()  # it would stop the parent's channel, which nothing reads here
        self._worker = None

    def save(
        self,
        state_dict: STATE_DICT_TYPE,
        *,
        checkpoint_id: str | os.PathLike | None = None,
        storage_writer: StorageWriter | None = None,
        planner: SavePlanner | None = None,
        process_group: dist.ProcessGroup | None = None,
        no_dist: bool = False,
        use_collectives: bool = True,
    ) -> AsyncSaveResponse:
        """Stage ``state_dict`` and queue its ``dcp.save``; returns at once. Without
        ``storage_writer`` the save writes ``NVMeWriter(checkpoint_id)``."""
        if not isinstance(state_dict, Mapping):
            raise InvalidInputError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if storage_writer is None and checkpoint_id is None:
            raise InvalidInputError("NVMeAsyncSaver.save needs checkpoint_id (a directory) or a storage_writer")
        if dist.is_available() and dist.is_initialized():
            try:
                config = dist.get_backend_config(process_group)
            except ValueError as exc:
                raise InvalidInputError(f"process_group: {exc}; pass a group this rank is in") from exc
            if missing_cpu_backend(config):
                raise InvalidInputError(
                    f"the process group's backends are {config!r}: an async save needs a CPU backend; "
                    "initialize it with backend='cpu:gloo,cuda:nccl'")
        # hasattr first: isinstance against the Protocol costs tens of microseconds per value
        state = {key: value.state_dict() if hasattr(value, "state_dict") and isinstance(value, Stateful)
                 else value for key, value in state_dict.items()}
        staging: Future = Future()
        upload: Future = Future()
        job = _Job(None, upload, checkpoint_id, storage_writer, planner, process_group, no_dist, use_collectives)
        # NVMeStager's copies end in the order they were started (one staging thread), so queuing
        # each save when its copy ends keeps the saves in order, and the staging thread wakes the
        # worker; a bounded save's Future ends only once the save has written its live tensors:
        # that one is queued at once
        deferred = isinstance(self.stager, NVMeStager) and self.stager.max_bytes is None
        with self._lock:  # a save never queues behind close()'s stop
            if self._closed:
                raise SaveError("this NVMeAsyncSaver is closed; create a new one to save again")
            if self._worker is None:
                self._start()  # the first save in a forked child
            channel = self._channel
            if deferred:
                channel.expect()
            try:
                # last: stage() wakes the staging thread, whose walk then competes for the GIL
                staged = self.stager.stage(state)  # raises as dcp.async_save does (e.g. StagingBusyError)
            except BaseException:
                if deferred:
                    channel.put_staged(None)
                raise
            job.staged = staged
            in_background = isinstance(staged, Future)
            if isinstance(staged, Future):  # in_background, spelled so that mypy narrows staged
                staged.add_done_callback(functools.partial(_staged, staging=staging, channel=channel if deferred
                                                           else None, job=job))
            else:
                staging.set_result(None)
            if not deferred:
                channel.put(job)
            elif not in_background:
                channel.put_staged(job)
        del staged, job  # the job holds it: the arena stays busy until the worker lets go of it
        if not in_background and self.stager.should_synchronize_after_execute:
            self.stager.synchronize_staging()  # as dcp.async_save does for a stager that returns the state
        return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)

    def close(self) -> None:
        """Wait for the queued saves, stop the worker, and close the stager the saver created.
        Idempotent."""
        with self._lock:
            first = not self._closed
            self._closed = True
            worker = self._worker
        if worker is None:  # a forked child that never saved: no worker to close the stager
            if first and self._owned is not None:
                self._owned.close()
            return
        if first:
            self._finalizer()  # the worker stops after the saves made
        if threading.current_thread() is not worker:  # e.g. a callback on upload_completion
            worker.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> NVMeAsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _staged(staged: Future, staging: Future, channel: _Channel | None = None, job: _Job | None = None) -> None:
    """The copy is done (or failed): queue the save if it waits for that, then resolve
    ``staging_completion`` (None, or the staging failure)."""
    if channel is not None and job is not None:
        channel.put_staged(job)
    if staging.cancelled():
        return
    error = staged.exception()
    if error is None:
        staging.set_result(None)
    else:
        staging.set_exception(error)


def _work(channel: _Channel, owned_stager: AsyncStager | None) -> None:
    try:
        while True:
            job = channel.jobs.get()
            if job is None:
                break
            _run(job)
            del job
    finally:
        with _WORKERS_LOCK:
            _WORKERS.pop(threading.current_thread(), None)
        if owned_stager is not None:
            owned_stager.close()


def _run(job: _Job) -> None:
    """One save; the arena is released before upload_completion resolves, so a save started
    right after it finds the arena free."""
    staged, job.staged = job.staged, None
    if not job.upload.set_running_or_notify_cancel():  # cancelled while queued: not run, as in a pool
        try:
            if isinstance(staged, Future):
                staged.result()  # the copy into the arena has ended
        except BaseException:  # noqa: BLE001, S110 - nothing waits for this save any more
            pass
        save_ended(staged)
        return
    try:
        try:
            state = staged.result() if isinstance(staged, Future) else staged
        except BaseException as exc:  # noqa: BLE001 - staging failed: nothing is written
            outcome: tuple[bool, Any] = (False, exc)
        else:
            try:
                writer = job.storage_writer if job.storage_writer is not None else NVMeWriter(job.checkpoint_id)
                metadata = dcp.save(state, checkpoint_id=job.checkpoint_id, storage_writer=writer,
                                    planner=job.planner, process_group=job.process_group, no_dist=job.no_dist,
                                    use_collectives=job.use_collectives)
                outcome = (True, metadata)
            except BaseException as exc:  # noqa: BLE001 - handed to upload_completion
                log.error("dcp_nvme: async save to %s failed: %s", job.checkpoint_id or "its writer", exc)
                outcome = (False, exc)
            del state
    finally:
        save_ended(staged)
        del staged
    ok, value = outcome
    if ok:
        job.upload.set_result(value)
    else:
        job.upload.set_exception(value)


def _drain_at_exit() -> None:
    """Finish every queued save before Python stops its thread pools (the writers use them)."""
    with _WORKERS_LOCK:
        workers = list(_WORKERS.items())
    for worker, channel in workers:
        channel.stop()
        worker.join()


_SAVERS: weakref.WeakSet[NVMeAsyncSaver] = weakref.WeakSet()
"""Every saver alive: reset in the child of a fork()."""


def _after_fork_in_child() -> None:
    """fork() copies the savers but not their threads: each saver in the child starts a worker
    of its own at its first save (instead of queuing to a thread that does not exist there)."""
    global _WORKERS_LOCK
    _WORKERS_LOCK = threading.Lock()
    _WORKERS.clear()  # the parent's workers: not running here, nothing to drain at exit
    for saver in list(_SAVERS):
        saver._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)

run_before_thread_pools_stop(_drain_at_exit)  # the writers' thread pools still take work then
