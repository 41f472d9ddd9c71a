"""Non-tensor items of a checkpoint (DCP's bytes items): decoded without running their code.

DCP stores each non-tensor value (an int, a dict of floats, an RNG state) as a ``torch.save``
pickle, and DCP's default planner loads it back with ``torch.load(weights_only=False)``: a
checkpoint from a stranger could run any code on load. NVMeReader therefore decodes each item
itself with torch's weights-only unpickler, which builds only allow-listed types (plain Python
values, containers, tensors, dtypes, and whatever the user added with
``torch.serialization.add_safe_globals``) and refuses everything else before calling anything.
The decoded value is then saved again by us, so the bytes any planner unpickles were written
from safe objects in this process, not by the checkpoint's author. Full pickle is an explicit
opt-in: ``NVMeReader(path, allow_pickle=True)``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ItemKindError, UnsafeItemError

OPT_IN = "NVMeReader(path, allow_pickle=True)"


def unsafe_globals(data: bytes) -> list[str]:
    """Names the item's pickle would import beyond the weights-only allow-list (nothing is run)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:  # noqa: BLE001 - not even a readable torch.save file: no names to give
        return []


def _reason(data: bytes, exc: BaseException) -> str:
    names = unsafe_globals(data)
    if names:
        return "it imports " + ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), None)
    return detail or (lines[0] if lines else type(exc).__name__)


def decode_item(data: bytes, key: str, where: str) -> Any:
    """The value of one non-tensor item, built by the weights-only unpickler; never runs its code.

    Raises UnsafeItemError naming the item and what it would import.
    """
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
        raise UnsafeItemError(
            f"{where}: non-tensor item {key!r} cannot be loaded safely ({_reason(data, exc)}); "
            f"loading it would run code from the checkpoint. If you trust whoever wrote it, load "
            f"with {OPT_IN}, or allow its classes with torch.serialization.add_safe_globals"
        ) from None


def bytes_for_planner(data: bytes, key: str, where: str, *, allow_pickle: bool) -> io.BytesIO:
    """What NVMeReader hands to ``planner.load_bytes``: the stored bytes only with the opt-in,
    else the weights-only decoded value saved again here."""
    if allow_pickle:
        return io.BytesIO(data)
    value = decode_item(data, key, where)
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def check_destination_kind(planner: Any, fqn: str, where: str) -> None:
    """Refuse a stored object where the caller's state_dict holds a tensor under ``fqn``.

    DCP's planners keep the (flattened) destination state_dict as ``planner.state_dict``; a
    planner without one is not checked here (its items are still decoded safely).
    """
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping) or fqn not in state:
        return
    if isinstance(state[fqn], torch.Tensor):
        raise ItemKindError(
            f"{where}: {fqn!r} is a tensor in the state_dict being loaded but a non-tensor object "
            "in the checkpoint; refusing to replace the tensor (was the checkpoint written for "
            "another model, or tampered with?)"
        )


def items_needing_pickle(store: Any, chunks: Any) -> list[tuple[str, str, str]]:
    """``(fqn, file, reason)`` of each stored non-tensor item that the weights-only unpickler
    refuses, i.e. that loads only with the opt-in. Reads one item at a time, never more bytes
    than its file holds; runs nothing from the checkpoint."""
    found = []
    for chunk in chunks:
        if chunk.kind != "bytes":
            continue
        try:
            size = store.size(chunk.file)
        except OSError as exc:
            found.append((chunk.fqn, chunk.file, f"unreadable: {exc}"))
            continue
        if chunk.byte_offset < 0 or chunk.length < 0 or chunk.byte_offset + chunk.length > size:
            found.append((chunk.fqn, chunk.file, "its recorded byte range lies outside the file"))
            continue
        buffer = bytearray(chunk.length)
        got = store.read_into(chunk.file, chunk.byte_offset, memoryview(buffer))
        data = bytes(buffer[:got])
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - whatever the unpickler refuses is reported
            found.append((chunk.fqn, chunk.file, _reason(data, exc)))
    return found
