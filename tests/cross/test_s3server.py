"""Proves the loopback S3 test infrastructure (harness/dcp_nvme_harness/s3server.py, harness/dcp_nvme_harness/s3_fixtures.py).

Set S3_BENCH=1 to also time a 256 MiB s3fs put/get (prints, ~10 s).
"""

from __future__ import annotations

import errno
import os
import time

import pytest
from dcp_nvme_harness.s3_fixtures import *  # noqa: F403  (fixtures s3_server, s3_bucket, s3_fs)
from dcp_nvme_harness.s3_fixtures import new_bucket_name
from dcp_nvme_harness.s3server import S3Server

botocore_exceptions = pytest.importorskip("botocore.exceptions")
MiB = 2**20


def _parts(srv: S3Server, key: str) -> list:
    return [p for (m, p, st) in srv.proxy.log if m == "PUT" and f"/{key}?partNumber=" in p and st == 200]


def test_put_get(s3_fs, s3_bucket):
    s3_fs.pipe(f"{s3_bucket}/a/b.bin", b"hello")
    assert s3_fs.cat(f"{s3_bucket}/a/b.bin") == b"hello"
    assert s3_fs.info(f"{s3_bucket}/a/b.bin")["size"] == 5
    assert s3_fs.find(s3_bucket) == [f"{s3_bucket}/a/b.bin"]


def test_multipart_20mib_and_ranged_reads(s3_server, s3_fs, s3_bucket):
    data = os.urandom(20 * MiB)
    path = f"{s3_bucket}/big.bin"
    s3_server.proxy.log.clear()
    # NB: s3fs only splits into block_size parts when fed in pieces (or with
    # fixed_upload_size=True); one 20 MiB write() would become a single 20 MiB part.
    with s3_fs.open(path, "wb", block_size=5 * MiB) as f:
        for i in range(0, len(data), MiB):
            f.write(data[i : i + MiB])
    assert len(_parts(s3_server, "big.bin")) == 4
    assert s3_fs.info(path)["size"] == len(data)

    starts = [0, 5 * MiB - 3, 20 * MiB - 10]
    ends = [10, 5 * MiB + 3, 20 * MiB]
    assert s3_fs.cat_ranges([path] * 3, starts, ends) == [data[s:e] for s, e in zip(starts, ends)]
    assert s3_fs.cat(path) == data


def test_fixed_upload_size_splits_single_write(s3_server, s3_bucket):
    fs = s3_server.s3fs(retries=1, fixed_upload_size=True)
    data = os.urandom(11 * MiB)
    s3_server.proxy.log.clear()
    with fs.open(f"{s3_bucket}/fixed.bin", "wb", block_size=5 * MiB) as f:
        f.write(data)
    assert len(_parts(s3_server, "fixed.bin")) == 3
    assert fs.cat(f"{s3_bucket}/fixed.bin") == data


def test_error_proxy_503_raises_fast(s3_server, s3_fs, s3_bucket):
    s3_fs.pipe(f"{s3_bucket}/k", b"v")
    t = time.monotonic()
    with s3_server.proxy.fault("error", status=503):
        with pytest.raises(OSError) as ei:
            s3_fs.cat_file(f"{s3_bucket}/k", start=0, end=1)
        with pytest.raises(OSError):
            s3_fs.pipe(f"{s3_bucket}/k2", b"v")
    assert ei.value.errno == errno.EBUSY  # s3fs maps 503/SlowDown to EBUSY
    assert isinstance(ei.value.__cause__, botocore_exceptions.ClientError)
    assert time.monotonic() - t < 5
    assert any(st == 503 for (_, _, st) in s3_server.proxy.log)
    # once the fault is gone, the same client works again
    assert s3_fs.cat(f"{s3_bucket}/k") == b"v"


def test_transient_faults_are_retried(s3_server, s3_bucket):
    fs = s3_server.s3fs(retries=3)
    fs.pipe(f"{s3_bucket}/k", b"v")
    with s3_server.proxy.fault("error", status=503, count=1) as f503:
        assert fs.cat(f"{s3_bucket}/k") == b"v"
    with s3_server.proxy.fault("drop", count=1) as fdrop:
        assert fs.cat(f"{s3_bucket}/k") == b"v"
    assert f503.hits == 1 and fdrop.hits == 1


