"""The pure placement logic, checked against brute force."""

import itertools
import json
import random
import struct

import numpy as np
import pytest

from dcp_nvme.engines.requests import SCRATCH, plan_segments, plan_windows
from dcp_nvme.format.container import (
    DIRECT_MIN,
    ITEMSIZE_GAP,
    ItemSpec,
    is_pad_key,
    parse_header,
    place_back_to_back,
    place_congruent,
    plan_container,
)
from dcp_nvme.load.planning import FileBlocks, Need, count_runs, covering_rows, plan_reads, slice_runs


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


def _one_span(window, addresses):
    """The window's address when it is one direct write from host memory (any alignment)."""
    segments = plan_segments(window, addresses, 1, min_direct=1)
    return segments[0].address if len(segments) == 1 else None


def test_sources_laid_out_like_the_container_make_every_window_one_span():
    sizes = [12, 0, 5, 4096, 3, 8000]
    offsets, end = place_back_to_back(sizes)
    assert offsets == list(plan_container([ItemSpec(str(i), n, "U8", (n,)) for i, n in enumerate(sizes)],
                                          {}).offsets) and end == sum(sizes)
    base = 1 << 20
    windows = list(plan_windows(sizes, 1000))
    assert [_one_span(w, [base + o for o in offsets]) for w in windows] == [base + w.offset for w in windows]
    # aligned for dtypes (a staging arena) but the sources back to back: the padding breaks the
    # span where it falls
    padded, padded_end = place_back_to_back(sizes, [4, 1, 1, 8, 1, 8])
    assert padded == [0, 12, 12, 24, 4120, 4128] and padded_end == 12128
    spans = [_one_span(w, [base + o for o in padded]) for w in windows]
    assert spans[0] is None  # the 7 bytes of padding after item 2 fall in the first window
    assert spans[1] == base + 1000 + 7  # one span again inside item 3, shifted by the padding
    assert spans[4] is None  # and broken again by the padding before item 5
    assert _one_span(windows[0], [None, *[base + o for o in offsets[1:]]]) is None  # not host memory


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


# --------------------------------------------------------------------------- congruent placement


def _reference_placement(sizes, addresses, congruence, threshold):
    """Brute force: each item at the first offset from the cursor that meets its address
    modulo ``congruence``, when that gap is allowed for its size; else at the cursor."""
    offsets, cursor = [], 0
    for size, address in zip(sizes, addresses):
        if address is not None and size > 0:
            limit = congruence if size >= threshold else ITEMSIZE_GAP
            for gap in range(limit):
                if (cursor + gap - address) % congruence == 0:
                    cursor += gap
                    break
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


@pytest.mark.parametrize("seed", range(30))
def test_congruent_placement_against_brute_force(seed):
    rng = random.Random(seed)
    congruence = rng.choice([64, 512, 4096])
    threshold = rng.choice([1, 100, 5000])
    sizes = [rng.choice([0, 1, 3, 17, 100, 4096, 5000, 70_000]) for _ in range(rng.randint(1, 30))]
    addresses = [rng.choice([None, rng.randrange(0, 1 << 30), rng.randrange(0, 1 << 24) * 64])
                 for _ in sizes]
    offsets, end = place_congruent(sizes, addresses, congruence, threshold)
    assert (offsets, end) == _reference_placement(sizes, addresses, congruence, threshold)
    previous_end = 0
    for size, address, offset in zip(sizes, addresses, offsets):
        gap = offset - previous_end
        assert 0 <= gap < congruence  # no overlap, and a gap below the congruence
        if gap:
            assert address is not None and size > 0 and (address - offset) % congruence == 0
        if address is not None and size >= max(threshold, 1):
            assert (address - offset) % congruence == 0  # every large host item is congruent
        previous_end = offset + size
    assert end == previous_end


