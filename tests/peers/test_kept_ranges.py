"""The ranges of other nodes' files a restore keeps on this node (``peers.kept``): what a
later load may read there, and records it refuses. tests/cross/test_node_local_restores.py keeps
and rereads them on simulated nodes."""

from __future__ import annotations

import json
import os

import pytest

from dcp_nvme.format.container import RANGES_DIR
from dcp_nvme.format.pieces import Span
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.peers.kept import KeptRanges, keep_spans, kept_file
from dcp_nvme.storage.local_dir import drop_kept

NAME = "rank_00002.abcd1234.safetensors"


def _record(name: str = NAME, size: int = 1 << 20) -> FileRecord:
    return FileRecord(name=name, rank=2, size=size, data_start=4096, checksum_block=64 << 10,
                      header_crc=0, crcs=())


def _kept(tmp_path, record: FileRecord, spans: list[tuple[int, int]]) -> None:
    target = kept_file(str(tmp_path), record)
    fd = os.open(target, os.O_WRONLY)
    try:
        for start, end in spans:
            os.pwrite(fd, bytes([7]) * (end - start), start)
    finally:
        os.close(fd)
    keep_spans(str(tmp_path), record, spans)


def test_kept_spans_merge_and_cover_only_what_arrived(tmp_path):
    record = _record()
    _kept(tmp_path, record, [(4096, 69632), (200000, 300000)])
    _kept(tmp_path, record, [(69632, 135168)])  # adjacent: merged into one range
    kept = KeptRanges(str(tmp_path), {NAME: record})
    assert kept.spans[NAME] == [(4096, 135168), (200000, 300000)]
    assert kept.covers(Span(NAME, 4096, 135168)) and kept.covers(Span(NAME, 250000, 260000))
    assert not kept.covers(Span(NAME, 100000, 210000))  # across a hole
    assert not kept.covers(Span("rank_00003.abcd1234.safetensors", 4096, 8192))
    assert kept.path(NAME) == os.path.join(tmp_path, RANGES_DIR, NAME)
    assert os.path.getsize(kept.path(NAME)) == record.size
    assert KeptRanges(str(tmp_path), {}).path(NAME) is None  # another save's files: not used


@pytest.mark.parametrize("doc", [
    {"size": 1 << 20, "spans": [[0, (1 << 20) + 1]]},  # past the end
    {"size": 1 << 20, "spans": [[500, 400]]},  # empty / reversed
    {"size": 1 << 20, "spans": [[100, 200], [150, 300]]},  # overlapping: not what we write
    {"size": 1 << 20, "spans": [[0, 1.5]]},  # not integers
    {"size": 4096, "spans": [[0, 4096]]},  # another file's size
    ["not", "a", "record"],
])
def test_a_record_that_does_not_fit_its_file_is_ignored(tmp_path, caplog, doc):
    record = _record()
    _kept(tmp_path, record, [(4096, 8192)])
    with open(os.path.join(tmp_path, RANGES_DIR, NAME + ".spans"), "w") as f:
        json.dump(doc, f)
    kept = KeptRanges(str(tmp_path), {NAME: record})
    assert kept.path(NAME) is None and not kept.covers(Span(NAME, 4096, 8192))
    assert f"the kept ranges of {NAME} are not used" in caplog.text


def test_a_record_whose_data_file_was_cut_short_is_ignored(tmp_path, caplog):
    record = _record()
    _kept(tmp_path, record, [(4096, 8192)])
    os.truncate(os.path.join(tmp_path, RANGES_DIR, NAME), 8192)
    assert KeptRanges(str(tmp_path), {NAME: record}).path(NAME) is None
    assert "does not describe" in caplog.text


def test_a_planted_link_is_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (tmp_path / "ckpt" / RANGES_DIR).mkdir(parents=True)
    os.symlink(outside, tmp_path / "ckpt" / RANGES_DIR / NAME)
    with pytest.raises(Exception, match="link"):
        kept_file(str(tmp_path / "ckpt"), _record())
    assert outside.read_bytes() == b"precious"


def test_another_saves_ranges_are_dropped(tmp_path):
    mine, old = _record(), _record("rank_00002.0ld0ld00.safetensors")
    _kept(tmp_path, mine, [(4096, 8192)])
    _kept(tmp_path, old, [(4096, 8192)])
    drop_kept(str(tmp_path), lambda name: name == NAME)
    assert sorted(os.listdir(tmp_path / RANGES_DIR)) == [NAME, NAME + ".spans"]
