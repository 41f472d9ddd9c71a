"""kvikio engine: device memory straight to and from the file through cuFile.

Device tensors are written with ``kvikio.CuFile.pwrite`` and read with ``pread`` from and into
device memory: GPUDirect Storage where the platform has it, kvikio's compatibility mode (its
own pinned bounce buffers, inside kvikio) where it does not. This module never copies device
bytes to the host. Windows or reads that touch only host memory are delegated to a
``PosixEngine`` (host memory is what that engine is measured and tuned for), so a mixed state
dict is one file written by both: the header and host windows through POSIX, device windows
through cuFile, then one ``ftruncate`` + ``fsync`` as in the POSIX engine.

Integrity without a host copy: the crc32c of every checksum block is computed on the device
with torch ops (``device_checksums.device_crc32c``, two table lookups and XOR trees), bit-identical to
the ``crc32c`` library. The on-disk format therefore does not depend on the engine: a checkpoint
written by one engine loads and verifies through the other.

Nothing here imports kvikio or touches CUDA at import time; ``probe`` is the run-time check.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from dcp_nvme.config import ALIGN, IOConfig
from dcp_nvme.engines.base import FileWriteResult, PicklesAsConfig
from dcp_nvme.engines.host_io import check_length
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.engines.requests import SCRATCH, IOStats, ReadRequest, Window, run_bounded
from dcp_nvme.format.device_checksums import check_device, device_crc32c_async, finish_crc32c

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- kvikio access

PROBE_TIMEOUT = 60.0
"""Seconds the kvikio probe may take before kvikio is given up for posix (a hung cuFile driver)."""
_PROBE_BYTES = 2 * ALIGN


def import_kvikio() -> ModuleType:
    """Import kvikio now (never at dcp_nvme's import time)."""
    return importlib.import_module("kvikio")


def explain_failure(exc: BaseException) -> str:
    """Name what is missing from a kvikio error, keeping its own text."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lowered = text.lower()
    if "libcuda" in lowered:
        return f"libcuda missing (the NVIDIA driver library cannot be loaded): {text}"
    if any(word in lowered for word in ("cufile", "cu_file", "nvidia-fs", "nvidia_fs", "gds")):
        return f"cuFile driver refused: {text}"
    return f"kvikio probe I/O failed: {text}"


def _probe_tensor(nbytes: int) -> torch.Tensor:
    """A device buffer holding a known pattern (patched in CPU tests)."""
    return (torch.arange(nbytes, dtype=torch.int32, device="cuda") % 251).to(torch.uint8)


def _probe_once(directory: str) -> str | None:
    kvikio = import_kvikio()
    path = os.path.join(directory, f".dcp_nvme-kvikio-probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        data = _probe_tensor(_PROBE_BYTES)
        handle = kvikio.CuFile(path, "w")
        try:
            written = handle.pwrite(data, _PROBE_BYTES, 0).get()
        finally:
            handle.close()
        back = torch.zeros_like(data)
        handle = kvikio.CuFile(path, "r")
        try:
            got = handle.pread(back, _PROBE_BYTES, 0).get()
        finally:
            handle.close()
        if written != _PROBE_BYTES or got != _PROBE_BYTES or not torch.equal(back, data):
            return (f"kvikio probe I/O in {directory} moved {written}/{got} of {_PROBE_BYTES} bytes "
                    "or read back different bytes")
        return None
    except Exception as exc:  # noqa: BLE001 - every failure is a reason not to use kvikio
        return explain_failure(exc)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def probe(directory: str, timeout: float | None = None) -> str | None:
    """Write and read back a few KiB of device memory with kvikio in ``directory``.

    Returns None when it works, else why not. Runs in a thread with a timeout: a cuFile driver
    that hangs (seen on a machine without a GPU driver) must not hang the save.
    """
    if timeout is None:
        timeout = PROBE_TIMEOUT
    result: list[str | None] = []
    thread = threading.Thread(target=lambda: result.append(_probe_once(directory)),
                              name="dcp-nvme-kvikio-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        return f"kvikio probe I/O in {directory} did not finish within {timeout:g} s (cuFile driver hung?)"
    return result[0]


def kvikio_mode(kvikio: ModuleType) -> str:
    """'GDS' or 'compat' (cuFile without GPUDirect: kvikio bounces through its own buffers)."""
    try:
        return "compat" if kvikio.defaults.is_compat_mode_preferred() else "GDS"
    except Exception:  # noqa: BLE001 - an older or fake kvikio: say nothing wrong
        return "unknown"


# --------------------------------------------------------------------------- the engine


class _DevicePool:
    """``count`` device buffers of ``size`` bytes, one per request in flight that needs one."""

    def __init__(self, count: int, size: int, device: torch.device) -> None:
        self.size = size
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(count):
            self.free.put(index)

    @contextlib.contextmanager
    def take(self) -> Iterator[torch.Tensor]:
        index = self.free.get()
        try:
            yield self.buffers[index]
        finally:
            self.free.put(index)


class KvikioEngine(PicklesAsConfig):
    """cuFile through kvikio for device memory; a PosixEngine for host memory."""

    name = "kvikio"

    def __init__(self, config: IOConfig, kvikio_module: ModuleType | None = None) -> None:
        self.config = config
        self._kvikio = kvikio_module
        self._configured = False
        self._posix = PosixEngine(config)
        self._pools: dict[str, _DevicePool] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self.device_bytes = {"write": 0, "read": 0}
        """Bytes moved by cuFile (not POSIX) since the engine was made: what the GPU check reads."""

    # ------------------------------------------------------------------ shared

    def _on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through cuFile (CPU tests subclass this to fake a device)."""
        return tensor.device.type == "cuda"

    @property
    def kvikio(self) -> ModuleType:
        with self._lock:
            if self._kvikio is None:
                self._kvikio = import_kvikio()
            if not self._configured:
                self._configure(self._kvikio)
                self._configured = True
            return self._kvikio

    def _configure(self, kvikio: ModuleType) -> None:
        # Each request is one kvikio task (task_size=block_size); kvikio runs tasks on its own
        # pool, which must have a thread per request we keep in flight or it would serialize them.
        try:
            if kvikio.defaults.get("num_threads") < self.config.queue_depth:
                kvikio.defaults.set("num_threads", self.config.queue_depth)
        except Exception as exc:  # noqa: BLE001 - older kvikio: its own default applies
            log.debug("could not set kvikio num_threads: %s", exc)

    def _pool(self, device: torch.device) -> _DevicePool:
        key = str(device)
        with self._lock:
            if key not in self._pools:
                self._pools[key] = _DevicePool(self.config.queue_depth,
                                               self.config.block_size + 2 * ALIGN, device)
            return self._pools[key]

    @contextlib.contextmanager
    def _stream(self, device: torch.device) -> Iterator[None]:
        """This thread's side stream on ``device`` (CUDA), so threads never wait on each other."""
        if device.type != "cuda":
            yield
            return
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        if str(device) not in streams:
            streams[str(device)] = torch.cuda.Stream(device)
        with torch.cuda.stream(streams[str(device)]):
            yield

    @staticmethod
    def _sync(device: torch.device) -> None:
        """Wait for the current stream of ``device`` (inside ``_stream``: this thread's)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def close(self) -> None:
        with self._lock:
            self._pools = {}
        self._posix.close()

    # ------------------------------------------------------------------ write

    def write_file(
        self, path: str, header: bytes, sources: Sequence[torch.Tensor], checksum_block: int
    ) -> FileWriteResult:
        on_device = [self._on_device(s) for s in sources]
        if not any(on_device):
            return self._posix.write_file(path, header, sources, checksum_block)
        kvikio = self.kvikio
        for device in {s.device for s, dev in zip(sources, on_device) if dev}:
            self._sync(device)  # the bytes the producers queued must be there before cuFile reads
        # the POSIX engine creates the file, writes the header and host windows, cuts and fsyncs
        # it (fsync is per file: it covers cuFile's writes too); device windows go through cuFile
        with self._posix.open_container(path, header, sources, checksum_block) as container:
            container.addresses = [None if dev else a for a, dev in zip(container.addresses, on_device)]
            handle = _open_cufile(kvikio, path, "r+")  # "r+": no truncation, the header stays

            def write_window(window: Window) -> None:
                if any(on_device[p.source] for p in window.pieces):
                    self._write_device_window(handle, container, window, on_device)
                else:
                    container.write_host_window(window)

            try:
                run_bounded(self.config.queue_depth, container.windows(), write_window)
            finally:
                handle.close()
        assert container.result is not None  # set by open_container on a clean exit
        return container.result

    def _write_device_window(self, handle, container, window, on_device) -> None:
        sources, stats, checksum_block = container.sources, container.stats, container.checksum_block
        first = window.pieces[0]
        device = next(sources[p.source].device for p in window.pieces if on_device[p.source])
        with contextlib.ExitStack() as stack:
            if len(window.pieces) == 1:  # one span of one tensor: straight from it
                view, copied = sources[first.source][first.src_offset : first.src_offset + first.length], 0
            else:  # several tensors: gather on the device (device-to-device), one request
                buffer = stack.enter_context(self._pool(device).take())
                with self._stream(device):
                    for piece in window.pieces:
                        src = sources[piece.source][piece.src_offset : piece.src_offset + piece.length]
                        buffer[piece.dst_offset : piece.dst_offset + piece.length].copy_(
                            src, non_blocking=True)
                view, copied = buffer[: window.length], window.length
            with self._stream(device):
                pending = device_crc32c_async(view, checksum_block)  # overlaps the write
                if copied:
                    self._sync(device)  # the gather must land before cuFile reads it
                offset = container.data_start + window.offset
                begun = stats.begin()
                written = _kvikio_call(handle.pwrite, view, window.length, offset,
                                       self.config.block_size, container.path, "write")
                stats.end(begun, window.length, copied)
                if written != window.length:
                    raise OSError(errno.EIO, f"kvikio wrote {written} of {window.length} bytes at "
                                  f"offset {offset}", container.path)
                container.record_crcs(window, finish_crc32c(pending, window.length, checksum_block))
        with self._lock:
            self.device_bytes["write"] += window.length

    # ------------------------------------------------------------------ read

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats:
        on_device = [self._on_device(d) for d in dests]
        device_requests: list[ReadRequest] = []
        host_requests: list[ReadRequest] = []
        for request in requests:
            touches = any(d != SCRATCH and on_device[d] for d, _, _ in request.pieces)
            (device_requests if touches else host_requests).append(request)
        stats = IOStats("read")
        if host_requests:
            stats.merge(self._posix.read(host_requests, dests))
        if not device_requests:
            return stats
        kvikio = self.kvikio
        started = time.perf_counter()
        device_stats = IOStats("read")
        handles: dict[str, tuple[Any, int]] = {}
        lock = threading.Lock()

        def handle(path: str) -> tuple[Any, int]:
            with lock:
                if path not in handles:
                    opened = _open_cufile(kvikio, path, "r")
                    handles[path] = (opened, os.fstat(opened.fileno()).st_size)
                return handles[path]

        def run(request: ReadRequest) -> None:
            self._read_device_request(handle, request, dests, on_device, device_stats)

        for device in {d.device for d, dev in zip(dests, on_device) if dev}:
            self._sync(device)  # nothing queued may still write the destinations
        try:
            run_bounded(self.config.queue_depth, device_requests, run)
        finally:
            for opened, _ in handles.values():
                opened.close()
        device_stats.seconds = time.perf_counter() - started
        stats.merge(device_stats)
        return stats

    def _read_device_request(self, handle, request, dests, on_device, stats) -> None:
        opened, file_size = handle(request.file)
        check_length(request, min(file_size, request.file_offset + request.length))
        device = next(dests[d].device for d, _, _ in request.pieces if d != SCRATCH and on_device[d])
        dest, dest_offset, length = request.pieces[0]
        single = len(request.pieces) == 1 and dest != SCRATCH and on_device[dest]
        with contextlib.ExitStack() as stack:
            if single:  # straight into the destination
                view = dests[dest][dest_offset : dest_offset + length]
            else:
                buffer = stack.enter_context(self._pool(device).take())
                view = buffer[: request.length]
            with self._stream(device):
                begun = stats.begin()
                got = _kvikio_call(opened.pread, view, request.length, request.file_offset,
                                   self.config.block_size, request.file, "read")
                stats.end(begun, request.length, 0 if single else request.length)
                check_length(request, request.file_offset + got)
                check_device(request.file, request.file_offset, request.checks, view)
                if not single:
                    position = 0
                    for dest, dest_offset, length in request.pieces:
                        if dest != SCRATCH:
                            dests[dest][dest_offset : dest_offset + length].copy_(
                                view[position : position + length], non_blocking=on_device[dest])
                        position += length
                    self._sync(device)  # the buffer is reused once this returns
        with self._lock:
            self.device_bytes["read"] += request.length


# --------------------------------------------------------------------------- helpers


def _open_cufile(kvikio: ModuleType, path: str, flags: str) -> Any:
    try:
        return kvikio.CuFile(path, flags)
    except OSError:
        raise
    except Exception as exc:  # kvikio reports failures as RuntimeError
        raise OSError(errno.EIO, f"kvikio could not open the file ({exc})", path) from exc


def _kvikio_call(method, view: torch.Tensor, length: int, offset: int, task_size: int,
                 path: str, op: str) -> int:
    """Run one request and wait for it; kvikio's RuntimeErrors become OSErrors naming the file."""
    try:
        return int(method(view, length, offset, task_size).get())
    except OSError:
        raise
    except Exception as exc:
        raise OSError(errno.EIO, f"kvikio {op} of {length} bytes at offset {offset} failed ({exc})",
                      path) from exc
