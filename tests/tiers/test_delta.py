"""Deltas per item: a state of fresh tensors (placed at other offsets than its base's) codes as
small as one updated in place; what is coded full is said, per item, with the reason; the
version 1 container (deltas at their own offsets) still loads."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_compress import (
    FAST,
    _dcz,
    _step,
    assert_same,
    delta_chain,
    load,
    make_state,
    mirror_doc,
    relocated,
    save,
)
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeReader
from dcp_nvme.cli import main as cli_main
from dcp_nvme.format.manifest import read_manifest, seal
from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.tiers import DrainOptions, codec, drain, drain_state
from dcp_nvme.tiers.coded import describe_compression
from dcp_nvme.tiers.delta_match import assign_bases, index_base, match_file


def _offsets(local) -> dict[str, int]:
    manifest = read_manifest(LocalStore(str(local)), str(local))
    return {c.fqn: c.byte_offset for c in manifest.chunks}


def _stored(target) -> int:
    return mirror_doc(target)["compression"]["stored_bytes"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same three states saved twice: from tensors updated in place, and from fresh tensors
    at other addresses at every save; the third state adds a key and changes a shape and a dtype."""
    root = tmp_path_factory.mktemp("items")
    first = make_state(51)
    second = _step(first, 52)
    third = dict(_step(second, 53))
    third["new_key"] = torch.arange(20_000, dtype=torch.float32)
    third["fp64"] = torch.cat([third["fp64"], third["fp64"][:1]])  # another shape
    third["i64"] = third["i64"].to(torch.int32)  # another dtype
    states = [first, second, third]
    out = {}
    for kind, saved in (("inplace", states[:2]), ("realloc", states)):  # new shapes: fresh tensors
        _, results = delta_chain(root / kind, None, len(saved), 51, every=8, realloc=kind == "realloc",
                                 states=saved)
        out[kind] = (root / kind, results)
    return states, out


def test_a_reallocated_state_codes_as_small_as_an_in_place_one(runs, capsys):
    states, out = runs
    inplace, realloc = out["inplace"][0], out["realloc"][0]
    moved = [k for k, at in _offsets(realloc / "run" / "step_2").items()
             if at != _offsets(realloc / "run" / "step_1")[k]]
    assert len(moved) >= 5  # the fresh tensors really sit elsewhere in the container than in the base
    assert _offsets(inplace / "run" / "step_2") == _offsets(inplace / "run" / "step_1")
    full, by_place, by_alloc = (_stored(inplace / "pfs" / "step_1"), _stored(inplace / "pfs" / "step_2"),
                                _stored(realloc / "pfs" / "step_2"))
    assert by_place < 0.8 * full  # a delta at all (this state's small update codes well)
    assert abs(by_alloc - by_place) <= 0.05 * by_place, (by_alloc, by_place, full)
    delta = out["realloc"][1][1].compression["delta"]
    assert delta["fraction"] == 1.0 and delta["full_items"] == 0 and delta["delta_bytes"] > 5 << 20
    assert delta["against"] == str(realloc / "pfs" / "step_1")
    assert_same(load(NVMeReader(str(realloc / "pfs" / "step_2"), block_size="512KiB"), states[1]), states[1])
    # how much is delta-coded: the drain state, status and inspect say it
    state = drain_state(realloc / "run" / "step_2")
    assert state.delta["fraction"] == 1.0 and state.delta["against"] == delta["against"]
    assert cli_main(["status", str(realloc / "run")]) == 0
    printed = capsys.readouterr().out
    assert f"100.0% delta-coded against {delta['against']}" in printed
    assert "coded full: no earlier mirrored checkpoint" in printed  # step_1, the chain's start
    line = describe_compression(str(realloc / "pfs" / "step_2"))
    assert "100.0% of the items' bytes delta-coded" in line and "chain depth 1" in line


