"""Non-tensor items of a checkpoint (DCP's bytes items): decoded without running their code.

DCP stores each non-tensor value (an int, a dict of floats, an RNG state) as a ``torch.save``
pickle, and DCP's default planner loads it back with ``torch.load(weights_only=False)``: a
checkpoint from a stranger could run any code on load. NVMeReader therefore decodes each item
itself with torch's weights-only unpickler, which builds only allow-listed types (plain Python
values, containers, tensors, dtypes, and whatever the user added with
``torch.serialization.add_safe_globals``) and refuses everything else before calling anything.
An ``io.BytesIO`` (DCP saves one as the pickle of the object, e.g. from a Stateful) is only
its bytes, and so is ``b""`` (pickled as a call of ``bytes``, which that list lacks): a pickle
that names nothing else beyond the list is decoded by an unpickler that builds plain values,
bytes and BytesIO and nothing else (``_BytesUnpickler``).
The decoded value is then saved again by us, so the bytes any planner unpickles were written
from safe objects in this process, not by the checkpoint's author. Full pickle is an explicit
opt-in: ``NVMeReader(path, allow_pickle=True)``.
"""

from __future__ import annotations

import codecs
import io
import pickle
import zipfile
from collections.abc import Mapping
from typing import Any

from dcp_nvme.errors import DCPNVMeError, ItemKindError, UnsafeItemError
from dcp_nvme.format.container import BYTES_GLOBALS, unsafe_globals

OPT_IN = "NVMeReader(path, allow_pickle=True)"


def _reason(data: bytes, exc: BaseException) -> str:
    names = unsafe_globals(data)
    if names:
        return "it imports " + ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), None)
    return detail or (lines[0] if lines else type(exc).__name__)


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``, as a pickle of ``b""`` calls it; with arguments (``bytes(10**12)``) refused."""
    if args:
        raise pickle.UnpicklingError("bytes(...) is only built empty here")
    return b""


def _latin1(text: str, encoding: str) -> bytes:
    """How a protocol-2 pickle spells non-empty bytes: ``_codecs.encode(text, "latin1")``."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} is not how bytes are pickled")
    return codecs.encode(text, encoding)


class _BytesUnpickler(pickle.Unpickler):
    """Plain values, bytes and ``io.BytesIO`` only (the "restricting globals" of Python's pickle
    docs): every class or callable a pickle names comes through ``find_class``, which knows
    these three, and tensor storages (persistent ids) are refused. ``BytesIO.__setstate__``
    takes only bytes, a position and a dict of the plain values this builds."""

    _ALLOWED = {("_io", "BytesIO"): io.BytesIO, ("_codecs", "encode"): _latin1,
                ("builtins", "bytes"): _empty_bytes,
                ("__builtin__", "bytes"): _empty_bytes}  # protocol 2 spells it so; no fix_imports here

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not a plain value, bytes or io.BytesIO") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a tensor next to bytes or an io.BytesIO is not decoded here")


def _load_bytes(data: bytes) -> Any:
    """The value of a ``torch.save`` archive of plain values, bytes and BytesIO objects."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        entry = next((i for i in archive.infolist() if i.filename.endswith("/data.pkl")), None)
        if entry is None or entry.file_size > len(data):  # torch stores it uncompressed: no bomb
            raise pickle.UnpicklingError("not a torch.save archive")
        return _BytesUnpickler(io.BytesIO(archive.read(entry))).load()


def safe_load(data: bytes) -> Any:
    """An item's value built without running its code: by torch's weights-only unpickler, or,
    when all it refuses is bytes or BytesIO, by ``_BytesUnpickler``. Raises what the
    weights-only unpickler raised when neither builds it."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as refused:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
        names = set(unsafe_globals(data))
        if not names or not names <= BYTES_GLOBALS:
            raise
        try:
            return _load_bytes(data)
        except Exception:  # noqa: BLE001 - any failure here is the weights-only refusal
            raise refused from None


def decode_item(data: bytes, key: str, where: str) -> Any:
    """The value of one non-tensor item, built without running its code (``safe_load``).

    Raises UnsafeItemError naming the item and what it would import.
    """
    try:
        return safe_load(data)
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
    import torch

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
    import torch

    if isinstance(state[fqn], torch.Tensor):
        raise ItemKindError(
            f"{where}: {fqn!r} is a tensor in the state_dict being loaded but a non-tensor object "
            "in the checkpoint; refusing to replace the tensor (was the checkpoint written for "
            "another model, or tampered with?)"
        )


_PLAIN_RECORDS = {"data.pkl", "version", ".format_version", ".storage_alignment", "byteorder",
                  ".data/serialization_id"}
"""The records of a ``torch.save`` archive that holds no tensor (torch 2.x)."""


def _plain(data: bytes) -> bool:
    """Whether the item is a ``torch.save`` archive of exactly the shape torch writes for a value
    without tensors, which ``_BytesUnpickler`` builds (an int, a dict of floats, bytes): then
    ``safe_load`` builds it too, and torch need not be imported to say so. Anything unusual is
    left to ``safe_load`` (False)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            prefix = entries[0].filename.split("/", 1)[0] + "/" if entries else ""
            names = {e.filename.removeprefix(prefix) for e in entries if e.filename.startswith(prefix)}
            if (len(names) != len(entries) or not {"data.pkl", "version"} <= names <= _PLAIN_RECORDS
                    or any(e.compress_type != zipfile.ZIP_STORED for e in entries)
                    or archive.read(prefix + "version").strip() not in (b"1", b"2", b"3")
                    or ("byteorder" in names and archive.read(prefix + "byteorder") != b"little")):
                return False
        _load_bytes(data)
    except Exception:  # noqa: BLE001 - anything else is for the weights-only unpickler to judge
        return False
    return True


def items_needing_pickle(store: Any, chunks: Any) -> list[tuple[str, str, str]]:
    """``(fqn, file, reason)`` of each stored non-tensor item that the weights-only unpickler
    refuses, i.e. that loads only with the opt-in. Reads one item at a time, never more bytes
    than its file holds; runs nothing from the checkpoint. An item that cannot be read whole (its
    file missing, short or damaged) is not judged: that is the file's problem, which ``verify``
    reports as such, not a reason to trust pickle."""
    found = []
    for chunk in chunks:
        if chunk.kind != "bytes":
            continue
        try:
            size = store.size(chunk.file)
        except (OSError, DCPNVMeError):  # missing, or a compressed file whose table is damaged
            continue
        if chunk.byte_offset < 0 or chunk.length < 0 or chunk.byte_offset + chunk.length > size:
            continue
        buffer = bytearray(chunk.length)
        try:
            got = store.read_into(chunk.file, chunk.byte_offset, memoryview(buffer))
        except (OSError, DCPNVMeError):  # a damaged chunk of a compressed mirror
            continue
        if got != chunk.length:
            continue
        data = bytes(buffer[:got])
        if _plain(data):
            continue
        try:
            safe_load(data)
        except Exception as exc:  # noqa: BLE001 - whatever the unpickler refuses is reported
            found.append((chunk.fqn, chunk.file, _reason(data, exc)))
    return found
