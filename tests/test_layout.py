"""The pure placement logic, checked against brute force."""

import itertools
import json
import random
import struct

import numpy as np
import pytest

from dcp_nvme.layout import (
    SCRATCH,
    FileBlocks,
    ItemSpec,
    Need,
    contiguous_span,
    count_runs,
    covering_rows,
    place_back_to_back,
    plan_container,
    plan_reads,
    plan_windows,
    slice_runs,
)


def test_container_header_is_valid_safetensors_and_aligned():
    items = [ItemSpec("a", 12, "F32", (3,)), ItemSpec("b", 0, "F32", (0, 4)), ItemSpec("c", 5, "U8", (5,))]
    layout = plan_container(items, {"rank": "0"})
    assert layout.data_start % 4096 == 0
    (length,) = struct.unpack("<Q", layout.header[:8])
    assert 8 + length == layout.data_start
    header = json.loads(layout.header[8:])
    assert header["__metadata__"] == {"rank": "0"}
    assert header["a"]["data_offsets"] == [0, 12]
    assert header["b"]["data_offsets"] == [12, 12]
    assert header["c"]["data_offsets"] == [12, 17]
    assert layout.offsets == (0, 12, 12)
    assert layout.file_size == layout.data_start + 17


def test_sources_laid_out_like_the_container_make_every_window_one_span():
    sizes = [12, 0, 5, 4096, 3, 8000]
    offsets, end = place_back_to_back(sizes)
    assert offsets == list(plan_container([ItemSpec(str(i), n, "U8", (n,)) for i, n in enumerate(sizes)],
                                          {}).offsets) and end == sum(sizes)
    base = 1 << 20
    windows = list(plan_windows(sizes, 1000))
    assert [contiguous_span(w, [base + o for o in offsets]) for w in windows] == [
        base + w.offset for w in windows]
    # aligned for dtypes (a staging arena): the padding breaks the span where it falls
    padded, padded_end = place_back_to_back(sizes, [4, 1, 1, 8, 1, 8])
    assert padded == [0, 12, 12, 24, 4120, 4128] and padded_end == 12128
    spans = [contiguous_span(w, [base + o for o in padded]) for w in windows]
    assert spans[0] is None  # the 7 bytes of padding after item 2 fall in the first window
    assert spans[1] == base + 1000 + 7  # one span again inside item 3, shifted by the padding
    assert spans[4] is None  # and broken again by the padding before item 5
    assert contiguous_span(windows[0], [None, *[base + o for o in offsets[1:]]]) is None  # not host memory


def test_container_rejects_duplicate_keys():
    with pytest.raises(ValueError, match="duplicate"):
        plan_container([ItemSpec("a", 1, "U8", (1,))] * 2, {})


@pytest.mark.parametrize("block", [1, 7, 4096])
def test_windows_cover_every_byte_once(block):
    rng = random.Random(block)
    sizes = [rng.choice([0, 1, 3, 100, 5000]) for _ in range(40)]
    stream = bytearray()
    for index, size in enumerate(sizes):
        stream += bytes([index]) * size
    rebuilt = bytearray(len(stream))
    previous_end = 0
    for window in plan_windows(sizes, block):
        assert window.offset == previous_end and 0 < window.length <= block
        previous_end += window.length
        assert sum(p.length for p in window.pieces) == window.length
        for piece in window.pieces:
            assert piece.length > 0
            rebuilt[window.offset + piece.dst_offset : window.offset + piece.dst_offset + piece.length] = (
                bytes([piece.source]) * piece.length
            )
    assert previous_end == len(stream)
    assert rebuilt == stream


def _brute_force(shape, offsets, lengths):
    array = np.arange(int(np.prod(shape)) if shape else 1).reshape(shape)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
    return array[index].reshape(-1) if shape else array.reshape(-1)


