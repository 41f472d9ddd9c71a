"""The start of a save's write: one DCP WriteItem as container bytes -- its name in the
container (``check_item_name``, ``unique_keys``), its bytes as flat uint8 (no copy when
contiguous; a non-contiguous view copies only the view's bytes), its index row
(``resolve_item``), and the pad sources that fill the gaps ``format.container`` left between
items (``with_pads``). What the ranks wrote, as records, is ``save.results``."""

from __future__ import annotations

import collections
import io
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_nvme.engines.host_io import aligned_buffer, tensor_bytes
from dcp_nvme.errors import UnsupportedItemError
from dcp_nvme.format.container import (
    ITEMSIZE_GAP,
    PAD_PREFIX,
    ContainerLayout,
    ItemSpec,
    dtype_name,
    needs_pickle,
    offsets_key,
    stored_as,
)
from dcp_nvme.format.tables import ChunkRecord

RESERVED_NAMES = ("__metadata__",)
"""Container keys safetensors keeps for itself; pad entries (``PAD_PREFIX``) are ours."""


def check_item_name(fqn: str) -> None:
    """Refuse a state-dict name the container cannot hold, so no save of it ever commits: an
    empty name (the reader refuses an index row without one as forged), safetensors'
    ``__metadata__`` and the prefix of the container's padding entries."""
    if not fqn:
        problem = "an empty name cannot be stored (a dcp_nvme checkpoint refuses it on load)"
    elif fqn in RESERVED_NAMES or fqn.startswith(PAD_PREFIX):
        problem = f"the name is reserved by the safetensors container ({RESERVED_NAMES[0]!r}, {PAD_PREFIX!r}...)"
    else:
        return
    raise UnsupportedItemError(f"state-dict item {fqn!r}: {problem}; rename the key in the state dict "
                               "(e.g. nest it under a module name) and save again")


def unique_keys(resolved: list[tuple[ItemSpec, torch.Tensor, ChunkRecord]]) -> list[tuple[ItemSpec, torch.Tensor, ChunkRecord]]:
    """Each item's name in its container is its fqn (format 4: what torch's reader takes for the
    tensor's name); the chunks of an fqn that a rank holds more than one of (a ShardedTensor's
    several local shards) are told apart by their offsets (``offsets_key``), stored in the index."""
    seen = collections.Counter(record.fqn for _, _, record in resolved)
    if len(seen) == len(resolved):
        return resolved
    out = []
    for spec, source, record in resolved:
        if seen[record.fqn] > 1 and record.kind == "tensor":
            key = offsets_key(record.fqn, record.offsets)
            spec, record = replace(spec, key=key), replace(record, key=key)
        out.append((spec, source, record))
    return out


_pickle_checked: set[str] = set()


def _say_if_it_needs_pickle(fqn: str, raw: bytes) -> None:
    """A value only full pickle can load (an ``argparse.Namespace``, numpy's RNG state) saves
    fine and is refused at the restart unless the reader opts in: say so now, naming it. Each
    name is looked at once per process: a later save of the same item costs nothing."""
    if fqn in _pickle_checked:
        return
    _pickle_checked.add(fqn)
    names = needs_pickle(raw)
    if names:
        warnings.warn(f"dcp_nvme: non-tensor item {fqn!r} imports {', '.join(names[:5])} when loaded: "
                      "NVMeReader refuses it unless NVMeReader(path, allow_pickle=True), which runs its "
                      "code; store plain values (or torch.serialization.add_safe_globals its classes "
                      "before loading) for a restart that needs no opt-in", stacklevel=2)


