"""Two tiers: drain committed checkpoints to a real S3 server (moto on loopback, behind a fault
proxy) and to a second directory; resume, retention, verification, failures."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.s3_fixtures import *  # noqa: F403  (fixtures s3_server, s3_bucket, s3_fs)
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import CheckpointNotCommittedError, ChecksumMismatchError, NVMeReader, NVMeWriter
from dcp_nvme.cli import main as cli_main
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.pieces import plan_pieces
from dcp_nvme.tiers import (
    FAILED,
    LOCAL,
    MIRRORED,
    Drainer,
    DrainError,
    DrainOptions,
    apply_retention,
    drain,
    drain_state,
    set_default_drainer,
    verify_mirror,
)

MiB = 1 << 20
FAST = dict(part_size=5 * MiB, retries=0, backoff=0.01, max_transfers=3)
"""5 MiB pieces (S3's minimum part), no retries unless a test asks: failures surface at once."""


def make_state(seed: int = 0, floats: int = 1_600_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(floats, generator=g),  # 6.4 MB: two pieces of 5 MiB (S3's minimum part)
        "b": torch.arange(1000, dtype=torch.int64) + seed,
        "h": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "meta": {"step": seed, "note": "tiers"},
    }


def blank_like(sd: dict) -> dict:
    return {
        "w": torch.zeros_like(sd["w"]), "b": torch.zeros_like(sd["b"]), "h": torch.zeros_like(sd["h"]),
        "meta": {"step": -1, "note": ""},
    }


def save(path, sd: dict) -> str:
    dcp.save(sd, storage_writer=NVMeWriter(str(path)), no_dist=True)
    return str(path)


def load(reader: NVMeReader, sd: dict) -> dict:
    out = blank_like(sd)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def assert_same(a: dict, b: dict) -> None:
    for key in ("w", "b", "h"):
        assert a[key].dtype == b[key].dtype
        assert torch.equal(a[key].view(torch.uint8) if a[key].dtype == torch.bfloat16 else a[key],
                           b[key].view(torch.uint8) if b[key].dtype == torch.bfloat16 else b[key])
    assert a["meta"] == b["meta"]


def opts(srv) -> dict:
    return srv.storage_options(retries=1)


def part_puts(srv, start: int = 0) -> list[tuple]:
    return [e for e in srv.proxy.log[start:] if e[0] == "PUT" and "partNumber=" in e[1] and e[2] == 200]


def data_size(local: str) -> int:
    return json.loads(open(os.path.join(local, MANIFEST)).read())["total_bytes"]


# --------------------------------------------------------------------------- pure


def test_plan_pieces_cover_file_on_block_boundaries():
    pieces = plan_pieces(size=4096 + 10 * MiB + 5, data_start=4096, checksum_block=MiB, part_size=3 * MiB)
    assert pieces[0].offset == 0 and pieces[0].length == 4096 + 3 * MiB
    assert sum(p.length for p in pieces) == 4096 + 10 * MiB + 5
    assert all((p.offset - 4096) % MiB == 0 for p in pieces[1:])
    assert [p.index for p in pieces] == list(range(len(pieces)))


# --------------------------------------------------------------------------- happy paths


def test_drain_to_s3_then_load_byte_identical(tmp_path, s3_server, s3_bucket, s3_fs):
    sd = make_state(1)
    local = save(tmp_path / "run" / "step_1", sd)
    assert drain_state(local).state == LOCAL
    url = f"s3://{s3_bucket}/run/step_1"
    start = len(s3_server.proxy.log)
    result = drain(local, url, filesystem=s3_fs, options=DrainOptions(**FAST, verify="readback"))
    assert result.bytes_sent == data_size(local) and result.bytes_verified_remote == data_size(local)
    assert len(part_puts(s3_server, start)) == 2  # 6.4 MB in 5 MiB multipart parts
    state = drain_state(local)
    assert state.state == MIRRORED and state.target == url
    # the manifest was the last object written
    puts = [p for m, p, st in s3_server.proxy.log[start:] if m in ("PUT", "POST") and st == 200]
    assert MANIFEST in puts[-1]
    reader = NVMeReader(url, storage_options=opts(s3_server), queue_depth=2, block_size="4MiB")
    assert_same(load(reader, sd), sd)
    assert reader.last_stats["requests"] >= 2 and reader.last_stats["max_inflight"] <= 2
    assert NVMeReader.validate_checkpoint_id(url)


def test_drain_to_second_directory_plain_and_file_url(tmp_path):
    sd = make_state(2)
    local = save(tmp_path / "nvme" / "step_2", sd)
    mirror = tmp_path / "pfs" / "step_2"
    result = drain(local, str(mirror), options=DrainOptions(**FAST, verify="readback"))
    assert result.bytes_sent == data_size(local)
    assert sorted(os.listdir(mirror)) == sorted(n for n in os.listdir(local) if not n.startswith("."))
    assert_same(load(NVMeReader(str(mirror)), sd), sd)
    url = f"file://{tmp_path}/pfs2/step_2"
    drain(local, url, options=DrainOptions(**FAST))
    assert_same(load(NVMeReader(url), sd), sd)
    assert drain_state(local).target == url


def test_a_capped_drain_keeps_to_its_cap_with_at_most_one_piece_ahead(tmp_path, monkeypatch):
    """The cap's bucket holds one piece: over any window the drain sends at most one piece more
    than the cap allows (a second's burst ran 10 % over a 0.25x-link cap for seconds)."""
    from types import SimpleNamespace

    from dcp_nvme.tiers import drainer, transfer

    made: list = []

    class Recorded(transfer.TokenBucket):
        def __init__(self, rate, burst=None) -> None:
            super().__init__(rate, burst)
            made.append(self)

    monkeypatch.setattr(drainer, "TokenBucket", Recorded)
    local = save(tmp_path / "nvme" / "step_1", make_state(1))
    drain(local, str(tmp_path / "pfs" / "step_1"), options=DrainOptions(**{**FAST, "bandwidth": 500 * MiB}))
    assert [bucket.capacity for bucket in made] == [FAST["part_size"]]

    clock = [0.0]  # the bucket's arithmetic on a clock of its own: 10 pieces at 4 pieces a second
    monkeypatch.setattr(transfer, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                          sleep=lambda s: clock.__setitem__(0, clock[0] + s)))
    bucket = transfer.TokenBucket(4 * MiB, MiB)
    for _ in range(10):
        bucket.take(MiB)
    assert clock[0] == pytest.approx(9 / 4)  # the first piece at once, then one every 0.25 s


