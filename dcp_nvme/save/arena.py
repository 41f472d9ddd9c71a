"""The staging arena and what it holds (structure pure, memory owned here): a state dict's
structure (tensor leaves, objects, order), the arena's plan for its tensors, the page-aligned
buffer (pinned where CUDA is there, shared for process-based uploads), the views into it, the
lease that keeps a busy arena from being restaged, and the host copy into it."""

from __future__ import annotations

import copy
import ctypes
import logging
import threading
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from dcp_nvme.config import ALIGN
from dcp_nvme.engines.host_io import aligned_buffer
from dcp_nvme.errors import UnsupportedItemError
from dcp_nvme.format.container import place_back_to_back

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor leaf as the arena stores it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def plan_arena(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Offsets of the tensors in the arena, and its size: the container's layout
    (``format.container.place_back_to_back``), each tensor aligned to its dtype's itemsize."""
    return place_back_to_back([s.nbytes for s in specs], [s.dtype.itemsize for s in specs])


_DTENSOR: list[type[torch.distributed.tensor.DTensor]] = []  # (a name only: imported on first use)


def _dtensor_type() -> type[torch.distributed.tensor.DTensor]:
    """torch's DTensor class, imported once (the walk below runs on the caller's thread)."""
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def _is_mapping(value: Any) -> bool:
    return type(value) is dict or isinstance(value, Mapping)  # the abc check is slow; dicts are most


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The tensor whose bytes are stored, and the DTensor spec to rebuild around it (or None)."""
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
        return tensor, None
    DTensor = _dtensor_type()
    if isinstance(tensor, DTensor):
        return tensor._local_tensor, tensor._spec
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise UnsupportedItemError(
            f"NVMeStager cannot stage a {type(tensor).__name__}; use plain tensors or DTensors "
            "(ShardedTensor is deprecated by DCP), or stage with DCP's DefaultStager"
        )
    return tensor, None


SHARD_FIELDS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")
"""A plain tensor carrying all four is a shard of a larger tensor to DCP (torch 2.14's
``CheckpointableTensor``): the staged copy carries them too, or it would save as a whole tensor."""


def _shard_fields(tensor: torch.Tensor) -> tuple | None:
    if not all(hasattr(tensor, name) for name in SHARD_FIELDS):
        return None
    return tuple(_frozen(getattr(tensor, name)) for name in SHARD_FIELDS)


def _frozen(value: Any) -> Any:
    """Sequences as tuples, so the structure stays hashable (it keys the arena's reuse)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if _is_mapping(value):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_tensor(v) for v in value)
    return False


def _is_terminal_list(value: list) -> bool:
    """DCP's _traverse rule: a list is one leaf unless it holds tensors, mappings or such lists."""
    for entry in value:
        if isinstance(entry, torch.Tensor) or _is_mapping(entry):
            return False
        if isinstance(entry, list) and not _is_terminal_list(entry):
            return False
    return True


def structure_of(state_dict: Mapping, tensors: list[torch.Tensor], objects: list[Any]) -> tuple:
    """A hashable template of the state's structure, in DCP's traversal order (tensors first
    within each mapping); fills ``tensors`` (the leaves to copy) and ``objects`` (the rest)."""

    def node(value: Any, path: str) -> tuple:
        if _is_mapping(value):
            keys = list(value.keys())
            ordered = [k for k in keys if _has_tensor(value[k])] + [
                k for k in keys if not _has_tensor(value[k])]
            return ("map", tuple((k, node(value[k], f"{path}.{k}" if path else str(k)))
                                 for k in ordered))
        if isinstance(value, list) and not _is_terminal_list(value):
            return ("list", tuple(node(v, f"{path}.{i}") for i, v in enumerate(value)))
        if isinstance(value, torch.Tensor):
            local, spec = _local(value)
            if local.is_quantized or local.is_sparse or local.layout != torch.strided:
                raise UnsupportedItemError(f"{path}: {local.layout}/{local.dtype} tensors cannot be staged; "
                                "dequantize or densify them first")
            if local.device.type == "meta":
                raise UnsupportedItemError(f"{path}: a meta tensor has no data to save")
            tensors.append(local)
            leaf = TensorSpec(local.dtype, tuple(local.shape), str(local.device))
            return ("tensor", leaf, spec, value.requires_grad, _shard_fields(value))
        objects.append(value)
        return ("object",)

    return node(state_dict, "")


def tensor_specs(template: tuple) -> list[TensorSpec]:
    out: list[TensorSpec] = []

    def walk(n: tuple) -> None:
        if n[0] == "map":
            for _, child in n[1]:
                walk(child)
        elif n[0] == "list":
            for child in n[1]:
                walk(child)
        elif n[0] == "tensor":
            out.append(n[1])

    walk(template)
    return out


def staged_dtensor(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """A DTensor around ``local`` (an arena view), whose wrapper is at storage offset 0.

    torch gives a DTensor's wrapper its local tensor's storage offset, so an arena view past the
    first makes the wrapper's data pointer non-null although it owns no memory; torch's pickling
    then takes it for a tensor with storage, and ``torch.multiprocessing`` (DCP's PROCESS
    executor) segfaults sharing that empty storage (``_share_fd_cpu_``). The wrapper is built
    around an empty view at offset 0 instead and then given the real local tensor: it pickles as
    a wrapper again (``_rebuild_wrapper_subclass``), its local tensor by file descriptor."""
    DTensor = _dtensor_type()
    if local.storage_offset() == 0:
        return DTensor(local, spec, requires_grad=False)
    wrapper = DTensor(local.as_strided((0,), (1,), 0), spec, requires_grad=False)
    wrapper._local_tensor = local
    return wrapper


def materialize(template: tuple, views: list[torch.Tensor], objects: list[Any]) -> Any:
    """Build the staged state dict: arena views for tensors, copies of everything else."""
    tensor_iter, object_iter = iter(views), iter(objects)

    def build(n: tuple) -> Any:
        kind = n[0]
        if kind == "map":
            return {k: build(child) for k, child in n[1]}
        if kind == "list":
            return [build(child) for child in n[1]]
        if kind == "tensor":
            view = next(tensor_iter)
            if n[2] is not None:
                return staged_dtensor(view, n[2])
            if n[4] is not None:
                for name, value in zip(SHARD_FIELDS, n[4]):
                    setattr(view, name, value)
            return view
        value = next(object_iter)
        if value is None or isinstance(value, (int, float, str, bytes, bool)):
            return value  # immutable: nothing the caller does later can change it
        return copy.deepcopy(value)

    return build(template)


class Lease:
    """Tracks one staged save: busy until DCP's upload let go of the Future it was given."""

    def __init__(self, future: Future) -> None:
        self._future = weakref.ref(future)
        self.claimers: list[threading.Thread] = []
        self.ended = False
        """Set by a save thread that outlives its saves (NVMeAsyncSaver's worker) once the save ended."""

    def busy(self) -> bool:
        if self.ended or self._future() is None:
            return False
        return not (self.claimers and not any(t.is_alive() for t in self.claimers))


class Arena:
    """One staging buffer, the structure it is laid out for, and the views into it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.template: tuple | None = None
        self.views: list[torch.Tensor] = []
        self.pinned = False
        self.registered = False
        self.lease: Lease | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def busy(self) -> bool:
        return self.lease is not None and self.lease.busy()

    def release_memory(self) -> None:
        if self.registered and self.buffer is not None:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer, self.template, self.views = None, None, []
        self.pinned = self.registered = False


def allocate_arena(nbytes: int, pin: bool, shared: bool) -> tuple[torch.Tensor, bool, bool]:
    """A page-aligned, first-touched buffer; returns (buffer, pinned, registered with CUDA)."""
    if not shared:
        buffer = aligned_buffer(nbytes, pin=pin)
        return buffer, bool(pin and buffer.is_pinned()), False
    # shared memory (fd-backed mmap, page aligned): DCP's PROCESS executor then hands the
    # arena to its checkpoint process by file descriptor instead of copying it
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    buffer.zero_()
    if buffer.data_ptr() % ALIGN:
        raise RuntimeError("shared memory arena is not page aligned")
    registered = False
    if pin:
        rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
        registered = int(rc) == 0
        if not registered:
            log.warning("cudaHostRegister of the %d-byte shared arena failed (%s); unpinned",
                        buffer.numel(), rc)
    return buffer, registered, registered


def arena_views(buffer: torch.Tensor, specs: list[TensorSpec], offsets: list[int]) -> list[torch.Tensor]:
    views = []
    for spec, offset in zip(specs, offsets):
        raw = buffer[offset : offset + spec.nbytes]
        views.append(raw.view(spec.dtype).reshape(spec.shape))
    return views


PARALLEL_COPY_BYTES = 256 << 10
"""Above this a host copy goes through torch's copy_, which splits it over the intra-op threads
and so beats one memmove; below it one memmove is cheaper than torch's dispatch. On the idle
training thread the whole machine is ours (figures: docs/benchmarks.md)."""


def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one host tensor into its arena slot, as fast as the machine allows (the training
    thread waits for it: ``NVMeStager(background_copy=False)``)."""
    nbytes = src.numel() * src.element_size()
    if nbytes < PARALLEL_COPY_BYTES and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src)


COPY_CHUNK_BYTES = 4 << 20
"""The background copy's unit: one memmove (GIL released) per chunk, so the staging thread holds
one core at a time and gives the interpreter back between chunks; 4 MiB stays in L2/L3-sized
bursts without paying per-call overhead (a few microseconds per chunk)."""


_SERIAL_ELEMENTS = 1 << 15
"""torch's intra-op grain (at::internal::GRAIN_SIZE): a copy_ of fewer elements stays serial."""


def copy_host_chunked(dst: torch.Tensor, src: torch.Tensor, chunk: int = COPY_CHUNK_BYTES) -> None:
    """Copy one host tensor into its arena slot on the staging thread: one thread, in chunks.

    Not torch's ``copy_`` for contiguous tensors: from a second thread it would open its own
    intra-op team over every core and fight the training step's. Strided views are copied in
    row blocks below torch's parallel grain (each ``copy_`` then runs on this thread alone)."""
    nbytes = src.numel() * src.element_size()
    if not nbytes:
        return
    if src.is_contiguous() and not (src.is_conj() or src.is_neg()):
        base_dst, base_src = dst.data_ptr(), src.data_ptr()
        for offset in range(0, nbytes, chunk):
            ctypes.memmove(base_dst + offset, base_src + offset, min(chunk, nbytes - offset))
        return
    if src.dim() == 0 or src.shape[0] < 2:
        dst.copy_(src)
        return
    rows = max(1, _SERIAL_ELEMENTS // max(1, src.numel() // src.shape[0]))
    for start in range(0, src.shape[0], rows):
        dst[start : start + rows].copy_(src[start : start + rows])
