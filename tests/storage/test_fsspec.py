"""The fsspec tier: FsspecStore (LocalStore's methods over any fsspec URL) and FsspecEngine
(ranged, verified, queue-depth-bounded reads), against moto on loopback and a local directory."""

from __future__ import annotations

import os

import crc32c
import pytest
import torch

from dcp_nvme import ChecksumMismatchError, DCPNVMeError, IOConfig
from dcp_nvme.engines.fsspec import FsspecEngine
from dcp_nvme.engines.requests import SCRATCH, ReadRequest
from dcp_nvme.storage.fsspec_dir import FsspecStore, is_remote_url, open_store
from dcp_nvme.storage.local_dir import LocalStore


def test_is_remote_url():
    assert is_remote_url("s3://b/x") and is_remote_url("gs://b/x")
    assert not is_remote_url("/tmp/x") and not is_remote_url("file:///tmp/x") and not is_remote_url(3)
    assert isinstance(open_store("file:///tmp/x"), LocalStore)


@pytest.mark.parametrize("where", ["s3", "file"])
def test_store_methods(where, tmp_path, seaweed, seaweed_bucket, seaweed_fs):
    if where == "s3":
        store = FsspecStore(f"s3://{seaweed_bucket}/run/step_1", fs=seaweed_fs)
    else:
        store = FsspecStore(f"file://{tmp_path}/run/step_1")
    assert not store.exists() and store.names() == [] and not store.has("a.bin")
    store.make()
    store.write_atomic("a.bin", b"hello world")
    store.write_atomic("b.json", b"{}")
    assert store.exists() and store.has("a.bin") and not store.has("zzz")
    assert store.names() == ["a.bin", "b.json"]  # no temp files left behind
    assert store.read("a.bin") == b"hello world" and store.size("a.bin") == 11
    assert store.read_range("a.bin", 6, 11) == b"world"
    store.remove("a.bin")
    store.remove("a.bin")  # removing twice is fine
    assert store.names() == ["b.json"]
    store.sync()
    with pytest.raises(FileNotFoundError):
        store.read("a.bin")


def _requests(path: str, data: bytes, block: int, dests: int) -> list[ReadRequest]:
    """One request per block, each scattered into its own destination, with its crc check."""
    out = []
    for index in range(dests):
        lo = index * block
        chunk = data[lo : lo + block]
        out.append(ReadRequest(path, lo, len(chunk), [(index, 0, len(chunk))],
                               [(0, len(chunk), crc32c.crc32c(chunk))]))
    return out


def test_engine_reads_ranges_verified_and_bounded(seaweed, seaweed_bucket, seaweed_fs):
    data = os.urandom(16 * 65536 + 100)
    path = f"{seaweed_bucket}/c.bin"
    seaweed_fs.pipe_file(path, data)
    block = 65536
    n = len(data) // block
    dests = [torch.empty(block, dtype=torch.uint8) for _ in range(n)]
    engine = FsspecEngine(seaweed_fs, IOConfig(queue_depth=3))
    stats = engine.read(_requests(path, data, block, n), dests)
    assert b"".join(bytes(d.numpy()) for d in dests) == data[: n * block]
    assert stats.requests == n and stats.bytes == n * block and 1 <= stats.max_inflight <= 3
    # a piece going to SCRATCH is read (and verified) but not copied anywhere
    dest = torch.zeros(10, dtype=torch.uint8)
    request = ReadRequest(path, 0, 30, [(SCRATCH, 0, 20), (0, 0, 10)], [(0, 30, crc32c.crc32c(data[:30]))])
    engine.read([request], [dest])
    assert bytes(dest.numpy()) == data[20:30]


def test_engine_detects_corruption_and_truncation(seaweed, seaweed_bucket, seaweed_fs):
    data = os.urandom(8192)
    path = f"{seaweed_bucket}/d.bin"
    seaweed_fs.pipe_file(path, data)
    engine = FsspecEngine(seaweed_fs, IOConfig(queue_depth=2))
    dest = torch.zeros(4096, dtype=torch.uint8)
    bad = ReadRequest(path, 4096, 4096, [(0, 0, 4096)], [(0, 4096, crc32c.crc32c(data[4096:]) ^ 1)])
    with pytest.raises(ChecksumMismatchError) as info:
        engine.read([bad], [dest])
    assert info.value.start == 4096 and info.value.end == 8192
    assert not dest.any()  # nothing unverified reached the destination
    short = ReadRequest(path, 6000, 4096, [(0, 0, 4096)], [])
    with pytest.raises(DCPNVMeError, match="truncated"):
        engine.read([short], [dest])