def test_dropped_connection_is_botocore_error_not_oserror(s3_server, s3_fs, s3_bucket):
    s3_fs.pipe(f"{s3_bucket}/k", b"v")
    for mode in ("drop", "reset"):
        with s3_server.proxy.fault(mode):
            with pytest.raises(botocore_exceptions.BotoCoreError) as ei:
                s3_fs.cat_file(f"{s3_bucket}/k", start=0, end=1)  # one GET, no HEAD first
        assert not isinstance(ei.value, OSError)  # catch BotoCoreError too in drain code


def test_fault_on_nth_part_of_multipart_upload(s3_server, s3_fs, s3_bucket):
    path = f"{s3_bucket}/mpu.bin"
    with s3_server.proxy.fault("error", status=500, methods=["PUT"], path_regex=r"partNumber=", after=1) as f:
        with pytest.raises(OSError):
            with s3_fs.open(path, "wb", block_size=5 * MiB) as fh:
                for _ in range(12):
                    fh.write(b"\0" * MiB)
    assert f.hits >= 1
    s3_fs.invalidate_cache()
    assert not s3_fs.exists(path)  # never completed


def test_missing_bucket_error_types(s3_fs):
    name = new_bucket_name("missing")
    with pytest.raises(FileNotFoundError):
        s3_fs.pipe(f"{name}/k", b"v")
    with pytest.raises(FileNotFoundError):
        s3_fs.cat(f"{name}/k")
    with pytest.raises(FileNotFoundError):
        s3_fs.ls(name)
    assert s3_fs.exists(f"{name}/k") is False


def test_listing_cache_goes_stale(s3_server, s3_bucket):
    a, b = s3_server.s3fs(retries=1), s3_server.s3fs(retries=1)
    a.pipe(f"{s3_bucket}/old", b"x")
    assert a.ls(s3_bucket) == [f"{s3_bucket}/old"]  # (empty listings are not cached)
    b.pipe(f"{s3_bucket}/new", b"x")
    assert a.ls(s3_bucket) == [f"{s3_bucket}/old"]  # stale: served from a's listings cache
    assert a.ls(s3_bucket, refresh=True) == [f"{s3_bucket}/new", f"{s3_bucket}/old"]
    b.rm(f"{s3_bucket}/old")
    a.invalidate_cache(s3_bucket)
    assert a.ls(s3_bucket) == [f"{s3_bucket}/new"]


def test_proxy_down_up_keeps_state(s3_server, s3_fs, s3_bucket):
    s3_fs.pipe(f"{s3_bucket}/k", b"v")
    s3_server.proxy.down()
    with pytest.raises(botocore_exceptions.EndpointConnectionError):
        s3_fs.cat(f"{s3_bucket}/k")
    s3_server.proxy.up()
    assert s3_fs.cat(f"{s3_bucket}/k") == b"v"


def test_kill_and_restart_same_port():
    with S3Server() as srv:
        url, moto_port = srv.endpoint_url, srv.port
        fs = srv.s3fs(retries=1)
        fs.mkdir("keepme")
        fs.pipe("keepme/k", b"v")

        srv.stop(preserve=True)  # snapshot completed objects, then SIGKILL
        assert not srv.is_running
        with pytest.raises(botocore_exceptions.EndpointConnectionError):
            fs.cat("keepme/k")
        srv.start()
        assert (srv.endpoint_url, srv.port) == (url, moto_port)
        assert fs.cat("keepme/k") == b"v"  # the old client reconnects by itself

        srv.stop()  # plain crash: moto's in-memory state is gone
        srv.start()
        assert srv.starts == 3
        with pytest.raises(FileNotFoundError):
            fs.cat("keepme/k")