def test_new_and_changed_items_are_coded_full_each_named_and_the_chain_loads(runs, caplog):
    states, out = runs
    realloc, results = out["realloc"]
    delta = results[2].compression["delta"]
    reasons = {f["item"]: f["reason"] for f in delta["full"]}
    assert reasons == {"new_key": "new since the base",
                       "fp64": "shape [999] in the base, [1000] here",
                       "i64": "dtype int64 in the base, int32 here"}
    assert delta["full_items"] == 3 and 0.9 < delta["fraction"] < 1.0
    assert delta["delta_bytes"] + sum(f["bytes"] for f in delta["full"]) == delta["item_bytes"]
    section = mirror_doc(realloc / "pfs" / "step_3")["compression"]["delta"]
    assert section["depth"] == 2 and section["fraction"] == delta["fraction"]
    # step_3 reads step_2 at other offsets, which reads step_1 at others again
    assert_same(load(NVMeReader(str(realloc / "pfs" / "step_3"), block_size="256KiB"), states[2]), states[2])
    # a replaced base is refused naming it
    base = realloc / "pfs" / "step_1"
    doc = mirror_doc(base)
    saved = json.dumps(doc)
    doc["save_key"] = "0" * len(doc["save_key"])
    (base / "manifest.json").write_bytes(seal({k: v for k, v in doc.items() if k != "manifest_crc32c"}))
    try:
        with pytest.raises(CheckpointException) as caught:
            load(NVMeReader(str(realloc / "pfs" / "step_3")), states[2])
        error = caught.value.failures[0]
        error = error[0] if isinstance(error, tuple) else error
        assert isinstance(error, codec.CodecError) and f"against {base}" in str(error)
        assert "now holds save" in str(error)
    finally:
        (base / "manifest.json").write_text(saved)
    # the log says it too: a drain of a new step whose items all changed dtype
    fourth = {k: v.double() if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v
              for k, v in states[2].items()}
    with caplog.at_level(logging.INFO, logger="dcp_nvme"):
        local = save(realloc / "run" / "step_4", {k: relocated(v, 128) if isinstance(v, torch.Tensor) else v
                                                  for k, v in fourth.items()})
        drain(local, str(realloc / "pfs" / "step_4"), options=DrainOptions(**FAST, compress="delta"))
    said = "\n".join(r.getMessage() for r in caplog.records if "compress=delta" in r.getMessage())
    assert "run/step_4" in said and "adam_fp32 (dtype float32 in the base, float64 here)" in said


def test_a_version_1_delta_container_still_loads(runs, tmp_path):
    """A mirror written before version 2 (deltas at their own offsets, 30-byte table rows)."""
    states, out = runs
    src = out["inplace"][0] / "pfs"
    import shutil

    shutil.copytree(src, tmp_path / "pfs")
    target = tmp_path / "pfs" / "step_2"
    doc = mirror_doc(target)
    doc["compression"]["delta"]["base"] = str(tmp_path / "pfs" / "step_1")
    path = _dcz(str(target))
    blob = open(path, "rb").read()
    head = codec.read_header(blob)
    entries = codec.parse_table(blob[codec.HEADER_SIZE: codec.HEADER_SIZE + head.table_size], head.count,
                                head.size, head.table_crc, len(blob))
    assert any(e.flags & codec.DELTA for e in entries) and all(
        e.base_offset == e.offset for e in entries if e.flags & codec.DELTA)  # in place: v1 can hold it
    shift = head.table_size - head.count * codec.entry_size(1)
    old = [codec.Entry(e.offset, e.length, e.stored_offset - shift, e.stored_length, e.crc, e.planes, e.flags,
                       e.base_offset) for e in entries]
    body = blob[codec.HEADER_SIZE + head.table_size:]
    open(path, "wb").write(codec.pack_header(old, head.size, version=1) + body)
    assert codec.read_header(open(path, "rb").read()).version == 1
    doc["compression"]["version"] = 1
    (info,) = doc["compression"]["files"].values()
    info["stored_size"] -= shift
    (target / "manifest.json").write_bytes(seal({k: v for k, v in doc.items() if k != "manifest_crc32c"}))
    assert_same(load(NVMeReader(str(target), block_size="1MiB"), states[1]), states[1])
    # a reallocated delta cannot be written as version 1
    realloc = out["realloc"][0] / "pfs" / "step_2"
    blob = open(_dcz(str(realloc)), "rb").read()
    head = codec.read_header(blob)
    moved = codec.parse_table(blob[codec.HEADER_SIZE: codec.HEADER_SIZE + head.table_size], head.count,
                              head.size, head.table_crc, len(blob))
    with pytest.raises(ValueError, match="version 1 table cannot hold"):
        codec.pack_header(moved, head.size, version=1)


