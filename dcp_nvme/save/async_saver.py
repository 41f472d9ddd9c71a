"""NVMeAsyncSaver: ``dcp.async_save`` with one long-lived save thread.

``dcp.async_save`` starts a new upload thread for every save, and ``Thread.start()`` waits until
the new thread has run; on a busy host that wait is most of what the call costs the training
loop. The saver starts its thread once: a save walks Stateful values, hands the state to the
stager (``NVMeStager.stage`` returns at once, the copy runs on its staging thread) and queues
the rest for the worker, which waits for the copy and runs ``dcp.save``. It returns torch's own
``AsyncSaveResponse``, so code written for ``dcp.async_save`` keeps working.

Saves run one at a time in submission order. The worker is a daemon thread; at interpreter
exit the saves still queued are finished first (a hook that runs before Python shuts down its
thread pools, which the writers use), as ``dcp.async_save``'s upload thread is.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - imported first: its exit hook then runs after ours
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

from ..errors import InvalidInputError, SaveError
from .stager import PERSISTENT, NVMeStager, save_ended
from .writer import NVMeWriter

log = logging.getLogger(__name__)

__all__ = ["NVMeAsyncSaver", "missing_cpu_backend"]

_WORKERS: dict[threading.Thread, queue.SimpleQueue] = {}
"""Every worker still running and its queue: drained at interpreter exit."""
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
        owned = self.stager if stager is None else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._worker = threading.Thread(target=_work, args=(self._jobs, owned), name="dcp-nvme-saver",
                                        daemon=True)
        setattr(self._worker, PERSISTENT, True)
        with _WORKERS_LOCK:
            _WORKERS[self._worker] = self._jobs
        self._worker.start()
        # dropped without close(): the worker finishes what is queued, then ends
        self._finalizer = weakref.finalize(self, self._jobs.put, None)
        self._finalizer.atexit = False  # interpreter exit is _drain_at_exit's

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
        state = {key: value.state_dict() if isinstance(value, Stateful) else value
                 for key, value in state_dict.items()}
        with self._lock:  # a save never queues behind close()'s stop
            if self._closed:
                raise SaveError("this NVMeAsyncSaver is closed; create a new one to save again")
            staged = self.stager.stage(state)  # raises as dcp.async_save does (e.g. StagingBusyError)
            staging: Future = Future()
            upload: Future = Future()
            in_background = isinstance(staged, Future)
            if in_background:
                staged.add_done_callback(lambda done: _mirror(done, staging))
            else:
                staging.set_result(None)
            self._jobs.put(_Job(staged, upload, checkpoint_id, storage_writer, planner, process_group,
                                no_dist, use_collectives))
        del staged  # the job holds it: the arena stays busy until the worker lets go of it
        if not in_background and self.stager.should_synchronize_after_execute:
            self.stager.synchronize_staging()  # as dcp.async_save does for a stager that returns the state
        return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)

    def close(self) -> None:
        """Wait for the queued saves, stop the worker, and close the stager the saver created.
        Idempotent."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            self._finalizer()  # queues the worker's stop
        if threading.current_thread() is not self._worker:  # e.g. a callback on upload_completion
            self._worker.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> NVMeAsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mirror(staged: Future, staging: Future) -> None:
    """``staging_completion``: None once staged, or the staging failure."""
    error = staged.exception()
    if error is None:
        staging.set_result(None)
    else:
        staging.set_exception(error)


def _work(jobs: queue.SimpleQueue, owned_stager: AsyncStager | None) -> None:
    try:
        while True:
            job = jobs.get()
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
    for worker, jobs in workers:
        jobs.put(None)
        worker.join()


# threading's own exit hooks run before the interpreter's thread pools refuse work;
# concurrent.futures registers its shutdown there too (ours, registered later, runs first)
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_drain_at_exit)
