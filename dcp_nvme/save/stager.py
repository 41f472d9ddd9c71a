"""NVMeStager: DCP's AsyncStager over a reusable, page-aligned staging arena.

``dcp.async_save(sd, storage_writer=NVMeWriter(path), async_stager=NVMeStager())`` blocks the
training thread for one copy of the state into the arena; the write runs in the background.

Layout: tensors are packed back to back in the order DCP's default planner will hand them to
NVMeWriter (the flattened state-dict traversal order), from a page-aligned base, each aligned
to its itemsize (``format.placement.place_back_to_back``). The writer places them in its container at the
same offsets (``format.placement.place_congruent``: congruent to their addresses, the dtype padding a pad
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
upload whose traceback still holds the Future). ``on_busy`` picks wait (default) or fail.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager

from ..config import ALIGN, check_option
from ..engines.buffers import cuda_available
from ..errors import InvalidInputError, StagingBusyError
from . import waves
from .arena import (
    Arena,
    Lease,
    TensorSpec,
    allocate_arena,
    arena_views,
    copy_host,
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
        save writes the live tensors, then resolves it; see ``waves``)."""
        self.wave: waves.WaveRelease | None = None

    def result(self, timeout: float | None = None) -> Any:
        thread = threading.current_thread()
        lease = self.lease
        consumer = thread.ident != self._owner and not thread.name.startswith(_HELPER_PREFIX)
        if lease is not None and consumer and thread not in lease.claimers:
            lease.claimers.append(thread)
        if self.early is not None and consumer and not self.done():
            self._watch(thread)
            return self.early
        return super().result(timeout)

    def _watch(self, save_thread: threading.Thread) -> None:
        """Resolve once the save's thread ends, whatever happened (e.g. it failed before it wrote,
        or this rank wrote none of the live tensors): the live tensors are no longer read."""
        wave = self.wave
        if wave is None or getattr(self, "_watching", False):
            return
        self._watching = True
        threading.Thread(target=lambda: (save_thread.join(), wave.release()),
                         name=f"{_HELPER_PREFIX}-wave", daemon=True).start()


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

    ``stage`` returns a Future, so ``dcp.async_save`` returns an ``AsyncSaveResponse``: wait on
    ``resp.staging_completion`` before changing the parameters (the optimizer step), and on
    ``resp.upload_completion`` for durability (it raises if the background save failed).
    Host tensors are copied before ``stage`` returns; device tensors are copied on a side
    stream, so ``staging_completion`` may still be pending when ``async_save`` returns.
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
    ) -> None:
        if max_bytes is not None:
            max_bytes = check_option("max_bytes", max_bytes)
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
        self.max_bytes = max_bytes
        self._setup()

    def _setup(self) -> None:
        self._arenas = [Arena() for _ in range(self.buffers)]
        self._next = 0
        self._lock = threading.Lock()
        self._helper: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}
        self._counters = {"saves": 0, "rebuilds": 0, "waited_seconds": 0.0,
                          "last_stage_seconds": 0.0, "last_wait_seconds": 0.0,
                          "last_copy_bytes": 0, "last_live_bytes": 0}

    # pickling carries the options only: arenas and threads belong to one process
    def __getstate__(self) -> dict:
        return {"buffers": self.buffers, "on_busy": self.on_busy, "wait_timeout": self.wait_timeout,
                "shared_memory": self.shared_memory, "pin_memory": self.pin_memory,
                "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    # ------------------------------------------------------------------ reporting

    @property
    def arena_bytes(self) -> int:
        return sum(a.nbytes for a in self._arenas)

    @property
    def pinned_bytes(self) -> int:
        # re-checked: a PROCESS save may have moved an unshared arena into (unpinned) shm
        return sum(a.nbytes for a in self._arenas if a.pinned and a.buffer.is_pinned())

    def stats(self) -> dict[str, Any]:
        """Arena and pinned bytes, saves staged, arena rebuilds, and the last stage's timings."""
        out = dict(self._counters)
        out.update(arena_bytes=self.arena_bytes, pinned_bytes=self.pinned_bytes,
                   buffers=self.buffers, shared_memory=self.shared_memory,
                   busy=sum(a.busy() for a in self._arenas))
        return out

    # ------------------------------------------------------------------ staging

    def stage(self, state_dict: STATE_DICT_TYPE) -> Future:
        """Copy ``state_dict`` into a free arena; returns a Future of the staged state dict."""
        started = time.perf_counter()
        with self._lock:
            arena = self._acquire()
            waited = time.perf_counter() - started
            tensors: list[torch.Tensor] = []
            objects: list[Any] = []
            template = structure_of(state_dict, tensors, objects)
            first = self._first_staged(tensor_specs(template))
            if arena.template != (template, first):
                self._rebuild(arena, (template, first))
            future = _StagedFuture(threading.get_ident())
            future.lease = Lease(future)
            arena.lease = future.lease
            live = [t.detach() for t in tensors[:first]]
            staged = materialize(template, live + arena.views, objects)
            device_pairs = []
            for src, dst in zip(tensors[first:], arena.views):
                if src.device.type == "cpu":
                    copy_host(dst, src.detach())
                else:
                    device_pairs.append((dst, src.detach()))
            nbytes = sum(v.numel() * v.element_size() for v in arena.views)
            if live:
                self._hand_over_live(future, staged, live, device_pairs)
            elif device_pairs:
                self._copy_device(device_pairs, future, staged)
            else:
                future.set_result(staged)
            c = self._counters
            c["last_live_bytes"] = sum(t.numel() * t.element_size() for t in live)
            c["saves"] += 1
            c["waited_seconds"] += waited
            c["last_wait_seconds"] = waited
            c["last_copy_bytes"] = nbytes
            c["last_stage_seconds"] = time.perf_counter() - started
            return future

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
                        device_pairs: list) -> None:
        """Bounded staging: the save gets ``staged`` at once (``future.early``); the Future
        resolves when the save has written the live tensors (``waves``) or has ended."""
        if device_pairs:  # the arena's device copies land before the save may read them
            done = _StagedFuture(threading.get_ident())
            self._copy_device(device_pairs, done, staged)
            done.result()
        wave = waves.WaveRelease({t.untyped_storage().data_ptr() for t in live},
                                 lambda error: future.set_result(staged))
        future.early, future.wave = staged, wave
        waves.register(wave)

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

    def _copy_device(self, pairs: list, future: _StagedFuture, staged: Any) -> None:
        """Device-to-arena copies on a side stream; the Future completes when they land."""
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
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix=_HELPER_PREFIX)

        def complete() -> None:
            try:
                for event in events:
                    event.synchronize()
                future.set_result(staged)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the save
                future.set_exception(exc)

        self._helper.submit(complete)

    def synchronize_staging(self) -> None:
        """Nothing to do: waiting happens on the Future returned by stage."""

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
