"""The S3 path through botocore itself (dcp_nvme/tiers/s3_client.py, ``BotoS3Sink``): parts on
checksum-block boundaries carrying the crc32c of their blocks, a resume that keeps a part only
when the server vouches for its bytes, the s3fs fallback said once, and a drain and restore
that never import s3fs. Faults on moto behind its proxy, a real store on SeaweedFS."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import time

import crc32c
import pytest
from dcp_nvme_harness.s3_fixtures import *  # noqa: F403  (fixtures s3_server, s3_bucket, s3_fs)
from test_tiers import FAST, assert_same, load, make_state, opts, part_puts, save

from dcp_nvme import NVMeReader
from dcp_nvme.errors import InvalidInputError
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.pieces import plan_pieces
from dcp_nvme.tiers import DrainError, DrainOptions, drain, s3_client
from dcp_nvme.tiers.journal import JOURNAL
from dcp_nvme.tiers.sinks import BotoS3Sink, S3Sink, open_sink

MiB = 1 << 20


def _data_file(local: str) -> tuple[str, dict]:
    doc = json.loads(open(os.path.join(local, MANIFEST)).read())
    name = next(n for n in os.listdir(local) if n.endswith(".safetensors"))
    return name, doc


def _crc_b64(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def _pieces(local: str, name: str, part_size: int):
    from dcp_nvme.tiers.source import DrainSource

    record = DrainSource(local).record(name)
    assert record is not None
    return plan_pieces(record.size, record.data_start, record.checksum_block, part_size)


def _upload(journal_path: str, name: str) -> str:
    return json.loads(open(journal_path).read())["files"][name]["upload_id"]


def test_s3_drain_parts_carry_crc32c_on_block_boundaries_and_resume(tmp_path, s3_server, s3_bucket, s3_fs):
    sd = make_state(21, floats=4_000_000)  # 16 MB: four 5 MiB parts
    local = save(tmp_path / "step_21", sd)
    url = f"s3://{s3_bucket}/step_21"
    name, _ = _data_file(local)
    pieces = _pieces(local, name, FAST["part_size"])
    assert len(pieces) >= 3
    sent: list[int] = []

    def cut_after_two(file, piece):
        sent.append(piece.index)
        if len(sent) == 2:
            s3_server.proxy.down()

    options = DrainOptions(**{**FAST, "max_transfers": 1})
    assert isinstance(open_sink(url, filesystem_=s3_fs), BotoS3Sink)
    with pytest.raises(DrainError, match="unreachable"):
        drain(local, url, filesystem=s3_fs, options=options, progress=cut_after_two)

    # the server holds the two parts, each the size of its planned piece (whole checksum blocks),
    # each sent with the crc32c of its bytes, journaled beside its ETag
    admin = s3_server.boto3_client()
    journal = json.loads(open(os.path.join(local, JOURNAL)).read())["files"][name]
    listed = admin.list_parts(Bucket=s3_bucket, Key=f"step_21/{name}", UploadId=journal["upload_id"])["Parts"]
    data = open(os.path.join(local, name), "rb").read()
    assert len(listed) == 2
    for part in listed:
        piece = pieces[part["PartNumber"] - 1]
        assert part["Size"] == piece.length
        tag = journal["pieces"][str(piece.index)]["tag"]
        assert tag == f"{part['ETag']}|{_crc_b64(data[piece.offset: piece.offset + piece.length])}"

    s3_server.proxy.up()
    start = len(s3_server.proxy.log)
    result = drain(local, url, filesystem=s3_fs, options=options)
    resent = sorted(int(e[1].split("partNumber=")[1].split("&")[0]) for e in part_puts(s3_server, start))
    assert resent == [p.index + 1 for p in pieces if p.index not in sent]  # only the parts never sent
    assert result.bytes_skipped == sum(pieces[i].length for i in sent)
    head = admin.head_object(Bucket=s3_bucket, Key=f"step_21/{name}", ChecksumMode="ENABLED")
    assert head["ContentLength"] == len(data)
    assert_same(load(NVMeReader(url, storage_options=opts(s3_server)), sd), sd)


def test_s3_part_whose_crc32c_the_server_refuses_is_not_journaled(tmp_path, seaweed, seaweed_bucket, monkeypatch):
    """SeaweedFS checks the crc32c a part carries (moto does not): a part whose bytes do not
    match it is refused, the drain fails, and nothing of that part is kept."""
    sd = make_state(22)
    local = save(tmp_path / "step_22", sd)
    url = f"s3://{seaweed_bucket}/step_22"
    real = s3_client.b64_crc
    monkeypatch.setattr("dcp_nvme.tiers.sinks.b64_crc", lambda crc: real(crc ^ 1))
    with pytest.raises(DrainError, match="BadDigest"):
        drain(local, url, storage_options=opts(seaweed), options=DrainOptions(**FAST))
    name, _ = _data_file(local)
    entry = json.loads(open(os.path.join(local, JOURNAL)).read())["files"][name]
    assert not entry["pieces"]
    monkeypatch.setattr("dcp_nvme.tiers.sinks.b64_crc", real)
    drain(local, url, storage_options=opts(seaweed), options=DrainOptions(**FAST))
    assert_same(load(NVMeReader(url, storage_options=opts(seaweed)), sd), sd)


def test_s3_resume_keeps_a_journaled_part_only_when_the_server_vouches_for_its_bytes(
        tmp_path, s3_server, s3_bucket, s3_fs):
    sd = make_state(23, floats=4_000_000)
    local = save(tmp_path / "step_23", sd)
    url = f"s3://{s3_bucket}/step_23"
    name, _ = _data_file(local)
    pieces = _pieces(local, name, FAST["part_size"])
    done: list[int] = []

    def cut_after_two(file, piece):
        done.append(piece.index)
        if len(done) == 2:
            s3_server.proxy.down()

    options = DrainOptions(**{**FAST, "max_transfers": 1})
    with pytest.raises(DrainError):
        drain(local, url, filesystem=s3_fs, options=options, progress=cut_after_two)
    # another writer replaces the second journaled part with other bytes of the same size: the
    # journal still names it, the server no longer vouches for its crc32c (nor its ETag)
    admin = s3_server.boto3_client()
    upload = _upload(os.path.join(local, JOURNAL), name)
    replaced = pieces[done[1]]
    admin.upload_part(Bucket=s3_bucket, Key=f"step_23/{name}", UploadId=upload, PartNumber=replaced.index + 1,
                      Body=os.urandom(replaced.length))
    s3_server.proxy.up()
    start = len(s3_server.proxy.log)
    result = drain(local, url, filesystem=s3_fs, options=options)
    resent = sorted(int(e[1].split("partNumber=")[1].split("&")[0]) for e in part_puts(s3_server, start))
    assert resent == [p.index + 1 for p in pieces if p.index != done[0]]  # the vouched part stayed
    assert result.bytes_skipped == pieces[done[0]].length
    assert_same(load(NVMeReader(url, storage_options=opts(s3_server)), sd), sd)


def test_s3_target_gets_botocore_client_from_options_else_s3fs_said_once(s3_server, s3_bucket, caplog):
    url = f"s3://{s3_bucket}/x"
    sink = open_sink(url, opts(s3_server))
    assert isinstance(sink, BotoS3Sink)
    options, why = s3_client.s3_options(opts(s3_server))
    assert options is not None and options.endpoint_url == s3_server.endpoint_url and options.max_attempts == 1
    assert s3_client.client(options) is sink.s3.client  # one client per set of options
    s3_client._said.clear()
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.tiers.s3_client"):
        for _ in range(3):  # an option only s3fs knows: s3fs serves it, and says why once
            assert isinstance(open_sink(url, {**opts(s3_server), "requester_pays": True}), S3Sink)
    said = [r.getMessage() for r in caplog.records if "s3fs" in r.getMessage()]
    assert len(said) == 1 and "requester_pays" in said[0]
    with pytest.raises(InvalidInputError, match="endpoint_url"):
        open_sink(url, {**opts(s3_server), "endpoint_url": 8080})
    with pytest.raises(InvalidInputError, match="max_attempts"):
        open_sink(url, {**opts(s3_server), "config_kwargs": {"retries": {"max_attempts": "3"}}})


_NO_S3FS = """
import json, sys, torch, torch.distributed.checkpoint as dcp
from dcp_nvme import NVMeReader
from dcp_nvme.tiers import DrainOptions, drain
local, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = drain(local, url, storage_options=options, options=DrainOptions(part_size=5 << 20, retries=0))
out = {"w": torch.zeros(4_000_000), "b": torch.zeros(1000, dtype=torch.int64),
       "h": torch.zeros(64, 33, dtype=torch.bfloat16), "meta": {}}
