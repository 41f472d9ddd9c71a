"""crc32c computed where a tensor lives (the GPU, or the CPU for tests), bit-identical to the host
crc32c of ``format.checksums``: the drain and the kvikio engine check device memory without
copying it to the host first."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import crc32c
import numpy as np
import torch

from dcp_nvme.format.checksums import Check, raise_on_mismatch

# --------------------------------------------------------------------------- device crc32c
#
# CRC32C is affine over GF(2). With R(M) the CRC register after feeding M from state 0 (no
# final xor), crc32c(M) = R(M) ^ crc32c(zeros(len(M))), and R(M) is the XOR over bytes of a
# value that depends only on the byte and on how many bytes follow it. So: split a block into
# chunks of _CHUNK bytes, look every byte up in P[distance-in-chunk][byte] and XOR-reduce each
# chunk; then shift each chunk value by the chunks that follow it (Q[chunks-after][byte k of
# value][byte]) and XOR-reduce again. Leading zero bytes do not change R, so short blocks are
# zero-padded in front. All of it is gathers and XORs: the same torch code runs on CPU (tested
# against the crc32c library) and on the GPU. Nothing here touches CUDA until called on it.

_POLY = 0x82F63B78
_CHUNK = 256


@functools.lru_cache(maxsize=1)
def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ _POLY, table >> 1)
    return table.astype(np.uint64)


def _shift_zero_bytes(values: np.ndarray, count: int) -> np.ndarray:
    """The register after feeding ``count`` zero bytes from each of ``values``."""
    table = _byte_table()
    for _ in range(count):
        values = (values >> 8) ^ table[values & 0xFF]
    return values


def _as_int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.uint32).view(np.int32).copy())


@functools.lru_cache(maxsize=1)
def _chunk_table() -> np.ndarray:
    """P[d][b]: contribution of byte b followed by d bytes of its chunk, shape (_CHUNK, 256)."""
    rows = [_byte_table()]
    for _ in range(_CHUNK - 1):
        rows.append(_shift_zero_bytes(rows[-1], 1))
    return np.stack(rows)


@functools.lru_cache(maxsize=8)
def _shift_table(chunks: int) -> np.ndarray:
    """Q[e][k][x]: (x << 8k) shifted by e chunks of zeros, for e < ``chunks``; (chunks, 4, 256)."""
    x = np.arange(256, dtype=np.uint64)
    q = np.empty((1, 4, 256), dtype=np.uint64)
    for k in range(4):
        q[0, k] = x << (8 * k)
    one = _shift_zero_bytes(q[0].reshape(-1), _CHUNK).reshape(1, 4, 256)
    q = np.concatenate([q, one])
    while len(q) < chunks:  # doubling: Q[m + e] = shift_m(Q[e]), with shift_m's table Q[m]
        m = len(q)
        step = q[m - 1].reshape(-1)
        shift_m = np.zeros_like(step)  # Q[m] = one more chunk of zeros after Q[m-1]
        for k in range(4):
            shift_m ^= q[1, k][(step >> (8 * k)) & 0xFF]
        table_m = shift_m.reshape(4, 256)
        flat = q.reshape(-1)
        shifted = np.zeros_like(flat)
        for k in range(4):
            shifted ^= table_m[k][(flat >> (8 * k)) & 0xFF]
        q = np.concatenate([q, shifted.reshape(q.shape)])
    return q[:chunks]


class _Tables:
    """The lookup tables as int32 tensors on one device (16 MiB for 1 MiB blocks)."""

    _lock = threading.Lock()
    _cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def get(cls, device: torch.device, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chunks = 1 << max(0, chunks - 1).bit_length()  # grow in powers of two
        key = (str(device), chunks)
        with cls._lock:
            if key not in cls._cache:
                p = _as_int32(_chunk_table()).reshape(-1).to(device)
                q = _as_int32(_shift_table(chunks)).reshape(-1).to(device)
                offsets = torch.arange(_CHUNK - 1, -1, -1, dtype=torch.int32, device=device) * 256
                cls._cache[key] = (p, q, offsets)
            return cls._cache[key]


@functools.lru_cache(maxsize=64)
def _zeros_crc(length: int) -> int:
    return crc32c.crc32c(bytes(length))


def _xor_reduce(values: torch.Tensor) -> torch.Tensor:
    """XOR over the last dimension."""
    width = values.shape[-1]
    if width & (width - 1):  # pad to a power of two with zeros, the XOR identity
        pad = (1 << width.bit_length()) - width
        values = torch.cat([values, values.new_zeros(*values.shape[:-1], pad)], dim=-1)
    while values.shape[-1] > 1:
        half = values.shape[-1] // 2
        values = values[..., :half] ^ values[..., half:]
    return values[..., 0]


def _register(blocks: torch.Tensor) -> torch.Tensor:
    """R(block) for each row of ``blocks`` (uint8, shape (n, L), L a multiple of _CHUNK)."""
    rows, length = blocks.shape
    chunks = length // _CHUNK
    p, q, offsets = _Tables.get(blocks.device, chunks)
    index = blocks.reshape(rows, chunks, _CHUNK).to(torch.int32) + offsets
    per_chunk = _xor_reduce(p[index])  # (rows, chunks)
    distance = torch.arange(chunks - 1, -1, -1, dtype=torch.int32, device=blocks.device) * 1024
    parts = [q[distance + k * 256 + ((per_chunk >> (8 * k)) & 0xFF)] for k in range(4)]
    return _xor_reduce(torch.stack(parts, dim=-1).reshape(rows, chunks * 4))


def _padded(data: torch.Tensor) -> torch.Tensor:
    """``data`` with leading zeros up to a multiple of _CHUNK, as one row."""
    pad = -data.numel() % _CHUNK
    if pad or data.numel() == 0:
        data = torch.cat([data.new_zeros(pad or _CHUNK), data])
    return data.reshape(1, -1)


def device_crc32c_async(data: torch.Tensor, block: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Start the crc32c of each ``block`` bytes of flat uint8 ``data`` (the last may be shorter)
    without waiting: returns the registers of the full blocks and of the tail, on data's device.
    ``finish_crc32c`` turns them into the crc values."""
    if data.dim() != 1 or data.dtype != torch.uint8:
        raise ValueError("device_crc32c needs a flat uint8 tensor")
    if block <= 0 or block % _CHUNK:
        raise ValueError(f"checksum block {block} is not a positive multiple of {_CHUNK}")
    full = data.numel() // block
    head = _register(data[: full * block].reshape(full, block)) if full else None
    tail = _register(_padded(data[full * block :])) if data.numel() % block else None
    return head, tail


