"""The one checksum module: every reader of a container (the POSIX, fsspec and device paths,
the drain, ``verify``) finds the same bad block through it, and tables are checked in one place."""

from __future__ import annotations

import os

import crc32c
import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import ChecksumMismatchError, NVMeWriter
from dcp_nvme.config import IOConfig
from dcp_nvme.engines.fsspec import FsspecEngine
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.errors import TableError
from dcp_nvme.format.checksums import (
    check_host,
    check_table,
    checks_within,
    host_crcs,
    items_in,
    mismatches,
)
from dcp_nvme.format.device_checksums import check_device, device_crcs
from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.format.pieces import verify_piece
from dcp_nvme.load.planning import FileBlocks, Need, plan_reads
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.tools.verify import verify_checkpoint

BLOCK = 64 << 10


@pytest.fixture
def saved(tmp_path):
    gen = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(70_000, generator=gen), "b": torch.randn(300, 301, generator=gen)}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=NVMeWriter(path, block_size=BLOCK, engine="posix"), no_dist=True)
    store = LocalStore(path)
    manifest = read_manifest(store, str(path))
    (record,) = read_files(store, manifest, str(path)).values()
    return path, manifest, record


def _flip(file: str, offset: int) -> None:
    with open(file, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x20]))


def test_checks_within_name_the_header_and_every_whole_block(saved):
    path, _, record = saved
    raw = (path / record.name).read_bytes()
    checks = checks_within(record, 0, record.size)
    assert checks[0] == (0, record.data_start, record.header_crc)
    assert [c[2] for c in checks[1:]] == list(record.crcs)
    assert all(crc32c.crc32c(raw[rel : rel + n]) == want for rel, n, want in checks)
    # a range starting mid-block holds only the blocks that lie wholly inside it, relative offsets
    start = record.data_start + BLOCK + 10
    inner = checks_within(record, start, record.data_start + 4 * BLOCK)
    assert inner == [(BLOCK - 10, BLOCK, record.crcs[2]), (2 * BLOCK - 10, BLOCK, record.crcs[3])]


def test_every_reader_names_the_same_bad_block(saved):
    path, manifest, record = saved
    file = str(path / record.name)
    bad_block = 3
    lo = record.data_start + bad_block * BLOCK
    _flip(file, lo + 1234)
    expected = (lo, lo + BLOCK)

    def caught(run) -> tuple[int, int]:
        with pytest.raises(ChecksumMismatchError) as info:
            run()
        return info.value.start, info.value.end

    blocks = FileBlocks(record.data_start, record.data_size, record.checksum_block, record.crcs)
    dest = torch.empty(record.data_size, dtype=torch.uint8)
    requests = plan_reads(file, [Need(record.data_start, record.data_size, 0, 0)],
                          max_request=4 * BLOCK, blocks=blocks)
    config = IOConfig(block_size=4 * BLOCK, queue_depth=2, direct_io=False)
    assert caught(lambda: PosixEngine(config).read(requests, [dest])) == expected
    assert caught(lambda: FsspecEngine(fsspec.filesystem("file"), config).read(requests, [dest])) == expected
    raw = open(file, "rb").read()
    assert caught(lambda: verify_piece(record, 0, raw, file)) == expected
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    checks = checks_within(record, 0, record.size)
    assert caught(lambda: check_device(file, 0, checks, data)) == expected  # the device maths, on CPU
    assert caught(lambda: check_host(file, 0, checks, [memoryview(raw)])) == expected
    report = verify_checkpoint(path)
    (problem,) = report.problems
    assert (problem.start, problem.end) == expected
    owners = [(c.byte_offset, c.byte_offset + c.length, c.key) for c in manifest.chunks]
    assert problem.items == items_in(owners, *expected) == ("a",)


def test_host_crcs_span_scattered_views():
    raw = os.urandom(10_000)
    cuts = [0, 1, 700, 701, 4096, 9000, 10_000]
    views = [memoryview(raw)[a:b] for a, b in zip(cuts, cuts[1:])]
    checks = [(0, 4096, 0), (4096, 4096, 0), (8192, 1808, 0)]
    assert host_crcs(views, checks) == [crc32c.crc32c(raw[r : r + n]) for r, n, _ in checks]


@pytest.mark.parametrize("checks", [
    [(0, 4096, 0), (4096, 4096, 0), (8192, 1000, 0)],  # back-to-back blocks: one pass
    [(10, 300, 0), (512, 4096, 0), (5000, 1, 0)],  # anything else: range by range
])
def test_device_crcs_equal_the_library(checks):
    raw = os.urandom(9192)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    want = [crc32c.crc32c(raw[r : r + n]) for r, n, _ in checks]
    assert device_crcs(data, checks) == want == host_crcs([memoryview(raw)], checks)
    stated = [(r, n, c ^ (i == 1)) for i, ((r, n, _), c) in enumerate(zip(checks, want))]
    assert [check for check, _ in mismatches(stated, want)] == [stated[1]]


def test_items_in_names_each_overlapping_item_once_in_file_order():
    spans = [(15, 30, "a"), (0, 10, "z"), (10, 20, "b"), (40, 50, "b")]
    assert items_in(spans, 12, 45) == ("b", "a")
    assert items_in(spans, 30, 40) == ()


def test_a_table_is_checked_by_size_and_crc_and_named(saved):
    path, manifest, _ = saved
    entry = manifest.doc["blocks"]
    data = (path / entry["name"]).read_bytes()
    check_table(str(path), entry, data)
    for bad in (data[:-1], data[:-1] + bytes([data[-1] ^ 1])):
        with pytest.raises(TableError, match="does not match manifest.json") as info:
            check_table(str(path), entry, bad)
        assert info.value.name == entry["name"]


def test_span_crc_combines_block_crcs_into_the_crc_of_the_span():
    """An S3 part's x-amz-checksum-crc32c comes from the blocks table, no byte hashed again:
    the combined crc equals crc32c of the bytes, for any block sizes, and a gap gives None."""
    from dcp_nvme.format.checksums import crc32c_combine, span_crc

    blocks = [os.urandom(n) for n in (4096, 1 << 20, 1 << 20, 12345, 1)]
    checks, offset = [], 0
    for block in blocks:
        checks.append((offset, len(block), crc32c.crc32c(block)))
        offset += len(block)
    assert span_crc(checks, offset) == crc32c.crc32c(b"".join(blocks))
    assert crc32c_combine(crc32c.crc32c(blocks[0]), crc32c.crc32c(b""), 0) == crc32c.crc32c(blocks[0])
    assert span_crc(checks[:1] + checks[2:], offset) is None  # a block missing: hash the bytes instead
    assert span_crc(checks, offset + 1) is None