reader = NVMeReader(url, storage_options=options)
dcp.load(out, storage_reader=reader, no_dist=True)
print(json.dumps({"sent": result.bytes_sent, "store": type(reader.store).__name__,
                  "s3fs": "s3fs" in sys.modules, "aiobotocore": "aiobotocore" in sys.modules,
                  "w": out["w"][:4].tolist()}))
"""


def test_s3_drain_from_storage_options_stores_crc32c_object(tmp_path, seaweed, seaweed_bucket):
    """SeaweedFS: a drain and a restore given storage options go through botocore alone (s3fs
    is never imported), and the object's crc32c is the one of the local blocks."""
    sd = make_state(24, floats=4_000_000)
    local = save(tmp_path / "step_24", sd)
    url = f"s3://{seaweed_bucket}/step_24"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", _NO_S3FS, local, url, json.dumps(opts(seaweed))],
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["store"] == "S3Store" and not said["s3fs"] and not said["aiobotocore"]
    assert said["w"] == sd["w"][:4].tolist() and said["sent"] > 0
    name, _ = _data_file(local)
    sink = open_sink(url, opts(seaweed))
    assert isinstance(sink, BotoS3Sink)
    head = sink.s3.head(name)
    pieces = _pieces(local, name, 5 * MiB)
    data = open(os.path.join(local, name), "rb").read()
    parts = b"".join(crc32c.crc32c(data[p.offset: p.offset + p.length]).to_bytes(4, "big") for p in pieces)
    assert head["ChecksumCRC32C"] in (f"{_crc_b64(parts)}-{len(pieces)}", _crc_b64(data))
    assert_same(load(NVMeReader(url, storage_options=opts(seaweed)), sd), sd)