def finish_crc32c(started: tuple[torch.Tensor | None, torch.Tensor | None], length: int,
                  block: int) -> list[int]:
    """The crc values of ``device_crc32c_async``'s result (waits for the device)."""
    head, tail = started
    crcs: list[int] = []
    if head is not None:
        zero = _zeros_crc(block)
        crcs += [(value & 0xFFFFFFFF) ^ zero for value in head.tolist()]
    if tail is not None:
        crcs.append((int(tail.item()) & 0xFFFFFFFF) ^ _zeros_crc(length % block))  # an integer tensor
    return crcs


def device_crc32c(data: torch.Tensor, block: int) -> list[int]:
    """crc32c of each ``block`` bytes of ``data``, computed where ``data`` lives."""
    return finish_crc32c(device_crc32c_async(data, block), data.numel(), block)


def device_crcs(data: torch.Tensor, checks: Sequence[Check]) -> list[int]:
    """The crc32c of each check's range of ``data``, computed where ``data`` lives: in one pass
    when the checks are back-to-back blocks of one size, else one range at a time."""
    if not checks:
        return []
    block = checks[0][1]
    regular = all(rel == checks[0][0] + i * block and (n == block or i == len(checks) - 1)
                  for i, (rel, n, _) in enumerate(checks))
    if regular and block % _CHUNK == 0:
        start, end = checks[0][0], checks[-1][0] + checks[-1][1]
        return device_crc32c(data[start:end], block)
    return [device_crc32c(data[rel : rel + n], _CHUNK * (-(-n // _CHUNK)))[0] for rel, n, _ in checks]


def check_device(path: str, base: int, checks: Sequence[Check], data: torch.Tensor) -> None:
    """Check bytes in a flat uint8 tensor, computing the crcs where ``data`` lives."""
    if checks:
        raise_on_mismatch(path, base, checks, device_crcs(data, checks))