@pytest.mark.parametrize("kind", ["empty", "stock-dcp", "uncommitted"])
def test_a_refused_drain_leaves_nothing_in_a_directory_without_a_committed_checkpoint(tmp_path, capsys, kind):
    """A directory that holds no committed dcp_nvme checkpoint is refused, by the API and the
    CLI, without a drain lock (or anything else) left in it."""
    local = tmp_path / kind
    local.mkdir()
    if kind == "stock-dcp":
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(local), no_dist=True)
    elif kind == "uncommitted":
        (local / "rank_00000.0badc0de.safetensors").write_bytes(b"\0" * 64)
    before = sorted(os.listdir(local))
    words = {"empty": "no manifest.json", "stock-dcp": "FileSystemWriter",
             "uncommitted": "no committed manifest.json"}[kind]
    with pytest.raises(DrainError, match=words):
        drain(local, str(tmp_path / "mirror"), options=DrainOptions(**FAST))
    assert cli_main(["drain", str(local), "--to", str(tmp_path / "mirror")]) == 1
    assert words in capsys.readouterr().err
    assert sorted(os.listdir(local)) == before
    assert not (tmp_path / "mirror").exists() or not os.listdir(tmp_path / "mirror")


# --------------------------------------------------------------------------- resume


# A drain process killed part-way and resumed (deterministic SIGKILL points, another part size):
# tests/tiers/test_drain_invariants.py::test_s3_drain_killed_then_resumed_with_another_part_size and
# ::test_local_drain_killed_then_resumed_with_another_part_size.


def test_unreachable_mid_drain_then_resume(tmp_path, s3_server, s3_bucket, s3_fs):
    sd = make_state(4)
    local = save(tmp_path / "step_4", sd)
    url = f"s3://{s3_bucket}/step_4"

    def cut_after_first(name, piece):
        s3_server.proxy.down()

    options = DrainOptions(**{**FAST, "max_transfers": 1})
    with pytest.raises(DrainError) as info:
        drain(local, url, filesystem=s3_fs, options=options, progress=cut_after_first)
    assert "unreachable" in info.value.cause
    state = drain_state(local)
    assert state.state == FAILED and "unreachable" in str(state) and str(state).startswith("failed: ")
    assert_same(load(NVMeReader(local), sd), sd)  # the local tier is untouched

    s3_server.proxy.up()
    result = drain(local, url, filesystem=s3_fs, options=options)
    assert 0 < result.bytes_sent < data_size(local) and result.bytes_skipped > 0
    assert_same(load(NVMeReader(url, storage_options=opts(s3_server)), sd), sd)


