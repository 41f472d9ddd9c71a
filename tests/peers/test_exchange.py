"""The exchange's transfers between real ranks (``peers.exchange``, ``peers.streams``; gloo on loopback, each rank
a node of its own with its own directory): transfers in many pieces from two holders at once, a
holder that cannot read a piece mid-transfer, the bytes kept on disk and held for the load.
tests/cross/test_node_local_restores.py runs the same exchange inside trainers' loads on
simulated nodes."""

from __future__ import annotations

import logging
import os
import shutil

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeWriter
from dcp_nvme.engines.requests import SCRATCH
from dcp_nvme.format.container import MANIFEST, RANGES_DIR
from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.format.pieces import Span
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.peers import exchange, mirror_reads, streams
from dcp_nvme.peers.kept import ReceivedBytes
from dcp_nvme.peers.restore import copy_pieces
from dcp_nvme.storage.local_dir import LocalStore

PIECE = 128 << 10  # the checkpoint's checksum block is 64 KiB: a transfer goes in many pieces


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint of one file (64 KiB checksum blocks) and that file's name."""
    path = str(tmp_path_factory.mktemp("exchange") / "step_1")
    torch.manual_seed(0)
    dcp.save({"w": torch.randn(300_000)}, storage_writer=NVMeWriter(path, block_size="64KiB"), no_dist=True)
    return path, read_manifest(LocalStore(path), path).file_names[0]


def _record(size: int = 1 << 20, block: int = 64 << 10) -> FileRecord:
    return FileRecord(name="rank_00000.abcd1234.safetensors", rank=0, size=size, data_start=4096,
                      checksum_block=block, header_crc=0, crcs=())


def test_a_transfer_is_cut_into_pieces_of_whole_checksum_blocks(monkeypatch):
    monkeypatch.setattr(streams, "PIECE", 256 << 10)
    record = _record(size=4096 + 10 * (64 << 10) + 123)  # a short last block
    for span in (Span(record.name, 0, record.size), Span(record.name, 4096 + (64 << 10), record.size),
                 Span(record.name, 4096 + 3 * (64 << 10), 4096 + 4 * (64 << 10))):
        pieces = streams.cut(record, span)
        assert pieces[0][0] == span.start and sum(n for _, n in pieces) == span.length
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))  # contiguous
        for at, n in pieces:
            end = at + n
            assert end == span.end or (end - record.data_start) % record.checksum_block == 0
            assert n <= 256 << 10
    # a pair's first transfer ramps up: the header and one block, then twice as much each piece,
    # up to PIECE, the last what is left
    ramp = streams.cut(record, Span(record.name, 0, record.size), first=64 << 10)
    assert [n for _, n in ramp] == [4096 + (64 << 10), 128 << 10, 256 << 10, 3 * (64 << 10) + 123]


def test_a_pairs_first_transfer_starts_with_a_small_piece():
    big = _record(size=4096 + (60 << 20))  # 2 MiB first, then twice as much each piece, up to 16 MiB
    sizes = [n for _, _, _, n in streams.pair_pieces({big.name: big}, [(0, Span(big.name, 0, big.size))])]
    assert [n <= limit << 20 for n, limit in zip(sizes, (2, 4, 8, 16, 16))] == [True] * 5
    assert sizes[3:5] == [16 << 20, 16 << 20] and sum(sizes) == big.size


def test_waves_keep_each_rank_to_a_bounded_number_of_peers(monkeypatch):
    monkeypatch.setattr(streams, "MAX_PEERS", 3)
    span = Span("f", 0, 10)
    assigned = [streams.Transfer(needer, 0, span, 0) for needer in range(1, 8)] + [streams.Transfer(1, 1, span, 0)]
    # rank 0 sends to 7
    waves = streams.waves(assigned)
    assert sorted(slot for wave in waves for slot in wave) == list(range(len(assigned)))
    for wave in waves:
        assert len({assigned[slot].needer for slot in wave}) <= 3
    assert len(waves) == 3