def test_s3_drain_holds_its_bandwidth_cap(tmp_path, seaweed, seaweed_bucket):
    """The cap holds on the botocore path: after one piece's burst, no faster than the cap."""
    sd = make_state(25, floats=4_000_000)  # 16 MB
    local = save(tmp_path / "step_25", sd)
    url = f"s3://{seaweed_bucket}/step_25"
    rate = 8 * MiB
    started = time.monotonic()
    result = drain(local, url, storage_options=opts(seaweed), options=DrainOptions(**{**FAST, "bandwidth": rate}))
    took = time.monotonic() - started
    assert result.bytes_sent > 2 * FAST["part_size"]
    assert took >= (result.bytes_sent - FAST["part_size"]) / rate * 0.95
    assert_same(load(NVMeReader(url, storage_options=opts(seaweed)), sd), sd)


def test_s3_part_listing_that_does_not_move_forward_is_refused_not_looped():
    """ListParts' next marker is the server's word: a store that answers "truncated" with the
    same marker again (or a marker past S3's part numbers) ends the listing with an error naming
    the upload, instead of holding the drain in a loop."""
    from dcp_nvme.tiers.transfer import IncompleteOnTarget

    class Answers:
        bucket = "b"

        def __init__(self, markers):
            self.markers, self.calls = list(markers), 0

        def call(self, op, location, **kwargs):
            assert op == "list_parts"
            self.calls += 1
            marker = self.markers.pop(0)
            return {"Parts": [{"PartNumber": self.calls, "Size": 1}], "IsTruncated": True, "NextPartNumberMarker": marker}

        def key(self, name):
            return f"run/{name}"

    for markers in ([1, 1], [1, "x"], [10_000]):
        sink = BotoS3Sink.__new__(BotoS3Sink)
        sink.s3, sink.target = Answers(markers), "s3://b/run"
        with pytest.raises(IncompleteOnTarget, match="upload u1.*cannot be trusted"):
            sink._list_parts("f", "u1")
        assert sink.s3.calls == len(markers)


def test_s3_mirror_reads_land_in_the_destination_and_a_short_object_is_named(s3_server, s3_bucket):
    """The exchange's mirror reads (``MirrorSource.read_into``) go through botocore straight into
    the memory they fill; an object shorter than the manifest says is named, not padded."""
    from dcp_nvme.errors import ManifestError
    from dcp_nvme.peers.fetching import MirrorSource
    from dcp_nvme.storage.fsspec_dir import open_store

    data = os.urandom(3 * MiB + 17)
    s3_server.boto3_client().put_object(Bucket=s3_bucket, Key="ck/rank_0.safetensors", Body=data)
    mirror = MirrorSource(open_store(f"s3://{s3_bucket}/ck", opts(s3_server)), opts(s3_server))
    assert type(mirror.store).__name__ == "S3Store"
    into = memoryview(bytearray(2 * MiB))
    mirror.read_into("rank_0.safetensors", MiB + 5, into)
    assert bytes(into) == data[MiB + 5:3 * MiB + 5]
    with pytest.raises(ManifestError, match="rank_0.safetensors is shorter than its manifest says"):
        mirror.read_into("rank_0.safetensors", 2 * MiB, memoryview(bytearray(2 * MiB)))


def test_a_file_that_would_need_more_parts_than_s3_takes_gets_larger_parts(tmp_path, s3_server, s3_bucket,
                                                                           monkeypatch):
    """S3 takes at most ``max_parts`` parts in one upload (10,000): a file that ``part_size``
    would cut into more is cut into larger parts, on checksum blocks, and still loads bitwise."""
    assert BotoS3Sink.max_parts == S3Sink.max_parts == 10_000
    sd = make_state(23, floats=6_000_000)  # 24 MB: five 5 MiB parts at the given size
    local = save(tmp_path / "step_23", sd)
    name, _ = _data_file(local)
    assert len(_pieces(local, name, 5 * MiB)) == 5
    monkeypatch.setattr(BotoS3Sink, "max_parts", 3)
    url = f"s3://{s3_bucket}/step_23"
    start = len(s3_server.proxy.log)
    drain(local, url, storage_options=opts(s3_server), options=DrainOptions(part_size=5 * MiB, retries=0))
    planned = json.loads(open(os.path.join(local, JOURNAL)).read())["files"][name]["part_size"]
    parts = _pieces(local, name, planned)
    assert len(parts) == len(part_puts(s3_server, start)) <= 3 and planned > 5 * MiB
    from dcp_nvme.tiers.source import DrainSource

    record = DrainSource(local).record(name)
    assert planned % record.checksum_block == 0  # every piece whole checksum blocks
    assert_same(load(NVMeReader(url, storage_options=opts(s3_server)), sd), sd)
