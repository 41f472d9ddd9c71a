"""Zero-copy O_DIRECT reads: a request's bytes land straight in host destinations whose memory is
congruent to the file (mod the O_DIRECT alignment); only unaligned edges, unwanted bytes,
non-congruent and tiny pieces go through the bounce buffer, all in one vectored read. Real
files, both engines; the planning itself checked by brute force."""

from __future__ import annotations

import errno
import json
import os
import random
import struct

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import ChecksumMismatchError, NVMeReader, NVMeWriter
from dcp_nvme.config import ALIGN, IOConfig
from dcp_nvme.engines import posix, reads
from dcp_nvme.engines.host_io import DioAlignment, aligned_buffer, dio_alignment
from dcp_nvme.engines.requests import plan_read_segments
from dcp_nvme.engines.uring import UringEngine, uring_unavailable_reason
from dcp_nvme.errors import DCPNVMeError
from dcp_nvme.format.container import align_down, align_up
from dcp_nvme.load.planning import FileBlocks, Need, plan_reads, slice_runs

ENGINES = ["posix", pytest.param("uring", marks=pytest.mark.skipif(
    uring_unavailable_reason() is not None, reason=f"io_uring: {uring_unavailable_reason()}"))]
BLOCK = 64 << 10  # checksum block and request size: several requests per large item
DATA_START = ALIGN


# --------------------------------------------------------------------------- planning, brute force


def _random_read(rng: random.Random, align: int) -> tuple[int, list[tuple[int, int | None]], int, int]:
    """A request at a random offset with random pieces: congruent, shifted or no address."""
    lo = rng.randrange(0, 64) * ALIGN
    offset = lo + (rng.randrange(ALIGN) if align > 1 else 0)
    pieces, position = [], offset
    for _ in range(rng.randrange(0, 12)):
        length = rng.choice([0, 1, 7, rng.randrange(1, 3 * ALIGN), rng.randrange(ALIGN, 40 * ALIGN)])
        kind = rng.random()
        if kind < 0.5:  # congruent to its file offset
            address = (1 << 30) + position + rng.randrange(4) * ALIGN
        elif kind < 0.8:  # off by a few bytes
            address = (1 << 30) + position + rng.choice([1, 64, 256])
        else:
            address = None  # scratch, or device memory
        pieces.append((length, address))
        position += length
    hi = align_up(position) if align > 1 else position + rng.choice([0, 0, 5])
    return offset, pieces, lo, hi


@pytest.mark.parametrize("seed", range(300))
def test_read_segments_cover_the_range_and_direct_spans_are_aligned(seed):
    rng = random.Random(seed)
    align = rng.choice([1, 64, 512, 4096])
    min_direct = rng.choice([1, 512, ALIGN])
    max_segments = rng.choice([3, 5, 1024])
    offset, pieces, lo, hi = _random_read(rng, align)
    segments = plan_read_segments(offset, pieces, lo, hi, align, min_direct=min_direct, max_segments=max_segments)

    starts, position = [], offset  # each piece's file offset
    for length, _ in pieces:
        starts.append(position)
        position += length
    assert len(segments) <= max_segments
    cursor = 0
    for index, segment in enumerate(segments):
        assert segment.offset == cursor and segment.length > 0 and segment.fill == 0
        last = index == len(segments) - 1
        assert (lo + segment.offset) % align == 0  # every segment starts aligned in the file
        assert last or segment.length % align == 0
        if segment.address is not None:  # read straight into one piece's own memory
            assert segment.address % align == 0 and segment.length % align == 0
            assert segment.length >= min_direct
            file_lo, file_hi = lo + segment.offset, lo + segment.offset + segment.length
            hits = [i for i, (n, a) in enumerate(pieces)
                    if a is not None and starts[i] < file_hi and file_lo < starts[i] + n]
            assert hits, segment
            first = hits[0]
            assert segment.address == pieces[first][1] + file_lo - starts[first]
            assert starts[hits[0]] <= file_lo and file_hi <= starts[hits[-1]] + pieces[hits[-1]][0]
        else:  # the bounce buffer at the same offset: its pieces fill it exactly, in file order
            at = segment.offset
            for piece in segment.pieces:
                assert piece.dst_offset == at and piece.length > 0
                if piece.source < len(pieces):
                    assert starts[piece.source] + piece.src_offset == lo + at
                    assert piece.src_offset + piece.length <= pieces[piece.source][0]
                else:
                    assert not offset <= lo + at < position  # the rounding lies outside the request
                at += piece.length
            assert at == segment.offset + segment.length
        cursor += segment.length
    assert cursor == hi - lo

    if max_segments == 1024:  # uncapped: every congruent piece's aligned bulk is read direct
        direct = sum(s.length for s in segments if s.address is not None)
        bulk = 0
        for start, (length, address) in zip(starts, pieces):
            if address is not None and (address - start) % align == 0:
                inner = align_down(start + length, align) - align_up(start, align)
                bulk += inner if inner >= max(min_direct, 1) else 0
        assert direct >= bulk


