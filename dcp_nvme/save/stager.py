"""NVMeStager: DCP's AsyncStager over a reusable, page-aligned staging arena.

``dcp.async_save(sd, storage_writer=NVMeWriter(path), async_stager=NVMeStager())`` returns at
once: the walk of the state and the copy into the arena run on a staging thread (host tensors;
with CUDA in use the walk stays on the caller, which queues device copies on a side stream), the
write after it on DCP's upload thread.
``staging_completion`` resolves when the copy is done; the caller waits on it before it changes
the tensors (the optimizer step).

Layout: tensors are packed back to back in the order DCP's default planner will hand them to
NVMeWriter (the flattened state-dict traversal order), from a page-aligned base, each aligned
to its itemsize (``format.container.place_back_to_back``). The writer places them in its container at the
same offsets (``format.container.place_congruent``: congruent to their addresses, the dtype padding a pad
entry read from the arena's zeros), so each write window is one aligned span of the arena and
the engines write it straight from there (no bounce copy). Within each mapping, keys that hold tensors are placed before non-tensor leaves:
a pickled object between two tensors would shift every later tensor off the 4 KiB grid.

Reuse: the arena is allocated and first-touched once and reused while the state's structure
(paths, dtypes, shapes, devices, order) is unchanged; it is rebuilt when the structure changes.

Safety: an arena is never re-staged while a save that reads it is in flight. The stager learns
that a save finished without help from the caller: ``stage`` returns a Future; DCP's upload
executor (THREAD and PROCESS) holds that Future until the upload ends and resolves it on its
upload thread. The arena is free again once the Future is garbage (the upload released it) or
every other thread that consumed it has exited (DCP's one-shot upload thread, covering a failed
upload whose traceback still holds the Future). The staging thread holds the Future too until
its copy is done, so an arena being copied into is busy as well. A save thread that outlives its
saves (``NVMeAsyncSaver``'s worker) says so itself: ``save_ended`` frees the arena. ``on_busy``
picks wait (default) or fail.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager

from dcp_nvme.config import ALIGN, check_option
from dcp_nvme.engines.host_io import cuda_available
from dcp_nvme.errors import InvalidInputError, StagingBusyError
from dcp_nvme.save import handoff
from dcp_nvme.save.arena import (
    Arena,
    Lease,
    TensorSpec,
    allocate_arena,
    arena_views,
    copy_host,
    copy_host_chunked,
    materialize,
    plan_arena,
    structure_of,
    tensor_specs,
)

log = logging.getLogger(__name__)


__all__ = ["NVMeStager", "StagingBusyError", "plan_arena"]


_HELPER_PREFIX = "dcp-nvme-stage"


class _StagedFuture(Future):
    """A Future whose consumers are noted: the upload thread that waits on it is the save."""

    def __init__(self, lease_owner: int) -> None:
        super().__init__()
        self._owner = lease_owner
        self.lease: Lease | None = None
        self.early: Any = None
        """A staged state handed to the save before the Future resolves (bounded staging: the
        save writes the live tensors, then resolves it; see ``handoff.WaveRelease``)."""
        self.wave: handoff.WaveRelease | None = None
        self.copied: Future | None = None
        """Bounded staging: resolves when the arena copy is done (the save may read the arena)."""
        self.prepared: threading.Event | None = None
        """Staging on the staging thread: set once the walk is done (``early`` is known)."""

    def result(self, timeout: float | None = None) -> Any:
        thread = threading.current_thread()
        lease = self.lease
        consumer = thread.ident != self._owner and not thread.name.startswith(_HELPER_PREFIX)
        if lease is not None and consumer and thread not in lease.claimers:
            lease.claimers.append(thread)
        if consumer and self.prepared is not None and not self.prepared.wait(timeout):
            raise TimeoutError("the staging thread has not walked the state dict yet")
        if self.early is not None and consumer and not self.done():
            if self.copied is not None:
                self.copied.result(timeout)  # the arena's share is copied (raises what the copy raised)
            if self.wave is not None:
                handoff.attach(thread, self.wave)  # this thread's save, and only it, releases training
            self._watch(thread)
            return self.early
        return super().result(timeout)

    def _watch(self, save_thread: threading.Thread) -> None:
        """Resolve once the save's thread ends, whatever happened (e.g. it failed before it wrote,
        or this rank wrote none of the live tensors): the live tensors are no longer read."""
        wave = self.wave
        if wave is None or getattr(self, "_watching", False) or getattr(save_thread, PERSISTENT, False):
            return  # a persistent save thread never ends: it calls save_ended() after each save
        self._watching = True

        def release_when_ended() -> None:
            save_thread.join()
            wave.release()

        threading.Thread(target=release_when_ended, name=f"{_HELPER_PREFIX}-wave", daemon=True).start()


_STAGERS: weakref.WeakSet[NVMeStager] = weakref.WeakSet()
"""Every stager alive: reset in the child of a fork() (``_after_fork_in_child``)."""


def _after_fork_in_child() -> None:
    for stager in list(_STAGERS):
        stager._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


PERSISTENT = "dcp_nvme_persistent"
"""Attribute set on a save thread that runs many saves (NVMeAsyncSaver's worker)."""


def save_ended(staged: Any) -> None:
    """The save that consumed ``staged`` (what ``stage`` returned) has ended, on a thread that
    outlives it: its arena is free again, and a bounded save's training is released. No-op for
    what another stager returned."""
    if not isinstance(staged, _StagedFuture):
        return
    if staged.lease is not None:
        staged.lease.ended = True
    if staged.wave is not None:
        staged.wave.release()


class NVMeStager(AsyncStager):
    """Stage a state dict into a reused arena laid out in NVMeWriter's write order.

    Args:
        buffers: arenas kept (1 = the state's bytes once). With 2, a save can be staged while
            the previous one is still being written, for twice the memory.
        on_busy: ``"wait"`` (default): a save whose arena is still being written waits for
            that write to finish; ``"error"``: raise :class:`StagingBusyError` instead.
        wait_timeout: seconds ``"wait"`` waits before raising StagingBusyError (None: forever).
        shared_memory: allocate the arena in shared memory, for
            ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``: the checkpoint process
            then maps the arena instead of receiving a copy. Without it, the first PROCESS save
            makes torch move the arena into shared memory once (an extra copy in the
            background, and the arena loses its pinning).
        pin_memory: pin the arena for fast device-to-host copies (default: when CUDA exists).
        max_bytes: the most bytes an arena may hold (None: the whole state). A state larger than
            this is saved in two waves: the tensors at the end of the write order that fit are
            copied into the arena; the save first writes the others from your live tensors, and
            only then does ``staging_completion`` resolve (training waits for that write); the
            staged rest is written in the background. Memory stays bounded by ``max_bytes``;
            the stall grows with what does not fit (see docs/async.md).

        background_copy: copy host tensors on the stager's thread (default), so
            ``async_save`` returns before the copy is done; ``False``: copy them before
            ``stage`` returns, with every core (the training thread waits for it). Device
            tensors are copied on a side stream either way.

    ``stage`` returns a Future, so ``dcp.async_save`` returns an ``AsyncSaveResponse``: wait on
    ``resp.staging_completion`` before anything writes into the saved tensors (the optimizer
    step; in-place buffer updates such as BatchNorm's running statistics in a training-mode
    forward), and on ``resp.upload_completion`` for durability (it raises if the background
    save failed, including a failed copy). Non-tensor leaves are copied with the tensors, so
    they too may change only after ``staging_completion``. See docs/async.md.
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        *,
        buffers: int = 1,
        on_busy: str = "wait",
        wait_timeout: float | None = None,
        shared_memory: bool = False,
        pin_memory: bool | None = None,
        max_bytes: int | str | None = None,
        background_copy: bool = True,
    ) -> None:
        limit: int | None = None  # max_bytes, in bytes
        if max_bytes is not None:
            limit = check_option("max_bytes", max_bytes)
            if shared_memory:
                raise InvalidInputError("max_bytes cannot be combined with shared_memory=True: a bounded "
                                 "save writes live tensors, which a checkpoint process cannot read; "
                                 "use the THREAD checkpointer")
        if buffers < 1:
            raise InvalidInputError(f"buffers must be >= 1, got {buffers}")
        if on_busy not in ("wait", "error"):
            raise InvalidInputError(f"on_busy must be 'wait' or 'error', got {on_busy!r}")
        self.buffers = buffers
        self.on_busy = on_busy
        self.wait_timeout = wait_timeout
        self.shared_memory = shared_memory
        self.pin_memory = pin_memory
        self.max_bytes = limit
        self.background_copy = bool(background_copy)
        self._setup()
        _STAGERS.add(self)

    def _setup(self) -> None:
        self._arenas = [Arena() for _ in range(self.buffers)]
        self._next = 0
        self._lock = threading.Lock()
        self._helper: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}
        self._last: weakref.ref | None = None
        self._counters = {"saves": 0, "rebuilds": 0, "waited_seconds": 0.0,
                          "last_stage_seconds": 0.0, "last_wait_seconds": 0.0,
                          "last_copy_seconds": 0.0, "last_copy_bytes": 0, "last_live_bytes": 0}

    # pickling carries the options only: arenas and threads belong to one process
    def __getstate__(self) -> dict:
        return {"buffers": self.buffers, "on_busy": self.on_busy, "wait_timeout": self.wait_timeout,
                "shared_memory": self.shared_memory, "pin_memory": self.pin_memory,
                "max_bytes": self.max_bytes, "background_copy": self.background_copy}

    def __setstate__(self, state: dict) -> None:
        state.setdefault("background_copy", True)
        self.__dict__.update(state)
        self._setup()
        _STAGERS.add(self)

    def _forked(self) -> None:
        """In the child of a fork(): the staging thread is the parent's, and so are the arenas
        (their mmap and shared memory are shared with the parent, which may be writing them):
        start afresh, without freeing anything (CUDA cannot be called in a forked child)."""
        self._setup()

    # ------------------------------------------------------------------ reporting

    @property
    def arena_bytes(self) -> int:
        return sum(a.nbytes for a in self._arenas)

    @property
    def pinned_bytes(self) -> int:
        # re-checked: a PROCESS save may have moved an unshared arena into (unpinned) shm
        return sum(a.nbytes for a in self._arenas if a.pinned and a.buffer is not None and a.buffer.is_pinned())

    def stats(self) -> dict[str, Any]:
        """Arena and pinned bytes, saves staged, arena rebuilds, and the last stage's timings:
        ``last_stage_seconds`` the caller was held by ``stage``, ``last_copy_seconds`` from the
        call until the copy was done (0 until then)."""
        out = dict(self._counters)
        out.update(arena_bytes=self.arena_bytes, pinned_bytes=self.pinned_bytes,
                   buffers=self.buffers, shared_memory=self.shared_memory,
                   busy=sum(a.busy() for a in self._arenas))
        return out

    # ------------------------------------------------------------------ staging

    def stage(self, state_dict: STATE_DICT_TYPE) -> Future:
        """Start staging ``state_dict`` into a free arena; returns a Future of the staged state
        dict, resolved when the copy is done. Without CUDA in use (and with ``background_copy``)
        everything after picking the arena runs on the staging thread: the structure walk too."""
        started = time.perf_counter()
        with self._lock:
            arena = self._acquire()
            waited = time.perf_counter() - started
            future = _StagedFuture(threading.get_ident())
            future.lease = Lease(future)
            arena.lease = future.lease
            self._last = weakref.ref(future)
            c = self._counters
            c["saves"] += 1
            c["waited_seconds"] += waited
            c["last_wait_seconds"] = waited
            c["last_copy_seconds"] = 0.0
            if self.background_copy and not torch.cuda.is_initialized():
                # no device tensors can be in the state: nothing must be queued on this thread
                future.prepared = threading.Event()
                self._executor().submit(self._prepare_on_thread, arena, state_dict, future, started)
            else:
                # device copies are queued here, behind the work already on the current stream
                self._prepare(arena, state_dict, future, started)
            c["last_stage_seconds"] = time.perf_counter() - started
            return future

    def _prepare_on_thread(self, arena: Arena, state_dict: STATE_DICT_TYPE, future: _StagedFuture,
                           started: float) -> None:
        try:
            self._prepare(arena, state_dict, future, started)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the save
            if not threading.main_thread().is_alive() or (isinstance(exc, RuntimeError)
                                                          and "after interpreter shutdown" in str(exc)):
                # the process exits (Ctrl-C, the end of the script): Python's pools refuse new work
                abandoned = RuntimeError(
                    "the process is exiting (its main thread ended, e.g. by Ctrl-C) while a save was being "
                    "staged: that save is abandoned and nothing of it is written; the checkpoints before it "
                    "are untouched. Wait for upload_completion before the script ends to keep a save")
                abandoned.__cause__ = exc
                log.warning("dcp_nvme: %s", abandoned)
                future.set_exception(abandoned)
            else:
                log.error("dcp_nvme: staging failed: %s", exc)
                future.set_exception(exc)
        finally:
            assert future.prepared is not None
            future.prepared.set()

    def _prepare(self, arena: Arena, state_dict: STATE_DICT_TYPE, future: _StagedFuture, started: float) -> None:
        """Walk the state, (re)lay out the arena, build the staged dict, start the copies."""
        tensors: list[torch.Tensor] = []
        objects: list[Any] = []
        template = structure_of(state_dict, tensors, objects)
        first = self._first_staged(tensor_specs(template))
        if arena.template != (template, first):
            self._rebuild(arena, (template, first))
        live = [t.detach() for t in tensors[:first]]
        staged = materialize(template, live + arena.views, objects)
        host_pairs, device_pairs = [], []
        for src, dst in zip(tensors[first:], arena.views):
            if src.device.type != "cpu":
                device_pairs.append((dst, src.detach()))
            elif self.background_copy:
                host_pairs.append((dst, src.detach()))
            else:
                copy_host(dst, src.detach())
        c = self._counters
        c["last_live_bytes"] = sum(t.numel() * t.element_size() for t in live)
        c["last_copy_bytes"] = sum(v.numel() * v.element_size() for v in arena.views)
        if live:
            self._hand_over_live(future, staged, live, host_pairs, device_pairs, started)
        elif host_pairs or device_pairs:
            self._copy_background(host_pairs, device_pairs, future, staged, started)
        else:
            c["last_copy_seconds"] = time.perf_counter() - started
            future.set_result(staged)

    def _executor(self) -> ThreadPoolExecutor:
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix=_HELPER_PREFIX)
        return self._helper

    def _acquire(self) -> Arena:
        """The next arena no save is reading; waits or fails per ``on_busy``."""
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        order = [self._arenas[(self._next + i) % self.buffers] for i in range(self.buffers)]
        for arena in order:
            if not arena.busy():
                self._next = (self._arenas.index(arena) + 1) % self.buffers
                return arena
        if self.on_busy == "error":
            raise StagingBusyError(
                f"all {self.buffers} staging arena(s) are still being written by earlier saves; "
                "wait on the previous response's upload_completion, or create the stager with "
                "on_busy='wait' or more buffers"
            )
        arena = order[0]  # the oldest save finishes first
        delay = 0.0005
        while arena.busy():
            if deadline is not None and time.monotonic() > deadline:
                raise StagingBusyError(
                    f"the previous save still holds the staging arena after {self.wait_timeout} s; "
                    "it is still writing (or a Future returned by stage() is being kept alive)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        self._next = (self._arenas.index(arena) + 1) % self.buffers
        return arena

    def _first_staged(self, specs: list[TensorSpec]) -> int:
        """Index of the first tensor the arena holds: 0 when the state fits in ``max_bytes``,
        else the start of the longest tail of the write order that fits."""
        if self.max_bytes is None:
            return 0
        first = len(specs)
        while first > 0 and plan_arena(specs[first - 1 :])[1] <= self.max_bytes:
            first -= 1
        return first

    def _hand_over_live(self, future: _StagedFuture, staged: Any, live: list[torch.Tensor],
                        host_pairs: list, device_pairs: list, started: float) -> None:
        """Bounded staging: the save gets ``staged`` once the arena copy is done
        (``future.early``, ``future.copied``); the Future resolves when the save has written
        the live tensors (``handoff.WaveRelease``) or has ended, or with the copy's error."""
        copied: Future = Future()

        def resolve(error: BaseException | None) -> None:
            failed = copied.exception() if copied.done() else None
            if failed is not None:
                future.set_exception(failed)
            else:
                future.set_result(staged)

        wave = handoff.WaveRelease({t.untyped_storage().data_ptr() for t in live}, resolve)

        # a failed copy: the save raises it and may never report progress; training is released
        def release_if_failed(done: Future) -> None:
            if done.exception() is not None:
                wave.release()

        copied.add_done_callback(release_if_failed)
        future.early, future.wave, future.copied = staged, wave, copied
        if host_pairs or device_pairs:
            self._copy_background(host_pairs, device_pairs, copied, staged, started)
        else:
            copied.set_result(staged)

    def _rebuild(self, arena: Arena, layout: tuple) -> None:
        template, first = layout
        specs = tensor_specs(template)[first:]
        offsets, total = plan_arena(specs)
        pin = cuda_available() if self.pin_memory is None else self.pin_memory
        if arena.buffer is not None:
            self._counters["rebuilds"] += 1
        # reuse a large-enough buffer (same bytes, new layout); otherwise free first, so the
        # peak is one arena, not two
        if arena.buffer is None or arena.nbytes < total or arena.nbytes > 2 * max(total, ALIGN):
            arena.release_memory()
            arena.buffer, arena.pinned, arena.registered = allocate_arena(total, pin, self.shared_memory)
            log.info("dcp_nvme: staging arena of %d bytes (pinned=%s, shared=%s)",
                     arena.nbytes, arena.pinned, self.shared_memory)
        arena.template = layout
        arena.views = arena_views(arena.buffer, specs, offsets)

    def _copy_background(self, host_pairs: list, device_pairs: list, future: Future, staged: Any,
                         started: float) -> None:
        """The arena copy off the caller's thread: device tensors on a side stream (queued here,
        behind the work already queued on the current stream), host tensors on the staging
        thread, chunked; ``future`` completes when both are done, or fails with what failed."""
        events = self._queue_device(device_pairs) if device_pairs else []
        counters = self._counters

        def complete() -> None:
            try:
                for dst, src in host_pairs:
                    copy_host_chunked(dst, src)
                for event in events:
                    event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the save
                log.error("dcp_nvme: staging copy failed: %s", exc)
                future.set_exception(exc)
                return
            counters["last_copy_seconds"] = time.perf_counter() - started
            future.set_result(staged)

        self._executor().submit(complete)  # on the staging thread: queued behind a walk there

    def _queue_device(self, pairs: list) -> list:
        """Queue device-to-arena copies on a side stream; returns the events marking their end."""
        events = []
        by_device: dict[torch.device, list] = {}
        for dst, src in pairs:
            by_device.setdefault(src.device, []).append((dst, src))
        for device, group in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            # the side stream must see every write the training stream queued to these tensors
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # keep src's memory until the copy ran
                events.append(stream.record_event())
        return events

    def synchronize_staging(self) -> None:
        """Wait until the last ``stage``'s copy is done (as ``staging_completion`` does); raises
        what the copy raised. ``dcp.async_save`` never calls it (``should_synchronize_after_execute``
        is False): waiting is the caller's, on ``staging_completion``, before the optimizer step."""
        future = self._last() if self._last is not None else None
        if future is None:
            return  # released by the save and the staging thread: the copy is long done
        wait([future])
        error = future.exception()
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for saves still reading the arenas, then free the arenas and threads."""
        with self._lock:
            for arena in self._arenas:
                while arena.busy():
                    time.sleep(0.005)
                arena.release_memory()
            if self._helper is not None:
                self._helper.shutdown(wait=True)
                self._helper = None
