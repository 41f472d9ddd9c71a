"""Containers of one request (``engines.small``): one buffered write, checksums from the same
memory, the fsync done or owed; read back buffered."""

import fcntl
import os

import crc32c
import pytest
import torch

from dcp_nvme.config import IOConfig
from dcp_nvme.engines import small
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.engines.reads import ReadSource


def _block_crcs(data: bytes, block: int) -> list[int]:
    return [crc32c.crc32c(data[i:i + block]) for i in range(0, len(data), block)]


def _sources():
    return [torch.arange(5000, dtype=torch.uint8), torch.zeros(123, dtype=torch.uint8),
            torch.empty(0, dtype=torch.uint8), torch.full((7000,), 3, dtype=torch.uint8)]


def test_one_request_is_one_write_from_the_sources_memory_with_every_block_checksummed(tmp_path, monkeypatch):
    calls = []
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, views, offset: calls.append(offset) or real(fd, views, offset))
    header, sources = bytes(range(256)) * 16, _sources()
    result = small.write_small(str(tmp_path / "c"), header, sources, 4096)
    assert calls == [0]  # header and data in one call: no O_DIRECT probe, no second write
    data = b"".join(bytes(s.numpy()) for s in sources)
    assert (tmp_path / "c").read_bytes() == header + data
    assert (result.size, result.data_start, result.header_crc) == (len(header) + len(data), len(header),
                                                                    crc32c.crc32c(header))
    assert result.crcs == _block_crcs(data, 4096) and len(result.crcs) == 3
    assert result.stats.direct_io is False and result.stats.requests == 1 and result.stats.bytes == len(data)


def test_the_same_bytes_and_checksums_as_the_engine(tmp_path):
    header, sources = bytes(4096), _sources()
    config = IOConfig(queue_depth=2, block_size=1 << 20, direct_io=True)
    ours = small.write_small(str(tmp_path / "a"), header, sources, 4096)
    theirs = PosixEngine(config).write_file(str(tmp_path / "b"), header, sources, 4096)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert (ours.size, ours.data_start, ours.crcs, ours.header_crc) == \
        (theirs.size, theirs.data_start, theirs.crcs, theirs.header_crc)


def test_the_fsync_is_done_or_owed(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    config = IOConfig(queue_depth=2, block_size=1 << 20)
    now, later = str(tmp_path / "rank_00000.aa.safetensors"), str(tmp_path / "rank_00001.aa.safetensors")
    small.write_container(PosixEngine(config), now, bytes(4096), _sources(), config)
    assert synced == [now] and small.take_owed(str(tmp_path), "aa") == []
    small.write_container(PosixEngine(config), later, bytes(4096), _sources(), config, defer=True)
    assert synced == [now]  # not yet: the commit owes it
    assert small.take_owed(str(tmp_path), "aa") == [later]
    assert small.take_owed(str(tmp_path), "aa") == []  # taken once


def test_a_save_that_never_committed_leaves_no_owed_fsync_to_the_next(tmp_path):
    config = IOConfig(queue_depth=2, block_size=1 << 20)
    old = str(tmp_path / "rank_00000.bb.safetensors")
    small.write_container(PosixEngine(config), old, bytes(4096), _sources(), config, defer=True)
    os.unlink(old)  # the failed save's files are removed; its entry must not reach the next commit
    assert small.take_owed(str(tmp_path), "cc") == []
    assert small.take_owed(str(tmp_path), "bb") == []


def test_larger_than_a_request_or_in_device_memory_goes_to_the_engine(tmp_path):
    config = IOConfig(queue_depth=2, block_size=64 << 10)
    assert small.fits_one_request(bytes(4096), [torch.zeros(60 << 10, dtype=torch.uint8)], config.block_size)
    assert not small.fits_one_request(bytes(4096), [torch.zeros(61 << 10, dtype=torch.uint8)], config.block_size)
    assert not small.fits_one_request(bytes(4096), [torch.zeros(10, dtype=torch.uint8, device="meta")],
                                      config.block_size)
    big = [torch.arange(200_000, dtype=torch.int32).view(torch.uint8)]
    result = small.write_container(PosixEngine(config), str(tmp_path / "c"), bytes(4096), big, config, defer=True)
    assert result.stats.requests > 1  # the engine's windows
    assert small.take_owed(str(tmp_path), "") == []  # an engine write fsyncs itself


def _o_direct_works(path) -> bool:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("size,direct", [(64 << 10, False), (3 << 20, True)])
def test_a_container_of_one_request_is_read_buffered(tmp_path, size, direct):
    if not _o_direct_works(str(tmp_path / "probe")):
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    (tmp_path / "c").write_bytes(bytes(size))
    source = ReadSource.open(str(tmp_path / "c"), IOConfig(queue_depth=2, block_size=1 << 20, direct_io=True))
    try:
        assert source.direct is direct
        assert bool(fcntl.fcntl(source.fd, fcntl.F_GETFL) & os.O_DIRECT) is direct
    finally:
        os.close(source.fd)