def test_read_segments_refuse_a_range_that_does_not_hold_the_request():
    with pytest.raises(ValueError, match="does not hold"):
        plan_read_segments(ALIGN, [(ALIGN + 1, None)], 0, 2 * ALIGN, 512)


# --------------------------------------------------------------------------- engine reads of a real file


def _engine(name: str, queue_depth: int = 3) -> posix.PosixEngine:
    config = IOConfig(direct_io=True, read_mode="direct", block_size=BLOCK, queue_depth=queue_depth)
    return UringEngine(config) if name == "uring" else posix.PosixEngine(config)


def _data_file(tmp_path, size: int, seed: int = 1) -> tuple[str, bytes, FileBlocks]:
    """A file of a page of header then ``size`` random bytes, with the crc32c of every block."""
    data = random.Random(seed).randbytes(size)
    path = str(tmp_path / "data.bin")
    with open(path, "wb") as handle:
        handle.write(bytes(DATA_START) + data)
    crcs = [crc32c.crc32c(data[i : i + BLOCK]) for i in range(0, size, BLOCK)]
    return path, data, FileBlocks(DATA_START, size, BLOCK, crcs)


def _dests_at(needs_bytes: list[tuple[int, int]], shift: int) -> list[torch.Tensor]:
    """One destination per ``(file_offset, length)``, in one page-aligned buffer at an address
    congruent to its file offset plus ``shift`` (mod a page)."""
    places, cursor = [], 0
    for file_offset, length in needs_bytes:
        cursor = align_up(cursor) + (file_offset + shift) % ALIGN
        places.append((cursor, length))
        cursor += length
    buffer = aligned_buffer(cursor + ALIGN, pin=False)
    return [buffer[at : at + length] for at, length in places]


def _read(engine, path, needs, blocks, dests):
    try:
        return engine.read(plan_reads(path, needs, max_request=BLOCK, blocks=blocks), dests)
    finally:
        engine.close()


def _skip_unless_direct(direct_io: bool) -> None:
    if not direct_io:
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")


# items of every awkward size: tiny, empty, odd, a page, large; the file ends mid-page (EOF)
SIZES = [3, 0, 70_001, 4096, 1, 300_000, 65_536 + 17, 12_345, 200_003]


def _whole_items(sizes):
    offsets, cursor = [], DATA_START
    for size in sizes:
        offsets.append(cursor)
        cursor += size
    return [(offset, size) for offset, size in zip(offsets, sizes)], cursor - DATA_START


def _read_whole_items(tmp_path, engine: str, shift: int):
    """Every item of a file of SIZES read into destinations ``shift`` bytes off congruence,
    checked byte for byte; the read's stats and the data size."""
    items, size = _whole_items(SIZES)
    path, data, blocks = _data_file(tmp_path, size)
    dests = _dests_at(items, shift)
    needs = [Need(offset, length, index, 0) for index, (offset, length) in enumerate(items)]
    stats = _read(_engine(engine), path, needs, blocks, dests)
    _skip_unless_direct(stats.direct_io)
    for (offset, length), dest in zip(items, dests):
        assert dest.numpy().tobytes() == data[offset - DATA_START : offset - DATA_START + length]
    return stats, size


@pytest.mark.parametrize("engine", ENGINES)
def test_congruent_destinations_are_read_without_a_copy(tmp_path, engine):
    stats, size = _read_whole_items(tmp_path, engine, 0)
    # only edges and items too small for a direct span bounce: a few pages per item at most
    assert 0 < stats.copied_bytes <= sum(min(n, 6 * ALIGN) for n in SIZES)
    assert stats.copied_bytes < 0.15 * size, stats


@pytest.mark.parametrize("engine", ENGINES)
def test_destinations_off_by_64_bytes_are_all_bounced_and_correct(tmp_path, engine):
    stats, size = _read_whole_items(tmp_path, engine, 64)
    assert stats.copied_bytes == size  # every wanted byte, copied out of a bounce buffer