@pytest.mark.parametrize("seed", range(10))
def test_congruent_placement_keeps_a_staging_arena_layout(seed):
    """Tensors laid out by the stager (itemsize alignment from a page) keep their arena offsets,
    so windows stay one span; behind unrelated items (a bounded save's live tensors) they do
    from the first large one on (small ones before it take no big gap)."""
    rng = random.Random(seed)
    itemsizes = [rng.choice([1, 2, 4, 8, 16]) for _ in range(40)]
    sizes = [s * rng.choice([0, 1, 3, 7, 1000, 20_000, 100_000]) for s in itemsizes]
    arena, _ = place_back_to_back(sizes, itemsizes)
    base = rng.randrange(1, 1 << 20) * 4096
    live = [rng.randrange(0, 1 << 20) for _ in range(rng.randint(0, 3))]
    live_addresses = [rng.randrange(0, 1 << 30) for _ in live]
    offsets, _ = place_congruent(live + sizes, live_addresses + [base + a for a in arena])
    kept = [i for i, n in enumerate(sizes) if n]  # an empty item's offset holds no byte
    placed = [offsets[len(live) + i] for i in kept]
    expected = [arena[i] for i in kept]
    if not live:
        assert placed == expected
    large = [k for k, i in enumerate(kept) if sizes[i] >= DIRECT_MIN]
    if large:
        first = large[0]
        assert [o - placed[first] for o in placed[first:]] == [a - expected[first] for a in expected[first:]]
        assert (placed[first] - expected[first]) % 4096 == 0  # the arena's pages line up with the file's


def test_container_with_addresses_describes_every_gap_as_a_pad():
    items = [ItemSpec("a", 100, "U8", (100,)), ItemSpec("b", 80_000, "F32", (20_000,)),
             ItemSpec("c", 3, "U8", (3,)), ItemSpec("d", 70_000, "U8", (70_000,)), ItemSpec("e", 0, "F32", (0,))]
    addresses = [None, 4096 * 7 + 64, 12345, 4096 * 99 + 1000, 64]
    layout = plan_container(items, {"rank": "0"}, addresses=addresses)
    # b: the first offset past 100 that is 64 mod 4096; c is small and 1913 bytes off: no gap;
    # d: 1000 mod 4096; e is empty
    assert layout.offsets == (0, 4160, 84_160, 87_016, 157_016)
    assert layout.pads == ((100, 4060), (84_163, 2853))
    header = json.loads(layout.header[8:])
    entries = sorted((v["data_offsets"], k, v) for k, v in header.items() if k != "__metadata__")
    cursor = 0
    for (start, end), key, entry in entries:  # the entries cover the data region with no gap
        assert start == cursor
        cursor = end
        if is_pad_key(key):
            assert entry["dtype"] == "U8" and entry["shape"] == [end - start] and end > start
    assert cursor == layout.data_size
    assert [(s, e - s) for (s, e), k, _ in entries if is_pad_key(k)] == list(layout.pads)
    _, parsed, data_start = parse_header(layout.header, "c")
    assert data_start == layout.data_start
    assert [i.key for i in parsed] == ["a", "b", "c", "d", "e"]  # pads are not items
    assert [i.start for i in parsed] == list(layout.offsets)
    with pytest.raises(ValueError, match="reserved"):
        plan_container([ItemSpec("__pad__.0", 1, "U8", (1,))], {})


# --------------------------------------------------------------------------- write segments


def _byte_addresses(window, addresses):
    """Where each byte of the window is in memory (None: not in host memory), and its source."""
    out = []
    for piece in window.pieces:
        for k in range(piece.length):
            base = addresses[piece.source]
            out.append((None if base is None else base + piece.src_offset + k, piece.source, piece.src_offset + k))
    return out


