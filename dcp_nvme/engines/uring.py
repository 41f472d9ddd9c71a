"""io_uring engine: one thread per rank keeps ``queue_depth`` requests in flight on one ring.

Same placement, bounce and checksum rules as the threads engine (``posix.py``), different
submission: instead of ``queue_depth`` threads each blocked in ``pwrite``, one thread queues
requests on a ring and reaps completions, so no thread wakes per request and no request pays a
system call of its own. The bounce buffers are registered with the ring once (fixed buffers:
the kernel pins them at registration, not at every request); where registration is refused
(e.g. RLIMIT_MEMLOCK) the engine says so once and uses plain reads and writes. Checksums are
computed on the submitting thread while the kernel moves the other requests.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from dcp_nvme.config import IOConfig
from dcp_nvme.engines import ring as uring
from dcp_nvme.engines.base import FileWriteResult
from dcp_nvme.engines.host_io import host_address, with_path
from dcp_nvme.engines.posix import PosixEngine, PrefixTracker, PreparedWindow
from dcp_nvme.engines.reads import PreparedRead, ReadSource, finish_read, prepare_read
from dcp_nvme.engines.requests import IOStats, ReadRequest, Window

log = logging.getLogger(__name__)

_probe_lock = threading.Lock()
_probe: list[str | None] = []


def uring_unavailable_reason() -> str | None:
    """Why io_uring cannot run in this process, or None when it can (probed once)."""
    with _probe_lock:
        if not _probe:
            _probe.append(uring.unavailable_reason())
        return _probe[0]


def reset_probe() -> None:
    with _probe_lock:
        _probe.clear()


_T = TypeVar("_T")  # what an op carries for its finish: a PreparedWindow or a PreparedRead


@dataclass
class _Op(Generic[_T]):
    """One request in flight: ``length`` bytes at ``address`` <-> file offset ``offset``; a
    vectored read or write has its ``spans`` (``(address, length)``) instead of an address."""

    task: _T
    address: int
    length: int
    offset: int
    buffer: int  # bounce buffer index, or -1 when the request uses the caller's memory
    done: int = 0
    spans: list[tuple[int, int]] | None = None
    iovecs: object = None  # the iovec array of the vectored transfer in flight: alive until it completes


def _op_for(task: _T, spans: list[tuple[int, int]], offset: int, buffer: int) -> _Op[_T]:
    """The op moving ``spans`` of host memory at file ``offset``: one span is a plain (or
    fixed-buffer) transfer, several a vectored one."""
    length = sum(n for _, n in spans)
    if len(spans) == 1:
        return _Op(task, spans[0][0], length, offset, buffer)
    return _Op(task, 0, length, offset, buffer, spans=spans)


def _remaining(spans: Sequence[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    """The spans still to transfer once the first ``done`` bytes are."""
    out = []
    for address, length in spans:
        if done >= length:
            done -= length
            continue
        out.append((address + done, length - done))
        done = 0
    return out


def _again_bounced(op: _Op[_T], refused: bool, stats: IOStats, begun: dict[int, float], free_buffers: list[int],
                   restart: Callable[[], _Op[_T]]) -> _Op[_T] | None:
    """After EINVAL: when O_DIRECT ``refused`` the op's memory (from now on its file bounces every
    byte), its timing and bounce buffer are given back and ``restart()`` starts the same work
    again, bounced; None (the original error is raised) for a real error or a failed restart."""
    if not refused:
        return None
    stats.end(begun.pop(id(op)), 0)
    if op.buffer >= 0:
        free_buffers.append(op.buffer)
    try:
        return restart()
    except BaseException:  # noqa: BLE001 - the original error is the one to raise
        return None


class UringEngine(PosixEngine):
    """io_uring with a fixed depth per rank, registered bounce buffers, O_DIRECT where allowed."""

    name = "uring"

    def __init__(self, config: IOConfig) -> None:
        super().__init__(config)
        self._ring: uring.Ring | None = None
        self._ring_lock = threading.Lock()  # one pass at a time drives the ring

    def _get_ring(self) -> uring.Ring:
        if self._ring is None:
            pool = self.bounce_pool()
            ring = uring.Ring(self.config.queue_depth)
            try:
                ring.register_buffers([(b.data_ptr(), pool.size) for b in pool.buffers])
            except OSError as exc:
                log.warning("dcp_nvme: io_uring refused to register %d bounce buffers (%s); "
                            "using unregistered reads and writes", len(pool.buffers), exc.strerror)
            self._ring = ring
        return self._ring

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        super().close()

    @property
    def registered_buffers(self) -> bool:
        return self._ring is not None and self._ring.registered

    # ------------------------------------------------------------------ the loop

    def _drive(self, fd: int, tasks, start, finish, write: bool, retry=None) -> None:
        """Start ``start(task) -> _Op`` for each task with queue_depth in flight; call
        ``finish(op)`` as each completes in full. Short transfers are resubmitted for the rest;
        a failed one is replaced by ``retry(op, errno)`` when that gives an op, else raises
        (after the others in flight have landed)."""
        ring = self._get_ring()
        fixed_op = uring.OP_WRITE_FIXED if write else uring.OP_READ_FIXED
        plain_op = uring.OP_WRITE if write else uring.OP_READ
        vector_op = uring.OP_WRITEV if write else uring.OP_READV
        slots: dict[int, _Op] = {}
        free = list(range(self.config.queue_depth))
        failure: list[BaseException] = []

        def submit(slot: int, op: _Op) -> None:
            if op.spans is not None:
                op.iovecs = uring.iovec_array(_remaining(op.spans, op.done))
                ring.prepare(vector_op, fd, ctypes.addressof(op.iovecs), len(op.iovecs), op.offset + op.done, slot)
                return
            fixed = op.buffer >= 0 and ring.registered
            ring.prepare(fixed_op if fixed else plain_op, fd, op.address + op.done,
                         op.length - op.done, op.offset + op.done, slot,
                         op.buffer if fixed else 0)

        def fail(exc: BaseException) -> None:
            if not failure:
                failure.append(exc)

        def reap(wait: int) -> None:
            for slot, result in ring.submit_and_wait(wait):
                op = slots[slot]
                if result < 0:
                    replacement = retry(op, -result) if retry is not None and not failure else None
                    if replacement is not None:
                        slots[slot] = replacement
                        submit(slot, replacement)
                        continue
                    fail(OSError(-result, os.strerror(-result)))
                elif result > 0 and op.done + result < op.length:
                    op.done += result
                    submit(slot, op)  # short transfer: the rest goes out again
                    continue
                elif result == 0 and write:
                    fail(OSError(0, f"the kernel wrote 0 of {op.length - op.done} bytes"))
                else:  # complete, or a read that met the end of the file (finish says so)
                    op.done += result
                    try:
                        finish(op)
                    except BaseException as exc:  # noqa: BLE001 - raised once the ring is idle
                        fail(exc)
                del slots[slot]
                free.append(slot)

        iterator = iter(tasks)
        try:
            for task in iterator:
                if failure:
                    break
                while not free:
                    reap(1)
                slot = free.pop()
                op = start(task)
                slots[slot] = op
                submit(slot, op)
                if not free:
                    reap(1)
        finally:
            while slots:  # never leave the kernel writing into buffers we are about to reuse
                reap(1)
        if failure:
            raise failure[0]

    # ------------------------------------------------------------------ write

    def write_file(
        self, path: str, header: bytes, sources: Sequence[torch.Tensor], checksum_block: int,
        on_progress=None,
    ) -> FileWriteResult:
        """The threads engine's container (header probe, placement, crcs, fsync), its windows
        driven through the ring."""
        pool = self.bounce_pool()
        free_buffers = list(range(len(pool.buffers)))
        begun: dict[int, float] = {}
        tracker = PrefixTracker(on_progress) if on_progress is not None else None
        with self._ring_lock, self.open_container(path, header, sources, checksum_block) as container:
            stats = container.stats

            def start(window: Window) -> _Op[PreparedWindow]:
                prepared = container.prepare(window, free_buffers.pop, free_buffers.append)
                op = _op_for(prepared, prepared.spans, container.data_start + window.offset, prepared.buffer)
                begun[id(op)] = stats.begin()
                return op

            def finish(op: _Op[PreparedWindow]) -> None:
                prepared: PreparedWindow = op.task
                window = prepared.window
                try:
                    stats.end(begun.pop(id(op)), window.length, prepared.copied)
                    container.finish(prepared)
                finally:
                    if op.buffer >= 0:
                        free_buffers.append(op.buffer)
                if tracker is not None:
                    tracker.done(window.offset, window.length)

            def retry(op: _Op[PreparedWindow], code: int) -> _Op[PreparedWindow] | None:
                prepared: PreparedWindow = op.task
                refused = container.refused_direct_memory(OSError(code, os.strerror(code)), prepared)
                return _again_bounced(op, refused, stats, begun, free_buffers, lambda: start(prepared.window))

            self._drive(container.fd, container.windows(), start, finish, True, retry)
        assert container.result is not None  # set by open_container on a clean exit
        return container.result

    # ------------------------------------------------------------------ read

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats:
        """Each request is one read through the ring: straight into host destinations where
        their memory is congruent to the file, the rest into a (registered) bounce buffer,
        verified across both and the bounced pieces copied out (``posix.prepare_read``)."""
        stats = IOStats("read")
        started = time.perf_counter()
        sources: list[ReadSource] = []
        pool = self.bounce_pool()
        free_buffers = list(range(len(pool.buffers)))
        addresses = [host_address(d) for d in dests]
        begun: dict[int, float] = {}
        try:
            by_file: dict[str, list[ReadRequest]] = {}
            for request in requests:
                by_file.setdefault(request.file, []).append(request)
            for path, group in by_file.items():
                try:
                    source = ReadSource.open(path, self.config)
                except OSError as exc:
                    raise with_path(exc, path) from exc
                sources.append(source)

                def start(request: ReadRequest, source=source) -> _Op[PreparedRead]:
                    prepared = prepare_read(request, source, addresses, pool, free_buffers.pop)
                    op = _op_for(prepared, prepared.spans, prepared.lo, prepared.buffer)
                    begun[id(op)] = stats.begin()
                    return op

                def finish(op: _Op[PreparedRead]) -> None:
                    prepared: PreparedRead = op.task
                    try:
                        stats.end(begun.pop(id(op)), prepared.request.length, prepared.copied)
                        finish_read(prepared, op.done, pool, dests)
                    finally:
                        if op.buffer >= 0:
                            free_buffers.append(op.buffer)

                def retry(op: _Op[PreparedRead], code: int, source=source, start=start) -> _Op[PreparedRead] | None:
                    prepared: PreparedRead = op.task
                    refused = source.refused_direct_memory(OSError(code, os.strerror(code)), prepared)
                    return _again_bounced(op, refused, stats, begun, free_buffers,
                                          lambda: start(prepared.request))

                try:
                    with self._ring_lock:
                        self._drive(source.fd, group, start, finish, False, retry)
                except OSError as exc:
                    raise with_path(exc, path) from exc
        finally:
            for source in sources:
                stats.direct_io = stats.direct_io or source.direct
                os.close(source.fd)
        stats.seconds = time.perf_counter() - started
        return stats