@pytest.mark.parametrize("engine", ENGINES)
def test_narrowed_reads_of_a_tensor_scatter_through_gaps(tmp_path, engine):
    """A reshard's pieces of one row-major tensor: a block of rows (one run), and a column block
    (a run per row, gaps read to scratch), each into its own congruent destination."""
    shape, itemsize = (64, 3000), 2  # bf16-sized elements, rows of 6000 bytes
    size = shape[0] * shape[1] * itemsize
    path, data, blocks = _data_file(tmp_path, size, seed=5)
    rows = slice_runs(shape, (4, 0), (52, shape[1]), itemsize)
    columns = slice_runs(shape, (0, 700), (shape[0], 2100), itemsize)
    wanted = [(DATA_START + rows[0][0], 52 * shape[1] * itemsize),
              (DATA_START + columns[0][0], shape[0] * 2100 * itemsize)]
    dests = _dests_at(wanted, 0)
    needs = [Need(DATA_START + src, n, 0, dst) for src, n, dst in rows]
    needs += [Need(DATA_START + src, n, 1, dst) for src, n, dst in columns]
    stats = _read(_engine(engine), path, needs, blocks, dests)
    _skip_unless_direct(stats.direct_io)
    for dest, runs in zip(dests, (rows, columns)):
        expected = b"".join(data[src : src + n] for src, n, _ in runs)
        assert dest.numpy().tobytes() == expected
    assert stats.copied_bytes <= wanted[1][1] + 2 * ALIGN  # the row block went direct but its edges


@pytest.mark.parametrize("engine", ENGINES)
def test_a_corrupt_byte_in_a_direct_span_is_caught(tmp_path, engine):
    items, size = _whole_items([300_000, 5])
    path, data, blocks = _data_file(tmp_path, size)
    dests = _dests_at(items, 0)
    needs = [Need(offset, length, index, 0) for index, (offset, length) in enumerate(items)]
    stats = _read(_engine(engine), path, needs, blocks, dests)
    _skip_unless_direct(stats.direct_io)
    assert stats.copied_bytes < 3 * ALIGN  # the byte below lands straight in its destination
    flipped = DATA_START + 3 * BLOCK + 100
    with open(path, "r+b") as handle:
        handle.seek(flipped)
        handle.write(bytes([data[flipped - DATA_START] ^ 1]))
    with pytest.raises(ChecksumMismatchError) as caught:
        _read(_engine(engine), path, needs, blocks, _dests_at(items, 0))
    assert caught.value.path == path and caught.value.start <= flipped < caught.value.end


@pytest.mark.parametrize("engine", ENGINES)
def test_a_truncated_file_is_named_when_its_tail_is_read_direct(tmp_path, engine):
    items, size = _whole_items([300_000])
    path, _, blocks = _data_file(tmp_path, size)
    os.truncate(path, DATA_START + 200_000)  # inside the item's aligned bulk
    needs = [Need(DATA_START, 300_000, 0, 0)]
    with pytest.raises(DCPNVMeError, match="data.bin is truncated"):
        _read(_engine(engine), path, needs, blocks, _dests_at(items, 0))


def test_o_direct_refusing_destination_memory_falls_back_to_bouncing(tmp_path, monkeypatch, caplog):
    """EINVAL from a read into destination memory: that request and the rest of the file are
    read again through bounce buffers, with one warning."""
    items, size = _whole_items(SIZES)
    path, data, blocks = _data_file(tmp_path, size)
    real, refused = os.preadv, []

    def refuse_once(fd, views, offset):
        if len(views) > 1 and not refused:  # a mixed read: direct and bounced spans
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, views, offset)

    monkeypatch.setattr(posix.os, "preadv", refuse_once)
    dests = _dests_at(items, 0)
    needs = [Need(offset, length, index, 0) for index, (offset, length) in enumerate(items)]
    reads._warned_read_memory.clear()
    with caplog.at_level("WARNING"):
        stats = _read(_engine("posix", queue_depth=1), path, needs, blocks, dests)
    _skip_unless_direct(stats.direct_io)
    assert refused and caplog.text.count("bouncing every read of this file") == 1
    for (offset, length), dest in zip(items, dests):
        assert dest.numpy().tobytes() == data[offset - DATA_START : offset - DATA_START + length]
    assert stats.copied_bytes == size  # everything bounced after the refusal