def _reference_direct(window, addresses, align, min_direct):
    """Brute force: the window offsets a direct write may cover, byte by byte."""
    places = _byte_addresses(window, addresses)
    direct = set()
    start = 0
    while start < len(places):  # maximal runs of consecutive memory
        end = start + 1
        while (end < len(places) and places[start][0] is not None and places[end][0] is not None
               and places[end][0] == places[end - 1][0] + 1):
            end += 1
        address = places[start][0]
        if address is not None and (address - window.offset - start) % align == 0:
            lo, hi = -(-start // align) * align, end // align * align
            if hi - lo >= max(min_direct, 1):
                direct.update(range(lo, hi))
        start = end
    return direct


@pytest.mark.parametrize("seed", range(40))
def test_segments_against_brute_force(seed):
    rng = random.Random(seed)
    align = rng.choice([1, 8, 64])
    block = align * rng.choice([4, 16, 50])
    min_direct = rng.choice([1, align, 3 * align])
    sizes = [rng.choice([0, 1, 5, 64, 100, 300, 1000]) for _ in range(rng.randint(1, 12))]
    # sources in memory: back to back (an arena), scattered, congruent or not, or on a device
    addresses, cursor = [], rng.randrange(0, 4) * 64
    for size in sizes:
        kind = rng.choice(["next", "far", "device"])
        if kind == "far":
            cursor += rng.randrange(1, 5000)
        addresses.append(None if kind == "device" else cursor)
        cursor += size + (0 if kind == "next" else 1)
    for max_segments in (1024, 3):
        for window in plan_windows(sizes, block):
            segments = plan_segments(window, addresses, align, min_direct=min_direct,
                                     max_segments=max_segments)
            assert len(segments) <= max(max_segments, 1)
            places = _byte_addresses(window, addresses)
            position = 0
            for index, segment in enumerate(segments):
                assert segment.offset == position and segment.length > 0
                position += segment.length
                last = index == len(segments) - 1
                assert segment.offset % align == 0
                if segment.address is not None:  # direct: aligned, and exactly the window's bytes
                    assert segment.address % align == 0 and segment.length % align == 0
                    assert segment.length >= min_direct and not segment.pieces and not segment.fill
                    assert [places[segment.offset + k][0] for k in range(segment.length)] == list(
                        range(segment.address, segment.address + segment.length))
                else:  # bounced: its pieces rebuild exactly its bytes
                    rebuilt = [(p.source, p.src_offset + k) for p in segment.pieces for k in range(p.length)]
                    assert [p.dst_offset for p in segment.pieces] == list(
                        itertools.accumulate([segment.offset] + [p.length for p in segment.pieces[:-1]]))
                    assert rebuilt == [places[q][1:] for q in range(segment.offset, segment.offset + segment.length)]
                    assert (segment.length + segment.fill) % align == 0 or not last and not segment.fill
                    assert segment.fill < align and (segment.fill == 0 or last)
                if not last:
                    assert segment.length % align == 0
            assert position == window.length
            direct = {q for s in segments if s.address is not None for q in range(s.offset, s.offset + s.length)}
            reference = _reference_direct(window, addresses, align, min_direct)
            if max_segments == 1024:
                assert direct == reference
            else:
                assert direct <= reference


def test_segments_of_an_aligned_arena_are_one_direct_write():
    sizes = [4096, 100, 3996, 8192, 5]
    offsets, _ = place_back_to_back(sizes)
    base = 1 << 20
    windows = list(plan_windows(sizes, 8192))
    segments = [plan_segments(w, [base + o for o in offsets], 512) for w in windows]
    assert [[(s.offset, s.length, s.address) for s in seg] for seg in segments[:2]] == [
        [(0, 8192, base)], [(0, 8192, base + 8192)]]
    tail = segments[2]  # 5 bytes: bounced, rounded up to the alignment with zeros
    assert [(s.address, s.length, s.fill) for s in tail] == [(None, 5, 507)]
    buffered = plan_segments(windows[2], [base + o for o in offsets], 1, min_direct=1)
    assert [(s.address, s.length, s.fill) for s in buffered] == [(base + 16384, 5, 0)]