def test_server_killed_mid_drain_restarts_empty_then_full_resend(tmp_path, s3_server, s3_bucket, s3_fs):
    sd = make_state(5)
    local = save(tmp_path / "step_5", sd)
    url = f"s3://{s3_bucket}/step_5"
    options = DrainOptions(**{**FAST, "max_transfers": 1, "retries": 1})
    with pytest.raises(DrainError):
        drain(local, url, filesystem=s3_fs, options=options, progress=lambda n, p: s3_server.stop())
    assert drain_state(local).state == FAILED
    s3_server.start()  # back, but empty: no bucket, no multipart upload
    with pytest.raises(DrainError, match="bucket missing"):
        drain(local, url, filesystem=s3_fs, options=options)
    s3_server.s3fs(direct=True).mkdir(s3_bucket)
    result = drain(local, url, filesystem=s3_fs, options=options)
    assert result.bytes_sent == data_size(local)  # the journal's parts were gone: all resent
    assert_same(load(NVMeReader(url, storage_options=opts(s3_server)), sd), sd)


# --------------------------------------------------------------------------- failures


def test_missing_bucket_fails_with_cause_local_intact(tmp_path, seaweed, seaweed_fs):
    sd = make_state(6)
    local = save(tmp_path / "step_6", sd)
    with pytest.raises(DrainError) as info:
        drain(local, "s3://no-such-bucket-dcp-nvme/run/step_6", filesystem=seaweed_fs,
              options=DrainOptions(**{**FAST, "retries": 1}))
    assert "bucket missing" in info.value.cause
    state = drain_state(local)
    assert state.state == FAILED and state.attempts == 1 and "bucket missing" in state.cause  # not retried
    assert_same(load(NVMeReader(local), sd), sd)


def test_503_retried_then_success(tmp_path, s3_server, s3_bucket, s3_fs):
    sd = make_state(7)
    local = save(tmp_path / "step_7", sd)
    url = f"s3://{s3_bucket}/step_7"
    with s3_server.proxy.fault("error", status=503, count=3):
        result = drain(local, url, filesystem=s3_fs, options=DrainOptions(**{**FAST, "retries": 5}))
    assert result.attempts >= 2 and any("503" in e for e in result.errors)
    assert drain_state(local).state == MIRRORED
    assert_same(load(NVMeReader(url, storage_options=opts(s3_server)), sd), sd)


def test_permanent_503_fails(tmp_path, s3_server, s3_bucket, s3_fs):
    local = save(tmp_path / "step_8", make_state(8))
    with s3_server.proxy.fault("error", status=503), pytest.raises(DrainError):
        drain(local, f"s3://{s3_bucket}/step_8", filesystem=s3_fs, options=DrainOptions(**{**FAST, "retries": 2}))
    state = drain_state(local)
    assert state.state == FAILED and "503" in state.cause and state.attempts == 3


def test_remote_without_manifest_is_refused(tmp_path, s3_server, s3_bucket, s3_fs):
    sd = make_state(9)
    local = save(tmp_path / "step_9", sd)
    url = f"s3://{s3_bucket}/step_9"
    with s3_server.proxy.fault("error", status=500, methods=["PUT"], path_regex=MANIFEST), \
            pytest.raises(DrainError):
        drain(local, url, filesystem=s3_fs, options=DrainOptions(**FAST))
    assert s3_fs.exists(f"{s3_bucket}/step_9/rank_00000.{_key(local)}.safetensors")  # data is there...
    with pytest.raises(CheckpointNotCommittedError, match="did not finish"):  # ...but not loadable
        NVMeReader(url, storage_options=opts(s3_server)).read_metadata()
    result = drain(local, url, filesystem=s3_fs, options=DrainOptions(**FAST))
    assert result.bytes_sent == 0  # every data file was complete; only tables + manifest again
    assert_same(load(NVMeReader(url, storage_options=opts(s3_server)), sd), sd)


