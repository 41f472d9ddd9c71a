"""The byte-grouped codec: bitwise round trips for every dtype DCP saves, ranged decodes,
damage detected, delta chunks needing their base."""

from __future__ import annotations

import pytest
import torch

from dcp_nvme.tiers import codec

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
                       getattr(torch, "uint16", None)) if d is not None]


def _tensor(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex or dtype.is_floating_point:
        base = torch.randn(n, generator=g, dtype=torch.float64) * 0.02
        return (base.to(torch.complex128) if dtype.is_complex else base).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 3, 1000, 70001])
def test_round_trip_every_dtype(dtype, n):
    data = _bytes(_tensor(dtype, n))
    name = str(dtype).removeprefix("torch.")
    container = codec.encode(data, [(0, len(data), name)], chunk_size=4096, threads=2)
    assert codec.decode(container) == data


def test_planes_per_dtype_and_mixed_regions():
    assert codec.planes_for("bfloat16") == 2 and codec.planes_for("float16") == 2
    assert codec.planes_for("float32") == 4 and codec.planes_for("int64") == 1
    header = b"{\"x\": 1}" + b" " * 21  # an odd-sized gap before the first tensor
    w = _bytes(_tensor(torch.bfloat16, 5001))
    m = _bytes(_tensor(torch.float32, 3333, 1))
    data = header + w + b"\0" * 7 + m + b"tail"
    regions = [(len(header), len(w), "bfloat16"), (len(header) + len(w) + 7, len(m), "float32")]
    chunks = codec.plan_chunks(len(data), regions, 4096)
    assert {c.planes for c in chunks} == {1, 2, 4}
    assert sum(c.length for c in chunks) == len(data)
    assert codec.decode(codec.encode(data, regions, chunk_size=4096)) == data


def test_bytegroup_beats_plain_zstd_on_bf16_weights():
    w = torch.randn(1 << 20) * 0.02
    data = _bytes(w.to(torch.bfloat16))
    grouped = codec.encode(data, [(0, len(data), "bfloat16")])
    plain = codec.encode(data, [(0, len(data), None)])
    assert len(grouped) < len(plain) < len(data)


def test_random_planes_stored_raw():
    data = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8).numpy().tobytes()
    container = codec.encode(data, [(0, len(data), "float32")])
    assert len(container) - len(data) < 1024  # header, table and plane heads only
    assert codec.decode(container) == data


@pytest.mark.parametrize("start,end", [(0, 1), (4095, 4097), (10000, 30001), (0, None), (50000, 50000)])
def test_ranged_decode_reads_only_its_chunks(start, end):
    data = _bytes(_tensor(torch.float32, 20000))
    container = codec.encode(data, [(0, len(data), "float32")], chunk_size=4096)
    stop = len(data) if end is None else end
    assert codec.decode(container, start, end) == data[start:stop]
    flags, count, size, crc = codec.parse_header(container)
    table = container[codec.HEADER_SIZE: codec.HEADER_SIZE + count * codec.ENTRY_SIZE]
    entries = codec.parse_table(table, count, size, crc, len(container))
    needed = codec.overlapping(entries, start, stop)
    assert all(e.offset < stop and e.end > start for e in needed)
    assert len(needed) == (0 if start == stop else (stop - 1) // 4096 - start // 4096 + 1)


def test_corrupted_chunk_is_detected():
    data = _bytes(_tensor(torch.bfloat16, 30000))
    container = bytearray(codec.encode(data, [(0, len(data), "bfloat16")], chunk_size=8192))
    _, count, _, _ = codec.parse_header(container)
    entries = codec.parse_table(container[codec.HEADER_SIZE: codec.HEADER_SIZE + count * codec.ENTRY_SIZE],
                                *codec.parse_header(container)[1:], len(container))
    victim = entries[2]
    container[victim.stored_offset + victim.stored_length - 3] ^= 0x40
    assert codec.decode(bytes(container), 0, entries[1].end) == data[: entries[1].end]  # untouched chunks
    with pytest.raises(codec.CodecError, match=f"bytes {victim.offset}-{victim.end}"):
        codec.decode(bytes(container))


def test_damaged_table_and_foreign_file_refused():
    data = _bytes(_tensor(torch.float32, 5000))
    container = bytearray(codec.encode(data, [(0, len(data), "float32")], chunk_size=4096))
    with pytest.raises(codec.CodecError, match="not a dcp_nvme compressed container"):
        codec.decode(b"PK\3\4" + bytes(40))
    container[codec.HEADER_SIZE + 3] ^= 1
    with pytest.raises(codec.CodecError, match="chunk table is damaged"):
        codec.decode(bytes(container))
    with pytest.raises(codec.CodecError, match="shorter than"):
        codec.decode(bytes(container[:10]))


def test_delta_round_trip_needs_its_base():
    old = _tensor(torch.bfloat16, 40000)
    new = old + (torch.randn(40000) * 1e-4).to(torch.bfloat16)
    base, data = _bytes(old), _bytes(new)
    regions = [(0, len(data), "bfloat16")]
    delta = codec.encode(data, regions, base=base)
    assert codec.decode(delta, base=base) == data
    assert codec.decode(delta, 1000, 3001, base=base) == data[1000:3001]
    assert len(delta) < len(codec.encode(data, regions))
    with pytest.raises(codec.CodecError, match="delta; its base bytes are needed"):
        codec.decode(delta)
    wrong = _bytes(_tensor(torch.bfloat16, 40000, seed=9))
    with pytest.raises(codec.CodecError, match="crc32c"):
        codec.decode(delta, base=wrong)


def test_empty_input():
    container = codec.encode(b"")
    assert codec.decode(container) == b""
    assert codec.parse_header(container)[1:3] == (0, 0)


def test_bad_regions_refused():
    with pytest.raises(ValueError, match="overlaps"):
        codec.plan_chunks(100, [(0, 60, "float32"), (50, 10, "float32")])
    with pytest.raises(ValueError, match="passes the end"):
        codec.plan_chunks(100, [(90, 20, "float32")])
