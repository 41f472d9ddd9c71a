"""Pure safetensors header logic: build one up front from sizes, parse one back. No I/O."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
}
"""torch dtypes the safetensors format (0.8) stores; anything else needs a cast."""

ST_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for dtype, name in ST_DTYPES.items()}

HEADER_ALIGN = 8


@dataclass(frozen=True)
class Entry:
    name: str
    st_dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_ITEMSIZE[self.st_dtype]


def build_header(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header for tensors stored back to back in ``entries`` order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    cursor = 0
    for entry in entries:
        if entry.name in header:
            raise ValueError(f"duplicate tensor name {entry.name!r}")
        header[entry.name] = {"dtype": entry.st_dtype, "shape": list(entry.shape),
                              "data_offsets": [cursor, cursor + entry.nbytes]}
        cursor += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)  # safetensors pads so the data is 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def parse_header(prefix: bytes, what: str) -> tuple[dict, int]:
    """The JSON header of a safetensors file from its first bytes, and where its data starts."""
    if len(prefix) < 8:
        raise ValueError(f"{what}: {len(prefix)} bytes is too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix[:8])
    if 8 + length > len(prefix):
        raise ValueError(f"{what}: the header claims {length} bytes, beyond the {len(prefix)} available")
    try:
        header = json.loads(prefix[8 : 8 + length])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what}: the safetensors header is not a JSON object")
    return header, 8 + length