def _key(local: str) -> str:
    return json.loads(open(os.path.join(local, MANIFEST)).read())["save_key"]


def test_readback_catches_remote_corruption(tmp_path, seaweed, seaweed_bucket, seaweed_fs):
    sd = make_state(10)
    local = save(tmp_path / "step_10", sd)
    url = f"s3://{seaweed_bucket}/step_10"
    drain(local, url, filesystem=seaweed_fs, options=DrainOptions(**FAST))
    obj = f"{seaweed_bucket}/step_10/rank_00000.{_key(local)}.safetensors"
    data = bytearray(seaweed_fs.cat_file(obj))
    data[4096 + 5 * MiB + 17] ^= 0x01  # one bit, in the second data piece
    seaweed_fs.pipe_file(obj, bytes(data))
    with pytest.raises(ChecksumMismatchError) as info:
        verify_mirror(local, url, filesystem=seaweed_fs, options=DrainOptions(**FAST, verify="readback"))
    assert info.value.start == 4096 + 5 * MiB and obj.split("/")[-1] in str(info.value)
    assert str(drain_state(local)).startswith("failed: checksum mismatch")
    with pytest.raises(CheckpointException, match="checksum mismatch in .*item w"):  # the reader too
        load(NVMeReader(url, storage_options=opts(seaweed)), sd)
    # a drain again does not take the object for "already there": it cannot be confirmed, so it is resent
    result = drain(local, url, filesystem=seaweed_fs, options=DrainOptions(**FAST, verify="readback"))
    assert result.bytes_sent == data_size(local) and result.bytes_skipped == 0
    assert drain_state(local).state == MIRRORED
    assert_same(load(NVMeReader(url, storage_options=opts(seaweed)), sd), sd)


# --------------------------------------------------------------------------- retention, status


def test_retention_keeps_last_k_and_never_undrained(tmp_path, capsys):
    run = tmp_path / "run"
    paths = [save(run / f"step_{i}", make_state(i, floats=1000)) for i in range(4)]
    for i in (0, 1, 3):
        drain(paths[i], str(tmp_path / "pfs" / f"step_{i}"), options=DrainOptions(**FAST))
        sd = make_state(i, floats=1000)  # what "mirrored" promises: the mirror loads bit for bit
        assert_same(load(NVMeReader(str(tmp_path / "pfs" / f"step_{i}")), sd), sd)
    assert drain_state(paths[2]).state == LOCAL
    removed = apply_retention(run, keep_last=1)
    assert sorted(removed) == sorted(paths[:2])
    assert sorted(os.listdir(run)) == ["step_2", "step_3"]  # step_2 kept: not drained
    assert cli_main(["status", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(os.path.basename(r["path"]), r["state"]) for r in rows] == [("step_2", LOCAL), ("step_3", MIRRORED)]
    assert cli_main(["status", paths[3]]) == 0
    assert "mirrored ->" in capsys.readouterr().out
    with pytest.raises(ValueError):
        apply_retention(run, keep_last=0)


def test_async_save_with_mirror_commits_locally_then_drains(tmp_path, seaweed, seaweed_bucket):
    sd = make_state(11)
    local = str(tmp_path / "run" / "step_11")
    url = f"s3://{seaweed_bucket}/run/step_11"
    drainer = Drainer(DrainOptions(**FAST), keep_last=1)
    previous = set_default_drainer(drainer)
    try:
        older = save(tmp_path / "run" / "step_0", make_state(0, floats=1000))  # never mirrored
        writer = NVMeWriter(local, mirror=url, mirror_options=opts(seaweed))
        future = dcp.async_save(sd, storage_writer=writer, no_dist=True)
        (future.result() if hasattr(future, "result") else future.upload_completion.result())
        assert os.path.isfile(os.path.join(local, MANIFEST))  # the local commit is durable
        assert writer.drain_future is not None
        result = writer.drain_future.result(timeout=60)
        drainer.wait(timeout=60)
    finally:
        set_default_drainer(previous)
        drainer.close()
    assert result.bytes_sent == data_size(local) and drain_state(local).state == MIRRORED
    assert os.path.isdir(older)  # retention (keep 1) never removes a checkpoint not drained
    assert_same(load(NVMeReader(url, storage_options=opts(seaweed)), sd), sd)