def resolve_item(item: WriteItem, data: Any) -> tuple[ItemSpec, torch.Tensor, ChunkRecord]:
    """An item's bytes (flat uint8, no copy when contiguous) and how it is described; an item
    whose name the container cannot hold is refused (``check_item_name``) before any is written."""
    check_item_name(item.index.fqn)
    key = item.index.fqn  # unique in the container once ``unique_keys`` has looked at the rank's items
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        _say_if_it_needs_pickle(item.index.fqn, raw)
        source = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        spec = ItemSpec(key, len(raw), "U8", (len(raw),))
        record = ChunkRecord(item.index.fqn, "bytes", (), (), (), "uint8", "", 0, len(raw), key)
        return spec, source, record
    if not isinstance(data, torch.Tensor):
        raise UnsupportedItemError(f"{item.index.fqn}: the planner resolved a {type(data).__name__}, not a tensor")
    tensor = data.detach()
    if tensor.is_quantized or tensor.is_sparse or tensor.layout != torch.strided:
        raise UnsupportedItemError(f"{item.index.fqn}: {tensor.layout}/{tensor.dtype} tensors are not supported; "
                        "dequantize or densify them before saving")
    if not tensor.is_contiguous():
        tensor = _contiguous_copy(tensor)  # only the view's bytes, never the whole storage
    source = tensor_bytes(tensor)
    assert item.tensor_data is not None  # DCP's WriteItem carries it on every TENSOR item
    chunk = item.tensor_data.chunk
    st_dtype, shape = stored_as(tensor.dtype, tensor.shape, source.numel())
    # raw bytes (a dtype safetensors lacks) have no element offsets to give torch's reader
    offsets = tuple(chunk.offsets) if tuple(shape) == tuple(tensor.shape) else None
    spec = ItemSpec(key, source.numel(), st_dtype, shape, offsets)
    record = ChunkRecord(
        item.index.fqn, "tensor", tuple(chunk.offsets), tuple(chunk.sizes),
        tuple(item.tensor_data.size), dtype_name(tensor.dtype), "", 0, source.numel(), key,
    )
    return spec, source, record


def with_pads(sources: Sequence[torch.Tensor], layout: ContainerLayout) -> list[torch.Tensor]:
    """The data region's sources in order: the items' and, before the first item after each of
    the layout's pads, the pad's bytes."""
    gap_before = {offset + size: size for offset, size in layout.pads}  # keyed by where it ends
    out: list[torch.Tensor] = []
    previous = None
    for source, offset in zip(sources, layout.offsets):
        size = gap_before.pop(offset, 0)  # an empty item at that offset takes the pad first
        if size:
            out.append(_pad_source(previous, source, size))
        out.append(source)
        previous = source if source.numel() else previous
    return out


def _pad_source(previous: torch.Tensor | None, following: torch.Tensor, size: int) -> torch.Tensor:
    """A pad's bytes: the memory between its two neighbours when that is zeros of their one
    storage (a staging arena's dtype padding: the window stays one span of the arena, written
    without a copy), else fresh zeros."""
    if previous is not None and previous.device.type == "cpu" and following.device.type == "cpu":
        storage = previous.untyped_storage()
        start = previous.storage_offset() + previous.numel()  # flat uint8: elements are bytes
        if (size < ITEMSIZE_GAP and storage.data_ptr() == following.untyped_storage().data_ptr()
                and previous.data_ptr() + previous.numel() + size == following.data_ptr()
                and start + size <= storage.nbytes()):
            # torch's stubs want a stride with an offset; set_ defaults it to contiguous
            gap = torch.empty(0, dtype=torch.uint8).set_(storage, start, (size,))  # type: ignore[call-overload]
            if not gap.any():
                return gap
    return torch.zeros(size, dtype=torch.uint8)


def _contiguous_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy on a page boundary: the container places items by their address
    (zero-copy), so a fresh copy at a random address would change the layout from save to save
    (and with it every delta-coded drain of the file)."""
    if tensor.device.type != "cpu":
        return tensor.contiguous()
    try:
        out = aligned_buffer(tensor.numel() * tensor.element_size(), pin=False).view(tensor.dtype)
        return out.view(tensor.shape).copy_(tensor)
    except (RuntimeError, TypeError):  # a dtype a uint8 buffer cannot be viewed as
        return tensor.contiguous()