def test_dcp_fsspec_writer_reader_roundtrip(s3_server, s3_bucket):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = s3_server.storage_options(retries=1)
    url = f"s3://{s3_bucket}/ckpt"
    sd = {"w": torch.randn(32, 32), "b": torch.arange(10), "step": 7}
    # storage options are FsspecWriter(**kwargs) -> url_to_fs(path, **kwargs)
    dcp.save(sd, storage_writer=FsspecWriter(url, **opts))
    fs = s3_server.s3fs(retries=1)
    assert sorted(fs.ls(f"{s3_bucket}/ckpt")) == [
        f"{s3_bucket}/ckpt/.metadata",
        f"{s3_bucket}/ckpt/__0_0.distcp",
    ]

    out = {"w": torch.zeros(32, 32), "b": torch.zeros(10, dtype=torch.long), "step": 0}
    dcp.load(out, storage_reader=FsspecReader(url, **opts))
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 7

    # Gotcha: passing checkpoint_id as well makes DCP call writer.reset(checkpoint_id) ->
    # init_path(checkpoint_id) WITHOUT the kwargs, i.e. a default s3fs (no endpoint, no
    # keys).  Checked without I/O: a default client would look for credentials (and, were
    # the s3_server fixture's AWS_* safety-net env vars absent, probe the EC2 metadata IP).
    w = FsspecWriter(url, **opts)
    assert w.fs.fs.endpoint_url == s3_server.endpoint_url
    w.reset(f"{url}2")
    assert w.fs.fs.endpoint_url is None and w.fs.fs.key is None


@pytest.mark.skipif(not os.environ.get("S3_BENCH"), reason="set S3_BENCH=1 to run")
def test_bench_put_256mib(s3_server, s3_bucket, tmp_path, capsys):
    src = tmp_path / "blob"
    with open(src, "wb") as f:
        for _ in range(256):
            f.write(os.urandom(MiB))
    for label, fs in (("direct", s3_server.s3fs(direct=True)), ("proxy", s3_server.s3fs())):
        t = time.perf_counter()
        fs.put(str(src), f"{s3_bucket}/{label}")
        dt = time.perf_counter() - t
        t = time.perf_counter()
        fs.get(f"{s3_bucket}/{label}", str(tmp_path / "back"))
        dg = time.perf_counter() - t
        assert fs.info(f"{s3_bucket}/{label}")["size"] == 256 * MiB
        with capsys.disabled():
            print(
                f"\n[bench] s3fs 256 MiB {label}: put {dt:.2f}s ({256 / dt:.0f} MiB/s), get {dg:.2f}s ({256 / dg:.0f} MiB/s)"
            )
        fs.rm(f"{s3_bucket}/{label}")


def test_seaweedfs_s3_and_its_filer_as_a_mounted_file_system(seaweed, seaweed_bucket, seaweed_fs, tmp_path):
    """SeaweedFS (fixture ``seaweed``): multipart and ranged reads through S3, and ``weed mount`` of
    its filer, the stand-in of a parallel file system: what is written through the mount reads
    back, and shows in S3 under the bucket's directory."""
    from dcp_nvme_harness.seaweed import fuse_unavailable

    data = os.urandom(11 * MiB)
    with seaweed_fs.open(f"{seaweed_bucket}/big.bin", "wb", block_size=5 * MiB) as f:
        f.write(data)
    assert seaweed_fs.cat_file(f"{seaweed_bucket}/big.bin", start=5 * MiB - 3, end=5 * MiB + 3) == \
        data[5 * MiB - 3:5 * MiB + 3]
    if fuse_unavailable():
        pytest.skip(fuse_unavailable())
    with seaweed.mount(tmp_path / "pfs") as mnt:
        target = mnt.mountpoint / "buckets" / seaweed_bucket / "via-fuse.bin"
        target.write_bytes(data[:MiB])
        assert target.read_bytes() == data[:MiB]
        assert (mnt.mountpoint / "buckets" / seaweed_bucket / "big.bin").read_bytes() == data
    assert not os.path.ismount(tmp_path / "pfs")
    seaweed_fs.invalidate_cache()
    assert seaweed_fs.cat(f"{seaweed_bucket}/via-fuse.bin") == data[:MiB]