def _chunk(fqn, offset, length, *, dtype="float32", shape=(8,), offsets=(0,), sizes=(8,), kind="tensor",
           file="rank_00000.k.safetensors"):
    return ChunkRecord(fqn, kind, offsets, sizes, shape, dtype, file, offset, length, "k")


def test_match_file_pairs_items_wherever_they_sit_and_names_the_rest():
    here = FileRecord("rank_00000.n.safetensors", 0, 9000, 512, 512, 0, ())
    base_files = {"rank_00000.k.safetensors": FileRecord("rank_00000.k.safetensors", 0, 9000, 512, 512, 0, ()),
                  "rank_00001.k.safetensors": FileRecord("rank_00001.k.safetensors", 1, 9000, 512, 512, 0, ())}
    base = [_chunk("a", 4096, 32), _chunk("b", 1024, 32), _chunk("c", 2048, 32),
            _chunk("w", 512, 32, offsets=(0,), sizes=(8,), shape=(16,)),
            _chunk("d", 600, 32, file="rank_00001.k.safetensors"), _chunk("obj", 700, 9, kind="bytes", dtype="",
                                                                         shape=(), offsets=(), sizes=())]
    mine = [_chunk("b", 512, 32), _chunk("a", 640, 32), _chunk("c", 1000, 32, dtype="bfloat16"),
            _chunk("w", 2000, 32, offsets=(8,), sizes=(8,), shape=(16,)), _chunk("d", 3000, 32),
            _chunk("obj", 3100, 10, kind="bytes", dtype="", shape=(), offsets=(), sizes=()), _chunk("z", 3200, 32)]
    index = index_base(base, base_files)
    match = match_file(here, [dataclass_copy(c, file=here.name) for c in mine], index)
    assert match.base.name == "rank_00000.k.safetensors"
    assert match.offsets == {512: 1024, 640: 4096} and match.delta_bytes == 64
    assert {f.item: f.reason for f in match.full} == {
        "c": "dtype float32 in the base, bfloat16 here",
        "w[8]": "resharded: no chunk of the base has its offsets and sizes",
        "d": "its base copy is in rank_00001.k.safetensors, the file's base is rank_00000.k.safetensors",
        "obj": "9 bytes in the base, 10 here",
        "z": "new since the base"}
    chunks = [codec.Chunk(0, 512), codec.Chunk(512, 16, 4), codec.Chunk(528, 16, 4), codec.Chunk(544, 96),
              codec.Chunk(640, 32, 4)]
    assigned = assign_bases(chunks, [(c.byte_offset, c.length) for c in mine], match.offsets)
    assert [c.base for c in assigned] == [None, 1024, 1040, None, 4096]
    assert match_file(here, [dataclass_copy(mine[-1], file=here.name)], index).why


def dataclass_copy(chunk: ChunkRecord, **changes) -> ChunkRecord:
    from dataclasses import replace

    return replace(chunk, **changes)


def test_decode_takes_each_delta_chunk_from_its_own_base_offset():
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(4096, generator=g), torch.randn(2048, generator=g)
    base = (b.numpy().tobytes() + bytes(100) + a.numpy().tobytes())  # the base placed them the other way
    a2, b2 = a + 1e-6 * torch.randn(4096, generator=g), b + 1e-6
    data = a2.numpy().tobytes() + bytes(36) + b2.numpy().tobytes()
    chunks = [codec.Chunk(0, a.nbytes, 4, base=b.nbytes + 100), codec.Chunk(a.nbytes, 36),
              codec.Chunk(a.nbytes + 36, b.nbytes, 4, base=0)]
    coded = codec.encode_chunks(data, chunks, threads=1)
    stored = [codec.encode_chunk(memoryview(data)[c.offset: c.offset + c.length], c.planes, 1,
                                 memoryview(base)[c.base: c.base + c.length] if c.base is not None else None)
              for c in chunks]
    entries = codec.table_entries(chunks, [(len(s), crc) for s, (_, crc) in zip(stored, coded, strict=True)])
    container = codec.pack_header(entries, len(data)) + b"".join(stored)
    assert codec.decode(container, base=base) == data
    assert sum(map(len, stored)) < 0.7 * sum(len(s) for s, _ in coded)  # deltas of the right bytes
    with pytest.raises(codec.CodecError, match="crc32c"):
        codec.decode(container, base=base[::-1])  # another base: caught after the XOR
    with pytest.raises(codec.CodecError, match="but the base has"):
        codec.decode(container, base=base[: len(base) - 8])