def test_received_bytes_are_taken_across_pieces_and_only_when_all_are_held():
    held = ReceivedBytes(budget=300)
    held.add("f", 100, memoryview(bytes(range(100))))
    held.add("f", 0, memoryview(bytes(range(100, 200))))
    held.add("f", 300, memoryview(bytes(200)))  # beyond the budget: not held
    assert held.size == 200
    views = held.take("f", 50, 100)
    assert b"".join(bytes(v) for v in views) == bytes(range(150, 200)) + bytes(range(50))
    assert held.take("f", 150, 60) is None  # 200..210 never came
    assert held.take("g", 0, 1) is None

    # a wait for more ends when more is held, or at a wake (nothing more will come), not at its timeout
    import threading
    import time

    threading.Timer(0.05, held.wake).start()
    began = time.monotonic()
    assert held.wait_beyond(held.size, timeout=30) == 200
    assert time.monotonic() - began < 10

    # into a request's pieces: scratch skipped, the rest at their destinations' offsets
    dests = [torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    copy_pieces([memoryview(b"abc"), memoryview(b"defghij")], [(0, 2, 4), (SCRATCH, 0, 2), (1, 0, 4)], dests)
    assert bytes(dests[0].numpy()) == b"\0\0abcd\0\0" and bytes(dests[1].numpy()) == b"ghij"
    assert numpy.array_equal(dests[1].numpy(), numpy.frombuffer(b"ghij", numpy.uint8))


def _transfer_rank(rank: int, world: int, dirs: list[str], name: str) -> None:
    streams.PIECE = PIECE
    path = dirs[rank]
    manifest = read_manifest(LocalStore(path), path)
    record = read_files(LocalStore(path), manifest, path)[name]
    views = [exchange.NodeView(str(r), manifest.save_key, frozenset([name] if r < 2 else [])) for r in range(world)]
    middle = record.data_start + (record.size - record.data_start) // 2 // record.checksum_block * record.checksum_block
    halves = [Span(name, 0, middle), Span(name, middle, record.size)]
    hold = ReceivedBytes(1 << 30)
    got = exchange.move_ranges(path, views, manifest, [(half,) for half in halves] if rank == 2 else [], hold=hold)
    assert sorted(got.arrived[2]) == halves and got.arrived[0] == got.arrived[1] == []
    if rank != 2:
        return
    with open(os.path.join(dirs[1], name), "rb") as f:
        original = f.read()
    with open(os.path.join(path, RANGES_DIR, name), "rb") as f:
        assert f.read() == original  # the first half from node 1 after node 0 stopped, the second from node 1
    assert b"".join(bytes(v) for v in hold.take(name, 0, record.size) or []) == original
    assert len(got.damaged) == 1 and "from node 0" in got.damaged[0] and "ChecksumMismatchError" in got.damaged[0]
    assert got.taken["peer"]["bytes"] >= record.size


def test_ranges_come_in_pieces_from_two_holders_and_a_holder_that_cannot_read_one_stops(saved, tmp_path):
    """Ranks 0 and 1 hold the file, rank 2 asks both halves: one from each holder at once. Node
    0's copy is damaged in its half's third piece: it sends a status instead of that piece and
    nothing more of the half; rank 2 takes the half from node 1, and names node 0."""
    from dcp_nvme_harness.dist_utils import run_ranks

    path, name = saved
    dirs = []
    for rank in range(3):
        copy = tmp_path / f"node{rank}"
        shutil.copytree(path, copy)
        dirs.append(str(copy))
    os.remove(os.path.join(dirs[2], name))
    manifest = read_manifest(LocalStore(path), path)
    record = read_files(LocalStore(path), manifest, path)[name]
    with open(os.path.join(dirs[0], name), "r+b") as f:
        at = record.data_start + 2 * PIECE + 100
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
    run_ranks(3, _transfer_rank, dirs, name)


def _wave_rank(rank: int, world: int, dirs: list[str], name: str) -> None:
    streams.PIECE = PIECE
    path = dirs[rank]
    manifest = read_manifest(LocalStore(path), path)
    record = read_files(LocalStore(path), manifest, path)[name]
    block = record.checksum_block
    a, b = record.data_start + 6 * block, record.data_start + 12 * block
    spans = [Span(name, 0, a), Span(name, a, b), Span(name, b, record.size)]
    wave = [(slot, streams.Transfer(1, slot, span, 0)) for slot, span in enumerate(spans)]  # rank 1 asks rank 0
    if rank == 1:  # the second range arrives damaged; the third cannot be kept
        checked = streams.verify_piece

        def damaged_on_arrival(record, at, data, where):
            if a <= at < b:
                data = bytearray(data)
                data[0] ^= 0xFF
            return checked(record, at, memoryview(data), where)

        streams.verify_piece = damaged_on_arrival

    def keep(record, at, data):
        if at >= b:
            raise OSError("no space left on the device")

    here = {name: os.path.join(path, name)} if rank == 0 else {}
    outcome = streams.run_wave(exchange._exchange_group(), 0, wave, {name: record}, ["n0", "n1"], here, keep)
    if rank == 0:  # the holder: its copy of the first range is damaged, so it refused that one
        assert list(outcome.refused) == [0] and "ChecksumMismatchError" in outcome.refused[0]
        assert outcome.damaged == {} and outcome.fatal is None
    else:  # the receiver: the second failed its check, the third could not be kept
        assert outcome.refused == {} and list(outcome.damaged) == [1]
        assert outcome.fatal is not None and "cannot keep what came of" in outcome.fatal


def test_a_wave_returns_what_failed_on_each_rank(saved, tmp_path):
    """A wave hands back what failed on its rank (``streams.WaveOutcome``): the transfers the
    holder refused, those that failed their check on arrival, and a failure to keep what came."""
    from dcp_nvme_harness.dist_utils import run_ranks

    path, name = saved
    dirs = []
    for rank in range(2):
        copy = tmp_path / f"node{rank}"
        shutil.copytree(path, copy)
        dirs.append(str(copy))
    os.remove(os.path.join(dirs[1], name))
    manifest = read_manifest(LocalStore(path), path)
    record = read_files(LocalStore(path), manifest, path)[name]
    with open(os.path.join(dirs[0], name), "r+b") as f:
        at = record.data_start + 2 * record.checksum_block + 100
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
    run_ranks(2, _wave_rank, dirs, name)


class _Mirror:
    """A mirror that serves one file's bytes, with one range of them flipped."""

    def __init__(self, name: str, data: bytes, bad_at: int) -> None:
        self.name, self.data, self.bad_at, self.reads = name, bytearray(data), bad_at, 0
        self.data[bad_at] ^= 0xFF

    def describe(self, name: str = "") -> str:
        return f"mem://mirror/{name}"

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        self.reads += 1
        return bytes(self.data[offset:offset + length])

    def read_into(self, name: str, offset: int, into: memoryview) -> None:
        into[:] = self.read_range(name, offset, len(into))


def _without_its_file(saved, tmp_path):
    """A copy of the saved checkpoint whose data file is gone (only the mirror has it): the copy's
    directory, the file's name, the manifest, the file's record and its bytes."""
    path, name = saved
    node = str(tmp_path / "node")
    shutil.copytree(path, node)
    manifest = read_manifest(LocalStore(node), node)
    record = read_files(LocalStore(node), manifest, node)[name]
    with open(os.path.join(node, name), "rb") as f:
        data = f.read()
    os.remove(os.path.join(node, name))
    return node, name, manifest, record, data


@pytest.mark.parametrize("optional", [False, True])
def test_mirror_reads_move_as_a_window_and_stop_at_a_damaged_range(saved, tmp_path, monkeypatch, optional):
    """What no node holds comes from the mirror in ranged reads, a bounded window ahead of what
    is kept; a range that fails its check stops the load (naming it), or is left out when the
    asks are optional, and every range before it is kept."""
    node, name, manifest, record, data = _without_its_file(saved, tmp_path)
    block = record.checksum_block
    spans = [Span(name, 0, record.data_start + block)]
    spans += [Span(name, at, min(at + block, record.size))
              for at in range(record.data_start + block, record.size, block)]
    assert len(spans) >= 4
    monkeypatch.setattr(mirror_reads, "WAVE_BYTES", 2 * block + record.data_start)  # two spans ahead at most
    monkeypatch.setattr(mirror_reads, "MIRROR_RANGE", block // 4)
    bad = 2  # the third span's bytes are damaged on the mirror
    mirror = _Mirror(name, data, spans[bad].start + 10)
    out = exchange.Arrivals(node, ReceivedBytes(1 << 30))
    out.chosen = [9] * len(spans)
    why, got = mirror_reads.from_mirror(manifest, {name: record}, list(enumerate(spans)), mirror,
                                         optional, out)
    if optional:
        assert why is None and got == spans[:bad] + spans[bad + 1:]
        assert out.chosen == [0] * bad + [9] + [0] * (len(spans) - bad - 1)
    else:
        assert why is not None and "ChecksumMismatchError" in why and "mem://mirror/" + name in why
        assert got == spans[:bad]
        assert mirror.reads < sum(-(-s.length // (block // 4)) for s in spans)  # the rest was never read
    assert out.taken["mirror"]["seconds"] > 0, out.taken  # measured: last_stats["sources"]["mirror"]
    for span in got:  # what came is kept at its own offsets, and held
        with open(os.path.join(node, RANGES_DIR, name), "rb") as f:
            f.seek(span.start)
            assert f.read(span.length) == data[span.start:span.end]
        held = out.hold.take(name, span.start, span.length) or []
        assert b"".join(bytes(v) for v in held) == data[span.start:span.end]


def test_a_manifest_written_in_place_is_logged_as_a_sentence(saved, tmp_path, caplog):
    """The restore's line for a manifest that came from elsewhere says what happened, in words,
    whether this node had none or one that could not be used."""
    path, _ = saved
    node = str(tmp_path / "node")
    shutil.copytree(path, node)
    key = read_manifest(LocalStore(node), node).save_key
    payload = exchange._metadata_payload(LocalStore(path))
    os.remove(os.path.join(node, MANIFEST))
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.peers.exchange"):
        exchange._keep_metadata(node, payload, key, "b", f"CheckpointNotFoundError: {node} has no manifest.json")
    assert f"{node}: this node held no manifest of the step, so the one from node b was written in its place" \
        in caplog.text
    assert "CheckpointNotFoundError" not in caplog.text and read_manifest(LocalStore(node), node).save_key == key
    os.remove(os.path.join(node, MANIFEST))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.peers.exchange"):
        exchange._keep_metadata(node, payload, key, "s3://bucket/run/step_1", "ManifestError: bad JSON")
    assert (f"{node}: this node's manifest could not be used (ManifestError: bad JSON), so the one from "
            "s3://bucket/run/step_1 was written in its place") in caplog.text


@pytest.mark.parametrize("optional", [False, True])
def test_a_span_from_the_mirror_is_kept_piece_by_piece(saved, tmp_path, monkeypatch, optional):
    """One span of many checksum blocks: each piece is checked and kept as it comes (the link
    is not idle while the whole span is checked and written); a damaged piece stops the load,
    or leaves the rest of the span out when the ask is optional; the pieces before it are kept."""
    node, name, manifest, record, data = _without_its_file(saved, tmp_path)
    block = record.checksum_block
    monkeypatch.setattr(mirror_reads, "KEEP_PIECE", 2 * block + 1)  # two whole blocks a piece
    whole = Span(name, 0, record.size)
    pieces = mirror_reads.keep_pieces(record, whole)
    assert len(pieces) >= 3 and pieces[0].start == 0 and pieces[-1].end == record.size
    assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
    assert all((p.start - record.data_start) % (2 * block) == 0 for p in pieces[1:])
    inner = Span(name, record.data_start + block, record.data_start + 4 * block)  # starts mid-piece
    assert mirror_reads.keep_pieces(record, inner) == [Span(name, inner.start, record.data_start + 2 * block),
                                                   Span(name, record.data_start + 2 * block, inner.end)]
    bad = pieces[1].start + 10
    mirror = _Mirror(name, data, bad)
    out = exchange.Arrivals(node, ReceivedBytes(1 << 30))
    out.chosen = [9]
    why, got = mirror_reads.from_mirror(manifest, {name: record}, [(0, whole)], mirror, optional, out)
    assert got == [] and out.chosen == [9]
    if optional:
        assert why is None
    else:
        assert why is not None and "ChecksumMismatchError" in why
    # the piece before the damaged one is on disk; none after it (the ask is left out whole)
    assert out.taken["mirror"]["bytes"] == pieces[0].length
    with open(os.path.join(node, exchange.RANGES_DIR, name), "rb") as f:
        assert f.read(pieces[0].end) == data[:pieces[0].end]


def test_a_span_larger_than_the_window_is_read_at_most_a_window_ahead(saved, tmp_path, monkeypatch):
    """The mirror's read-ahead bound (``WAVE_BYTES``) holds for one span larger than it: a whole
    rank file asked at once was read into memory whole before any of it was kept."""
    node, name, manifest, record, data = _without_its_file(saved, tmp_path)
    block = record.checksum_block
    assert record.size > 6 * block
    monkeypatch.setattr(mirror_reads, "KEEP_PIECE", block)
    monkeypatch.setattr(mirror_reads, "WAVE_BYTES", 2 * block)
    out = exchange.Arrivals(node, ReceivedBytes(1 << 30))
    out.chosen = [9]
    kept_to, ahead = [0], [0]
    keep = out.keep

    def counted_keep(rec, start, view, kind):
        keep(rec, start, view, kind)
        kept_to[0] = max(kept_to[0], start + len(view))

    class Counting(_Mirror):
        def read_into(self, name, offset, into):
            ahead[0] = max(ahead[0], offset + len(into) - kept_to[0])
            super().read_into(name, offset, into)

    monkeypatch.setattr(out, "keep", counted_keep)
    mirror = Counting(name, data, len(data) - 1)
    mirror.data[len(data) - 1] ^= 0xFF  # the byte _Mirror flipped, flipped back: nothing damaged
    why, got = mirror_reads.from_mirror(manifest, {name: record}, [(0, Span(name, 0, record.size))],
                                         mirror, False, out)
    assert why is None and got == [Span(name, 0, record.size)] and out.chosen == [0]
    assert ahead[0] <= 2 * block + record.data_start + block, (ahead[0], record.size)


def test_without_a_mirror_what_no_node_holds_is_named_unless_optional(saved, tmp_path):
    """A range no node holds and no mirror to read it from: the load's error names the file, its
    bytes, the node that wrote them and what to do; optional asks are left out without one."""
    node, name, manifest, record, _ = _without_its_file(saved, tmp_path)
    spans = [Span(name, 0, record.data_start), Span(name, record.data_start, record.size)]
    out = exchange.Arrivals(node, ReceivedBytes(1 << 30))
    out.chosen = [9, 9]
    why, got = mirror_reads.from_mirror(manifest, {name: record}, list(enumerate(spans)), None, False, out)
    assert why is not None and why.startswith("CheckpointNotFoundError: ")
    assert f"{name} bytes [0, {record.data_start})" in why and "NVMeReader(mirror=...)" in why
    assert f"written on node {manifest.node_of(record.rank)}" in why and got == [] and out.chosen == [9, 9]
    assert mirror_reads.from_mirror(manifest, {name: record}, list(enumerate(spans)), None, True, out) == (None, [])