@pytest.mark.parametrize("engine", ENGINES)
def test_an_alignment_the_kernel_refuses_falls_back_to_bouncing(tmp_path, monkeypatch, caplog, engine):
    """The filesystem claiming less alignment than O_DIRECT needs: the kernel's EINVAL on a
    direct span makes the reads bounce, through the ring too."""
    items, size = _whole_items(SIZES)
    path, data, blocks = _data_file(tmp_path, size)
    monkeypatch.setattr(reads, "dio_alignment", lambda fd: DioAlignment(64, 64, "test"))
    dests = _dests_at(items, 0)
    needs = [Need(offset, length, index, 0) for index, (offset, length) in enumerate(items)]
    reads._warned_read_memory.clear()
    with caplog.at_level("WARNING"):
        stats = _read(_engine(engine), path, needs, blocks, dests)
    _skip_unless_direct(stats.direct_io)
    for (offset, length), dest in zip(items, dests):
        assert dest.numpy().tobytes() == data[offset - DATA_START : offset - DATA_START + length]
    fd = os.open(path, os.O_RDONLY)
    try:
        needed = dio_alignment(fd)
    finally:
        os.close(fd)
    if max(needed.memory, needed.offset) > 64:  # the kernel refused a span 64-aligned only
        assert "bouncing every read of this file" in caplog.text


# --------------------------------------------------------------------------- through DCP


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w_bf16": torch.randn(300, 1001, generator=g).bfloat16(),
        "w_f32": torch.randn(200_003, generator=g),
        "w_i8": torch.randint(-128, 127, (150_001,), dtype=torch.int8, generator=g),
        "tiny": torch.randn(3, generator=g),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "odd_i8": torch.randint(-128, 127, (4097,), dtype=torch.int8, generator=g),
    }


def _nbytes(state) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def _file_offsets(path) -> dict[str, int]:
    container = next(path.glob("rank_*.safetensors"))
    with open(container, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {k: 8 + length + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _like_at(state, offsets, shift) -> dict[str, torch.Tensor]:
    """Empty destinations for ``state`` at addresses congruent to their file offsets + ``shift``."""
    keys = list(state)
    places = _dests_at([(offsets[k], state[k].numel() * state[k].element_size()) for k in keys], shift)
    dest = {}
    for key, raw in zip(keys, places):
        value = state[key]
        if value.numel() and raw.data_ptr() % value.element_size() == 0:
            dest[key] = raw.view(value.dtype).reshape(value.shape)
        else:  # empty, or a small item at an offset its dtype cannot start at in memory
            dest[key] = torch.empty_like(value)
    return dest


@pytest.mark.parametrize("engine", ENGINES)
def test_reloading_the_saved_tensors_reads_them_in_place(tmp_path, engine):
    """The writer placed each large tensor congruent to its address; loading back into the same
    tensors (zeroed) finds that congruence, so almost nothing bounces."""
    state = _state()
    dcp.save(state, storage_writer=NVMeWriter(tmp_path, engine=engine, block_size="1MiB"), no_dist=True)
    expected = {k: v.clone() for k, v in state.items()}
    for value in state.values():
        value.zero_()
    reader = NVMeReader(tmp_path, engine=engine, read_mode="direct", block_size="1MiB")
    dcp.load(state, storage_reader=reader, no_dist=True)
    _skip_unless_direct(reader.last_stats["direct_io"])
    assert all(torch.equal(state[k], expected[k]) for k in state)
    assert reader.last_stats["copied_bytes"] <= 0.05 * _nbytes(state), reader.last_stats


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shift", [0, 64])
def test_dcp_loads_into_congruent_and_shifted_destinations(tmp_path, engine, shift):
    state = _state()
    dcp.save(state, storage_writer=NVMeWriter(tmp_path, engine=engine, block_size="1MiB"), no_dist=True)
    dest = _like_at(state, _file_offsets(tmp_path), shift)
    reader = NVMeReader(tmp_path, engine=engine, read_mode="direct", block_size="1MiB")
    dcp.load(dest, storage_reader=reader, no_dist=True)
    _skip_unless_direct(reader.last_stats["direct_io"])
    assert all(dest[k].dtype == v.dtype and torch.equal(dest[k], v) for k, v in state.items())
    copied, needed = reader.last_stats["copied_bytes"], reader.last_stats["bytes_needed"]
    if shift:
        assert copied == needed  # nothing congruent: every byte bounced
    else:
        assert copied <= 0.05 * needed, reader.last_stats