@pytest.mark.parametrize("seed", range(30))
def test_slice_runs_match_numpy(seed):
    rng = random.Random(seed)
    ndim = rng.randint(0, 4)
    shape = tuple(rng.randint(1, 6) for _ in range(ndim))
    offsets = tuple(rng.randint(0, s - 1) for s in shape)
    lengths = tuple(rng.randint(1, s - o) for s, o in zip(shape, offsets))
    itemsize = rng.choice([1, 2, 4])
    source = np.arange(int(np.prod(shape)) if shape else 1, dtype=np.int64)
    packed = np.full(int(np.prod(lengths)) if lengths else 1, -1, dtype=np.int64)
    runs = slice_runs(shape, offsets, lengths, itemsize)
    assert len(runs) <= count_runs(shape, offsets, lengths)
    for src, nbytes, dst in runs:
        assert src % itemsize == 0 and nbytes % itemsize == 0
        packed[dst // itemsize : (dst + nbytes) // itemsize] = source[src // itemsize : (src + nbytes) // itemsize]
    np.testing.assert_array_equal(packed, _brute_force(shape, offsets, lengths))


def test_slice_runs_full_tensor_is_one_run_and_row_slices_merge():
    assert slice_runs((4, 8), (0, 0), (4, 8), 2) == [(0, 64, 0)]
    assert slice_runs((4, 8), (1, 0), (2, 8), 2) == [(16, 32, 0)]
    assert count_runs((4, 8), (0, 2), (4, 3)) == 4
    assert slice_runs((4, 0), (0, 0), (4, 0), 2) == []
    assert slice_runs((), (), (), 4) == [(0, 4, 0)]


def test_slice_runs_rejects_out_of_bounds():
    with pytest.raises(ValueError, match="out of bounds"):
        slice_runs((4,), (2,), (3,), 1)


def test_covering_rows():
    assert covering_rows((4, 8), (1, 2), (2, 3), 2) == (16, 32)


def _execute(requests, file_bytes, dests, verify_crc=None):
    """Run planned requests against an in-memory file, the way an engine must."""
    for request in requests:
        chunk = file_bytes[request.file_offset : request.file_offset + request.length]
        assert len(chunk) == request.length
        assert sum(p[2] for p in request.pieces) == request.length
        position = 0
        for dest, dest_offset, length in request.pieces:
            if dest != SCRATCH:
                dests[dest][dest_offset : dest_offset + length] = chunk[position : position + length]
            position += length
        for rel, length, expected in request.checks:
            assert verify_crc(chunk[rel : rel + length]) == expected


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_plan_reads_delivers_exactly_the_needed_bytes(verify, seed):
    import crc32c

    rng = random.Random(seed)
    data_start, data_size, granule = 4096, 50_000, 1024
    file_bytes = bytes(rng.randrange(256) for _ in range(data_start + data_size))
    blocks = None
    if verify:
        crcs = [crc32c.crc32c(file_bytes[data_start + i : data_start + min(i + granule, data_size)])
                for i in range(0, data_size, granule)]
        blocks = FileBlocks(data_start, data_size, granule, crcs)
    needs, dests, expected = [], [], []
    for dest in range(12):
        start = data_start + rng.randrange(data_size - 1)
        length = rng.randint(1, min(6000, data_start + data_size - start))
        needs.append(Need(start, length, dest, 0))
        dests.append(bytearray(length))
        expected.append(file_bytes[start : start + length])
    requests = plan_reads("f", needs, max_request=4 * granule, blocks=blocks)
    for request in requests:
        assert request.length <= 4 * granule
        if verify:
            assert (request.file_offset - data_start) % granule == 0
            covered = sum(n for _, n, _ in request.checks)
            assert covered == request.length
    _execute(requests, file_bytes, dests, verify_crc=crc32c.crc32c)
    assert [bytes(d) for d in dests] == expected


def test_plan_reads_merges_adjacent_needs_into_one_request():
    needs = [Need(100 + 10 * i, 10, i, 0) for i in range(5)]
    requests = plan_reads("f", needs, max_request=1 << 20)
    assert len(requests) == 1
    assert requests[0].file_offset == 100 and requests[0].length == 50
    assert [p[0] for p in requests[0].pieces] == [0, 1, 2, 3, 4]


def test_plan_reads_keeps_gaps_apart_unless_allowed():
    needs = [Need(0, 10, 0, 0), Need(100, 10, 1, 0)]
    assert len(plan_reads("f", needs, max_request=1 << 20)) == 2
    merged = plan_reads("f", needs, max_request=1 << 20, max_gap=90)
    assert len(merged) == 1 and merged[0].pieces[1] == (SCRATCH, 0, 90)


def test_plan_reads_rejects_ranges_outside_the_data_region():
    blocks = FileBlocks(4096, 100, 64, [0, 0])
    with pytest.raises(ValueError, match="outside the data region"):
        plan_reads("f", [Need(4096 + 90, 20, 0, 0)], max_request=128, blocks=blocks)


def test_plan_reads_handles_overlapping_needs():
    file_bytes = bytes(range(200))
    needs = [Need(10, 50, 0, 0), Need(30, 50, 1, 0), Need(30, 50, 2, 0)]
    dests = [bytearray(50) for _ in range(3)]
    _execute(plan_reads("f", needs, max_request=16), file_bytes, dests)
    assert bytes(dests[0]) == file_bytes[10:60]
    assert bytes(dests[1]) == bytes(dests[2]) == file_bytes[30:80]


def test_itertools_sanity_of_brute_force_helper():
    # the brute force itself: a 2x3 slice of a 4x5 array
    got = _brute_force((4, 5), (1, 1), (2, 3))
    want = [r * 5 + c for r, c in itertools.product(range(1, 3), range(1, 4))]
    assert list(got) == want
