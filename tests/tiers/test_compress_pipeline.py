"""The compressed drain's pipeline (coding while sending, bounded) and the compressed mirror's
batched load (each chunk fetched and decoded once per read call)."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_compress import (
    FAST,
    assert_same,
    blank_like,
    delta_chain,
    load,
    make_state,
    mirror_doc,
    save,
)
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeReader
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.tiers import MIRRORED, DrainError, DrainOptions, codec, compress, drain, drain_state
from dcp_nvme.tiers import coded as coded_mod
from dcp_nvme.tiers.drainer import set_drain_hook
from dcp_nvme.tiers.sinks import LocalSink
from dcp_nvme.tiers.source import DrainSource

MiB = 1 << 20
SMALL = dict(part_size=1 * MiB, retries=0, backoff=0.01, max_transfers=2, compress="bytegroup")


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of 1 MiB: a few-MB checkpoint codes in several windows."""
    monkeypatch.setattr(compress, "WINDOW", 1 * MiB)


@pytest.fixture
def encoders(monkeypatch):
    """Every Encoder the drain makes, to read its counters after."""
    made = []

    class Counted(compress.Encoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(compress, "Encoder", Counted)
    return made


@pytest.fixture
def gated_coder(monkeypatch):
    """A coder that starts once the drain has opened a streamed transfer and, from its 5th
    window on, waits for the first piece to be sent: the file is certainly sent while it is
    coded, whatever the speeds (events, not timing; a wait that times out fails the drain)."""
    opened, sent = threading.Event(), threading.Event()
    windows, begin, put = compress.CompressedSource._windows, LocalSink.begin, LocalSink.put_piece

    def gated(self, coding, base_record):
        for index, window in enumerate(windows(self, coding, base_record)):
            assert opened.wait(30), "no streamed transfer opened while the file is coded"
            if index >= 4:
                assert sent.wait(30), "no piece sent while the file is coded"
            yield window

    def opening(self, name, record, entry, resuming):
        begin(self, name, record, entry, resuming)
        opened.set()

    def putting(self, name, piece, data, entry, record=None):
        tag = put(self, name, piece, data, entry, record)
        sent.set()
        return tag

    monkeypatch.setattr(compress.CompressedSource, "_windows", gated)
    monkeypatch.setattr(LocalSink, "begin", opening)
    monkeypatch.setattr(LocalSink, "put_piece", putting)
    return sent


def _sent_order(monkeypatch):
    """Filled after the drain: (piece index, whether it was handed out before its file was
    coded, i.e. with a partial record) of every streamed piece, in order."""
    seen: list[tuple[int, object, object, str]] = []
    stream = compress.CompressedSource.stream

    def watched(self, name, part_size):
        for record, piece in stream(self, name, part_size):
            seen.append((piece.index, record, self, name))
            yield record, piece

    monkeypatch.setattr(compress.CompressedSource, "stream", watched)
    order: list[tuple[int, bool]] = []

    def resolve() -> list[tuple[int, bool]]:
        order[:] = [(i, record is not source.record(name)) for i, record, source, name in seen]
        return order

    return resolve


def test_pieces_are_sent_while_the_file_is_coded_header_piece_last(tmp_path, monkeypatch, small_windows,
                                                                   gated_coder, encoders):
    sd = make_state(21)
    local = save(tmp_path / "step_21", sd)
    target = str(tmp_path / "mirror")
    resolve = _sent_order(monkeypatch)
    result = drain(local, target, options=DrainOptions(**SMALL))
    order = resolve()
    early = [index for index, partial in order if partial]
    assert early and early[0] >= 1 and order[0][0] == early[0]  # sent while coding; not the header's
    assert 0 not in early and 0 in dict(order)  # the header's piece: once the file was coded
    stored = mirror_doc(target)["compression"]["stored_bytes"]
    assert result.bytes_sent == stored and result.compression["ratio"] > 1.05
    assert drain_state(local).state == MIRRORED
    assert_same(load(NVMeReader(target, block_size="512KiB"), sd), sd)
    # the bound: the coder held at most DEPTH windows' bytes at once, and did pipeline
    source = DrainSource(local)
    windows = sum(len(compress.plan_file(source.files[n], source.manifest, 1 * MiB))
                  for n in source.manifest.file_names)
    assert windows > compress.DEPTH
    assert [e.peak for e in encoders] == [compress.DEPTH] and encoders[0].alive == 0


def test_code_windows_holds_at_most_depth_windows():
    data = bytes(range(256)) * 4096  # 1 MiB
    chunks = codec.plan_chunks(len(data), [], 64 << 10)
    windows = [(data[i: i + 256 << 10], [c for c in chunks if i <= c.offset < i + (256 << 10)], i, None)
               for i in range(0, len(data), 256 << 10)]
    encoder = compress.Encoder(2, 3)
    seen = []
    try:
        for coded in encoder.code_windows(windows, depth=3):
            seen.append(encoder.alive)
            assert encoder.alive <= 3
            assert len(coded) == 4
        assert encoder.peak == 3 and encoder.alive == 0 and len(seen) == 4
        direct = codec.encode_chunks(data, chunks, threads=1)
        again = [c for coded in encoder.code_windows(windows, depth=1) for c in coded]
        assert again == direct and encoder.peak == 3  # depth 1 never held more than one
    finally:
        encoder.close()


def test_a_coder_failure_mid_drain_marks_nothing_mirrored_and_the_next_drain_completes(
        tmp_path, monkeypatch, small_windows, gated_coder):
    sd = make_state(23)
    local = save(tmp_path / "step_23", sd)
    target = str(tmp_path / "mirror")
    calls = Counter()
    real = codec.encode_chunk

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise MemoryError("coder ran out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_chunk", failing)
    with pytest.raises(DrainError, match="coder ran out of memory"):
        drain(local, target, options=DrainOptions(**SMALL))
    assert drain_state(local).state != MIRRORED
    assert not os.path.exists(os.path.join(target, MANIFEST))
    monkeypatch.setattr(codec, "encode_chunk", real)
    again = drain(local, target, options=DrainOptions(**SMALL))
    assert drain_state(local).state == MIRRORED and again.compression["ratio"] > 1.05
    assert not [n for n in os.listdir(local) if n.startswith(".drain-zip")]
    assert_same(load(NVMeReader(target), sd), sd)


def test_a_retried_coder_failure_codes_again_within_one_drain(tmp_path, monkeypatch, small_windows):
    sd = make_state(25)
    local = save(tmp_path / "step_25", sd)
    target = str(tmp_path / "mirror")
    real, failed = codec.encode_chunk, []

    def once(*args, **kwargs):
        if not failed:
            failed.append(1)
            raise OSError("transient")
        return real(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_chunk", once)
    result = drain(local, target, options=DrainOptions(**{**SMALL, "retries": 1}))
    assert result.attempts == 2 and "transient" in result.errors[0]
    assert_same(load(NVMeReader(target), sd), sd)


def test_a_sink_failure_mid_stream_resumes_from_the_confirmed_pieces(tmp_path, monkeypatch, small_windows,
                                                                     gated_coder):
    sd = make_state(27)
    local = save(tmp_path / "step_27", sd)
    target = str(tmp_path / "mirror")
    sent = []

    def drop_second(point, info):
        if point == "piece-journaled":
            sent.append(info["piece"])
            if len(sent) == 2:
                raise ConnectionError("link dropped")

    previous = set_drain_hook(drop_second)
    try:
        with pytest.raises(DrainError, match="link dropped"):
            drain(local, target, options=DrainOptions(**{**SMALL, "max_transfers": 1}))
    finally:
        set_drain_hook(previous)
    assert all(p.index >= 1 for p in sent)  # streamed: the header's piece was not sent yet
    assert drain_state(local).state != MIRRORED and not os.path.exists(os.path.join(target, MANIFEST))
    again = drain(local, target, options=DrainOptions(**SMALL))
    assert again.bytes_skipped == sum(p.length for p in sent)  # re-coded identically, confirmed
    assert drain_state(local).state == MIRRORED
    assert_same(load(NVMeReader(target), sd), sd)


# -- the batched load


def _count_io(monkeypatch) -> tuple[Counter, Counter]:
    """(stored bytes fetched per file, decodes per (chunk offset, length)) of the mirror's reads."""
    fetched, decoded = Counter(), Counter()
    store_fetch, decode_chunk = coded_mod.store_fetch, codec.decode_chunk

    def counting_fetch(store):
        fetch = store_fetch(store)

        def counted(name, start, end):
            fetched[name] += end - start
            return fetch(name, start, end)

        return counted

    def counting_decode(entry, stored, base=None):
        decoded[(entry.offset, entry.length)] += 1
        return decode_chunk(entry, stored, base)

    monkeypatch.setattr(coded_mod, "store_fetch", counting_fetch)
    monkeypatch.setattr(codec, "decode_chunk", counting_decode)
    return fetched, decoded


def _bytegroup_mirror(tmp_path, seed: int) -> tuple[dict, str]:
    """A state saved locally and drained, byte-grouped, to a directory mirror."""
    sd = make_state(seed)
    target = str(tmp_path / "mirror")
    drain(save(tmp_path / f"step_{seed}", sd), target, options=DrainOptions(**FAST, compress="bytegroup"))
    return sd, target


def test_small_requests_fetch_and_decode_each_chunk_once(tmp_path, monkeypatch):
    sd, target = _bytegroup_mirror(tmp_path, 29)
    fetched, decoded = _count_io(monkeypatch)
    reader = NVMeReader(target, block_size="256KiB", queue_depth=3)  # 8 requests per 2 MiB chunk
    assert_same(load(reader, sd), sd)
    assert reader.last_stats["requests"] > len(decoded)
    checks = {k for k, n in decoded.items() if n > 1}  # the header's chunk: checked before the load
    assert len(checks) <= 1
    stored = mirror_doc(target)["compression"]["files"]
    (info,) = stored.values()
    assert sum(fetched.values()) <= info["stored_size"] + 2 * codec.DEFAULT_CHUNK  # not 8x
    # the load's decoding is counted apart from its I/O: every chunk it decoded, once
    assert reader.last_stats["decoded_bytes"] == sum(length for _, length in decoded)
    assert reader.last_stats["decode_cpu_seconds"] > 0 and reader.last_stats["decode_MBps_per_core"] > 0


def test_a_plain_load_reports_no_decoding(tmp_path):
    sd = make_state(30)
    reader = NVMeReader(save(tmp_path / "plain", sd))
    assert_same(load(reader, sd), sd)
    assert reader.last_stats["bytes"] > 0 and "decoded_bytes" not in reader.last_stats


def _load_rows(rank: int, world: int, mirror: str, expected: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {"adam_fp32": distribute_tensor(torch.zeros_like(expected["adam_fp32"]), mesh, [Shard(0)]),
           "w_bf16": distribute_tensor(torch.zeros_like(expected["w_bf16"]), mesh, [Shard(0)])}
    dcp.load(out, storage_reader=NVMeReader(mirror, block_size="128KiB", queue_depth=4))
    for key in out:
        mine = out[key].to_local()
        rows = expected[key].shape[0]
        per = -(-rows // world)
        want = expected[key][rank * per: min(rows, (rank + 1) * per)]
        assert torch.equal(mine.view(torch.uint8), want.contiguous().view(torch.uint8)), key


def test_resharded_ranged_loads_of_the_batched_path_are_bitwise(tmp_path):
    from dcp_nvme_harness.dist_utils import run_ranks

    sd, target = _bytegroup_mirror(tmp_path, 31)
    run_ranks(3, _load_rows, target, {k: sd[k] for k in ("w_bf16", "adam_fp32")})


def test_one_item_loads_only_its_chunks(tmp_path, monkeypatch):
    sd, target = _bytegroup_mirror(tmp_path, 33)
    fetched, _ = _count_io(monkeypatch)
    out = {"fp16": torch.zeros_like(sd["fp16"])}
    dcp.load(out, storage_reader=NVMeReader(target, block_size="64KiB"), no_dist=True)
    assert torch.equal(out["fp16"].view(torch.uint8), sd["fp16"].view(torch.uint8))
    (info,) = mirror_doc(target)["compression"]["files"].values()
    assert sum(fetched.values()) < info["stored_size"] / 2


def test_a_corrupt_chunk_is_named_by_the_batched_path(tmp_path):
    sd, target = _bytegroup_mirror(tmp_path, 35)
    path = os.path.join(target, next(n for n in os.listdir(target) if n.endswith(".dcz")))
    blob = bytearray(open(path, "rb").read())
    _, count, size, crc = codec.parse_header(blob)
    entries = codec.parse_table(blob[codec.HEADER_SIZE: codec.HEADER_SIZE + count * codec.ENTRY_SIZE],
                                count, size, crc, len(blob))
    victim = entries[len(entries) // 2]
    blob[victim.stored_offset + victim.stored_length - 1] ^= 0x01
    open(path, "wb").write(blob)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(blank_like(sd), storage_reader=NVMeReader(target, block_size="256KiB", queue_depth=4),
                 no_dist=True)
    error = caught.value.failures[0]
    error = error[0] if isinstance(error, tuple) else error
    assert isinstance(error, codec.CodecError)
    assert os.path.basename(path) in str(error) and f"bytes {victim.offset}-{victim.end}" in str(error)


# -- the batched load of a delta chain


def _big_state(seed: int) -> dict:
    """24 MiB in one rank file: a dozen 2 MiB chunks, keys as ``_step`` updates them."""
    g = torch.Generator().manual_seed(seed)
    return {"w_bf16": (torch.randn(2048, 3072, generator=g) * 0.02).to(torch.bfloat16),
            "adam_fp32": torch.randn(3 * MiB + 1, generator=g) * 1e-3,
            "meta": {"step": seed, "note": "compressed"}}


def _count_fetches(monkeypatch) -> Counter:
    """Ranged reads of chunk data (not header or table) per (mirror location, stored name),
    the delta's bases included (their stores are made by the same ``store_fetch``)."""
    reads: Counter = Counter()
    store_fetch = coded_mod.store_fetch

    def counting_fetch(store):
        fetch = store_fetch(store)

        def counted(name, start, end):
            if start > codec.HEADER_SIZE:
                reads[(store.location, name)] += 1
            return fetch(name, start, end)

        return counted

    monkeypatch.setattr(coded_mod, "store_fetch", counting_fetch)
    return reads


@pytest.fixture(scope="module")
def chain_of_two_bases(tmp_path_factory):
    """pfs/step_3 is a delta against pfs/step_2, itself a delta against the full pfs/step_1;
    each saved from fresh tensors, placed at other offsets than in its base."""
    tmp_path = tmp_path_factory.mktemp("chain")
    states, _ = delta_chain(tmp_path, _big_state(41), 3, 41, realloc=True)
    docs = [mirror_doc(tmp_path / "pfs" / f"step_{i}")["compression"] for i in (1, 2, 3)]
    assert "delta" not in docs[0] and docs[1]["delta"]["depth"] == 1 and docs[2]["delta"]["depth"] == 2
    return tmp_path / "pfs", states


@pytest.mark.parametrize("fetch", [coded_mod.FETCH, 3 * MiB])
def test_a_delta_load_reads_its_bases_in_batched_runs_each_chunk_decoded_once(chain_of_two_bases,
                                                                             monkeypatch, fetch):
    pfs, states = chain_of_two_bases
    monkeypatch.setattr(coded_mod, "FETCH", fetch)  # 3 MiB: several runs per file, and per base read
    monkeypatch.setattr(coded_mod, "RUN_DECODED", 2 * fetch)
    reads = _count_fetches(monkeypatch)
    reader = NVMeReader(str(pfs / "step_3"), block_size="1MiB", queue_depth=4)
    assert_same(load(reader, states[2]), states[2])
    (size,) = [info["size"] for info in mirror_doc(pfs / "step_3")["compression"]["files"].values()]
    assert size > 10 * codec.DEFAULT_CHUNK
    # every chunk of the file and the bases' chunks under its items must be decoded for a bitwise
    # load (a base's header is not: headers are coded full): this many decoded bytes means each
    # was decoded once (not once per request or per reader)
    items = sum(t.nbytes for t in states[2].values() if isinstance(t, torch.Tensor))
    assert size + 2 * items <= reader.last_stats["decoded_bytes"] <= size * 3
    runs = -(-size // (2 * fetch))  # the delta's runs, bounded by their decoded bytes
    for step in (1, 2):
        files = mirror_doc(pfs / f"step_{step}")["compression"]["files"]
        (stored,) = [info["stored_size"] for info in files.values()]
        of_base = sum(n for (where, _), n in reads.items() if where == str(pfs / f"step_{step}"))
        # a read per run of the delta (each split by the base's own stored bound), and one for
        # the header's chunk, read before the load; one read per 2 MiB chunk would be 12 or more
        assert 1 <= of_base <= runs + -(-stored // fetch) + 1, (step, of_base, reads)


def test_resharded_ranged_loads_of_a_delta_chain_are_bitwise(chain_of_two_bases):
    from dcp_nvme_harness.dist_utils import run_ranks
    from test_compress import _load_columns

    pfs, states = chain_of_two_bases  # the weights' columns, the moments' rows
    run_ranks(3, _load_columns, str(pfs / "step_3"), {k: states[2][k] for k in ("w_bf16", "adam_fp32")})


def test_one_item_of_a_delta_decodes_only_its_part_of_the_chain(chain_of_two_bases, monkeypatch):
    pfs, states = chain_of_two_bases
    reads = _count_fetches(monkeypatch)
    out = {"adam_fp32": torch.zeros_like(states[2]["adam_fp32"])}
    reader = NVMeReader(str(pfs / "step_3"), block_size="256KiB")
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["adam_fp32"], states[2]["adam_fp32"])
    (size,) = [info["size"] for info in mirror_doc(pfs / "step_3")["compression"]["files"].values()]
    # its chunks and the bases' under them (a chunk may straddle into the next tensor), not all
    assert 3 * out["adam_fp32"].nbytes <= reader.last_stats["decoded_bytes"] < 3 * size * 0.75
    assert {where for where, _ in reads} == {str(pfs / f"step_{i}") for i in (1, 2, 3)}
    assert all(n <= 2 for n in reads.values()), reads  # one run each, and the header's chunk


def test_a_delta_on_s3_reads_its_base_in_one_ranged_get_per_run(tmp_path, seaweed, seaweed_bucket, seaweed_fs,
                                                                 monkeypatch):
    mirror = f"s3://{seaweed_bucket}/pfs"
    states, _ = delta_chain(tmp_path, make_state(43), 2, 43, mirror=mirror, filesystem=seaweed_fs)
    assert mirror_doc_s3(seaweed_fs, f"{mirror}/step_2")["compression"]["delta"]["base"] == f"{mirror}/step_1"
    reads = _count_fetches(monkeypatch)
    reader = NVMeReader(f"{mirror}/step_2", storage_options=seaweed.storage_options(retries=1),
                        block_size="256KiB")
    assert_same(load(reader, states[1]), states[1])
    (entry,) = mirror_doc_s3(seaweed_fs, f"{mirror}/step_1")["compression"]["files"].values()
    of_base = sum(n for (where, _), n in reads.items() if where == f"{mirror}/step_1")
    assert entry["size"] > 2 * codec.DEFAULT_CHUNK  # several chunks: one GET each before
    assert 1 <= of_base <= 2, reads  # the load's one run, and the header's chunk read before it
    assert 1.9 * entry["size"] < reader.last_stats["decoded_bytes"] < 2 * entry["size"]  # the base under the items


def mirror_doc_s3(fs, url: str) -> dict:
    return json.loads(fs.cat_file(f"{url}/{MANIFEST}"))


def test_a_base_cursor_hands_out_ranges_across_pieces_and_refuses_a_short_base():
    cursor = coded_mod._Cursor(iter([(0, b"abc"), (3, b"defg")]), "base.safetensors")
    assert bytes(cursor.take(1, 2)) == b"b" and isinstance(cursor.take(1, 3), memoryview)  # one piece: a view
    assert bytes(cursor.take(2, 5)) == b"cde" and bytes(cursor.take(5, 7)) == b"fg"  # joined across pieces
    with pytest.raises(codec.CodecError, match="base file base.safetensors ends at 7, before 9"):
        cursor.take(6, 9)
