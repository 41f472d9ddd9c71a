"""Engine selection, the kvikio engine's planning (against a fake cuFile), the device crc32c, and
the POSIX engine's bounce pipeline for device memory, all on the CPU.

The fake kvikio module below moves bytes with os.pwrite/os.pread from host memory, so the
engine's windowing, queue-depth bound, truncation, checksums and read scatter run for real; only
the device is simulated (``FakeDeviceEngine`` treats CPU tensors as device tensors).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.warm import warm_python

import dcp_nvme.engines as engines
import dcp_nvme.engines.host_io
import dcp_nvme.engines.host_io as files
import dcp_nvme.engines.kvikio as kv
import dcp_nvme.engines.posix as posix
import dcp_nvme.engines.posix as windows
import dcp_nvme.format.device_checksums as device_checksums
from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.config import IOConfig
from dcp_nvme.errors import ChecksumMismatchError, DCPNVMeError, EngineUnavailableError
from dcp_nvme.format.container import ItemSpec, plan_container
from dcp_nvme.load.planning import FileBlocks, Need, plan_reads

ROOT = Path(__file__).resolve().parents[2]

# Captured on this CPU machine (kvikio-cu13 26.10.0 in a scratch venv, no libcuda.so.1):
# `import kvikio` succeeds; the first CuFile.pwrite, host or device buffer, compat mode on or off,
# raises RuntimeError with exactly this text.
LIBCUDA_ERROR = ("KvikIO failure at: /__w/kvikio/kvikio/cpp/src/shim/utils.cpp:21: libcuda.so.1: "
                 "cannot open shared object file: No such file or directory")
# Not captured (needs a GPU without nvidia-fs and compat mode off): kvikio's format
# "cuFile error at: <file>:<line>: " + cuFile's text for CU_FILE_DRIVER_NOT_INITIALIZED.
DRIVER_ERROR = ("cuFile error at: /__w/kvikio/kvikio/cpp/src/shim/cufile.cpp:52: "
                "nvidia-fs driver is not loaded")


# --------------------------------------------------------------------------- fakes


def _host_view(buf: torch.Tensor, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(buf.data_ptr())).cast("B")


class _Done:
    def __init__(self, value: int, wait=None) -> None:
        self.value, self.wait = value, wait

    def get(self) -> int:
        if self.wait:
            self.wait()
        return self.value


class FakeKvikio(types.ModuleType):
    """kvikio's Python surface (CuFile, IOFuture.get, defaults) over os.pwrite/os.pread."""

    def __init__(self, fail: str | None = None, delay: float = 0.0, hang: float = 0.0) -> None:
        super().__init__("kvikio")
        self.__version__ = "0.0-fake"
        self.fail, self.delay, self.hang = fail, delay, hang
        self.calls: list[tuple[str, int, int, int]] = []  # (op, offset, size, task_size)
        self.opens: list[tuple[str, str]] = []
        self.inflight = 0
        self.max_inflight = 0
        self.lock = threading.Lock()
        self.threads = 1
        fake = self

        class Defaults:
            @staticmethod
            def get(name):
                assert name == "num_threads"
                return fake.threads

            @staticmethod
            def set(name, value):
                assert name == "num_threads"
                fake.threads = value

            @staticmethod
            def is_compat_mode_preferred():
                return True

        self.defaults = Defaults

        class CuFile:
            def __init__(self, path, flags="r"):
                if fake.hang:
                    time.sleep(fake.hang)
                fake.opens.append((os.fspath(path), flags))
                mode = {"r": os.O_RDONLY, "r+": os.O_RDWR, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}
                self.fd = os.open(path, mode[flags], 0o644)

            def fileno(self):
                return self.fd

            def close(self):
                os.close(self.fd)

            def _io(self, op, buf, size, offset, task_size):
                if fake.fail:
                    raise RuntimeError(fake.fail)
                fake.calls.append((op, offset, size, task_size))
                with fake.lock:
                    fake.inflight += 1
                    fake.max_inflight = max(fake.max_inflight, fake.inflight)
                try:
                    time.sleep(fake.delay)
                    view = _host_view(buf, size)
                    if op == "write":
                        done = os.pwrite(self.fd, view, offset)
                    else:
                        done = os.preadv(self.fd, [view], offset)
                finally:
                    with fake.lock:
                        fake.inflight -= 1
                return _Done(done)

            def pwrite(self, buf, size=None, file_offset=0, task_size=None):
                return self._io("write", buf, size, file_offset, task_size)

            def pread(self, buf, size=None, file_offset=0, task_size=None):
                return self._io("read", buf, size, file_offset, task_size)

        self.CuFile = CuFile


class FakeDeviceEngine(kv.KvikioEngine):
    """Treats CPU tensors flagged in ``device_ids`` (all when None) as device memory."""

    device_ids: set[int] | None = None

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return self.device_ids is None or tensor.data_ptr() in self.device_ids


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA reported available, the probe buffer on the CPU, fresh caches."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dcp_nvme.engines.host_io, "cuda_available", lambda: False)  # no pinned allocator here
    monkeypatch.setattr(kv, "_probe_tensor", lambda n: (torch.arange(n) % 251).to(torch.uint8))
    monkeypatch.setattr(engines, "_ENGINE_CACHE", {})
    engines.reset_probe_cache()
    yield
    engines.reset_probe_cache()


def install(monkeypatch, module) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", module)


# --------------------------------------------------------------------------- selection


def test_posix_requested_and_auto_without_device_tensors():
    engine, reason = engines.select_engine(IOConfig(engine="posix"), True)
    assert (engine.name, reason) == ("posix", "requested")
    engine, reason = engines.select_engine(IOConfig(), False)
    assert (engine.name, reason) == ("posix", "auto: no device tensors")


def test_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine, reason = engines.select_engine(IOConfig(), True)
    assert engine.name == "posix" and "no CUDA" in reason
    with pytest.raises(EngineUnavailableError, match="engine='kvikio' cannot run here: no CUDA"):
        engines.select_engine(IOConfig(engine="kvikio"), True)


def test_kvikio_not_installed(monkeypatch, fake_cuda):
    install(monkeypatch, None)  # makes `import kvikio` raise ImportError
    engine, reason = engines.select_engine(IOConfig(), True)
    assert engine.name == "posix" and reason.startswith("auto: no kvikio") and "dcp_nvme[gds]" in reason
    with pytest.raises(EngineUnavailableError, match="no kvikio"):
        engines.select_engine(IOConfig(engine="kvikio"), False)


def test_kvikio_import_error_other_than_missing(monkeypatch, fake_cuda):
    def broken():
        raise OSError("libkvikio.so: cannot open shared object file")

    monkeypatch.setattr(kv, "import_kvikio", broken)
    with pytest.raises(EngineUnavailableError, match="kvikio failed to import: OSError: libkvikio.so"):
        engines.select_engine(IOConfig(engine="kvikio"), True)


@pytest.mark.parametrize("text, named", [
    (LIBCUDA_ERROR, "libcuda missing"),
    (DRIVER_ERROR, "cuFile driver refused"),
    ("something else", "kvikio probe I/O failed"),
])
def test_probe_failure_names_what_is_missing(monkeypatch, fake_cuda, tmp_path, text, named):
    install(monkeypatch, FakeKvikio(fail=text))
    with pytest.raises(EngineUnavailableError) as caught:
        engines.select_engine(IOConfig(engine="kvikio"), True, str(tmp_path))
    message = str(caught.value)
    assert named in message and text in message  # kvikio's own words are kept
    engine, reason = engines.select_engine(IOConfig(), True, str(tmp_path))
    assert engine.name == "posix" and named in reason
    assert os.listdir(tmp_path) == []  # the probe file is removed


def test_probe_runs_once_per_directory(monkeypatch, fake_cuda, tmp_path):
    fake = FakeKvikio()
    install(monkeypatch, fake)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    for _ in range(3):
        engine, reason = engines.select_engine(IOConfig(), True, str(one))
        assert engine.name == "kvikio" and reason == "auto: device tensors, kvikio 0.0-fake, compat mode"
    assert [p for p, _ in fake.opens] and {os.path.dirname(p) for p, _ in fake.opens} == {str(one)}
    assert len(fake.opens) == 2  # one probe: write then read back
    engines.select_engine(IOConfig(engine="kvikio"), True, str(two))
    assert len(fake.opens) == 4
    assert fake.calls[0][0] == "write" and fake.calls[1][0] == "read"


def test_probe_that_hangs_times_out(monkeypatch, fake_cuda, tmp_path):
    install(monkeypatch, FakeKvikio(hang=5))
    monkeypatch.setattr(kv, "PROBE_TIMEOUT", 0.2)
    started = time.perf_counter()
    engine, reason = engines.select_engine(IOConfig(), True, str(tmp_path))
    assert engine.name == "posix" and "did not finish within 0.2 s" in reason
    assert time.perf_counter() - started < 3


def test_a_verify_off_reader_reuses_the_writers_engine_and_buffers(monkeypatch, tmp_path):
    """Engines read only queue_depth, block_size and direct_io: verify must not split the cache."""
    monkeypatch.setattr(engines, "_ENGINE_CACHE", {})
    # more than one block_size: a container of one request would skip the engine (engines.small)
    state = {"w": torch.randn(1200, 257), "step": torch.tensor(7)}
    options = {"engine": "posix", "queue_depth": 2, "block_size": "1MiB"}
    dcp.save(state, storage_writer=NVMeWriter(tmp_path, **options), no_dist=True)
    (engine,) = engines._ENGINE_CACHE.values()
    pool = engine._pool  # the save allocated it (the header goes through a bounce buffer)
    assert pool is not None
    for verify in (True, False):
        out = {"w": torch.zeros(1200, 257), "step": torch.tensor(0)}
        dcp.load(out, storage_reader=NVMeReader(tmp_path, verify=verify, **options), no_dist=True)
        assert torch.equal(out["w"], state["w"]) and int(out["step"]) == 7
    assert list(engines._ENGINE_CACHE.values()) == [engine] and engine._pool is pool
    other, _ = engines.shared_engine(IOConfig(engine="posix", queue_depth=3, block_size=1 << 20), False)
    assert other is not engine  # a knob the engine does read gets its own


@pytest.mark.parametrize("make", [posix.PosixEngine, kv.KvikioEngine])
def test_engines_pickle_as_their_config_only(make, tmp_path):
    import pickle

    config = IOConfig(queue_depth=3, block_size=1 << 20, direct_io=False)
    engine = make(config)
    engine.write_file(str(tmp_path / "f"), bytes(4096), [torch.arange(10, dtype=torch.uint8)], 4096)
    copy = pickle.loads(pickle.dumps(engine))
    assert type(copy) is make and copy.config == config
    assert pickle.dumps(copy) == pickle.dumps(make(config))  # no buffers travel


def test_no_selection_at_import_time():
    """With a kvikio that explodes on any use, importing every dcp_nvme module still works."""
    code = """
import sys, types
class Poison(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):  # inspect and friends probe every module's dunders
            raise AttributeError(name)
        raise AssertionError("kvikio touched at import time: " + name)
sys.modules["kvikio"] = Poison("kvikio")
import torch
torch.cuda.is_available = lambda: (_ for _ in ()).throw(AssertionError("CUDA queried at import"))
import dcp_nvme, dcp_nvme.engines, dcp_nvme.engines.kvikio, dcp_nvme.save.writer, dcp_nvme.load.reader
from dcp_nvme import NVMeWriter, NVMeReader
NVMeWriter("/tmp/x", engine="kvikio"); NVMeReader("/tmp/x", engine="kvikio")
print("imported")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


# --------------------------------------------------------------------------- device crc32c


@pytest.mark.parametrize("size, block", [
    (0, 4096), (1, 4096), (255, 256), (4096, 4096), (10_000, 4096), (3 << 20, 1 << 20),
    ((1 << 20) + 12_345, 1 << 20),
])
def test_device_crc32c_matches_the_library(size, block):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    raw = data.numpy().tobytes()
    expected = [crc32c.crc32c(raw[i : i + block]) for i in range(0, size, block)]
    assert device_checksums.device_crc32c(data, block) == expected


def test_device_crc32c_rejects_bad_input():
    with pytest.raises(ValueError, match="flat uint8"):
        device_checksums.device_crc32c(torch.zeros(4, dtype=torch.int32), 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        device_checksums.device_crc32c(torch.zeros(4, dtype=torch.uint8), 100)


# --------------------------------------------------------------------------- kvikio engine on a fake cuFile


def _sources(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]


def _header(sizes):
    items = [ItemSpec(f"t{i}", n, "U8", (n,)) for i, n in enumerate(sizes)]
    return plan_container(items, {"format": "test"}).header


SIZES = [
    [100_000],  # one tensor, unaligned tail
    [3 * 65_536],  # aligned, several windows, each one span of one tensor
    [1, 0, 5_000, 70_000, 3, 65_536 * 2 + 7, 0, 9_999],  # scattered: gathered windows
]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("direct", [False, True])
def test_kvikio_write_is_byte_identical_to_posix(monkeypatch, tmp_path, sizes, direct):
    config = IOConfig(queue_depth=3, block_size=65_536, direct_io=direct)
    sources, header = _sources(sizes), _header(sizes)
    block = config.checksum_block
    reference = posix.PosixEngine(config).write_file(str(tmp_path / "p.bin"), header, sources, block)
    fake = FakeKvikio()
    fsynced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(fd), real_fsync(fd)))
    engine = FakeDeviceEngine(config, kvikio_module=fake)
    result = engine.write_file(str(tmp_path / "k.bin"), header, sources, block)
    assert (tmp_path / "k.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    assert result.size == reference.size == os.path.getsize(tmp_path / "k.bin")
    assert result.crcs == reference.crcs and result.header_crc == reference.header_crc
    assert fsynced, "the kvikio engine must fsync before reporting the write done"
    data = sum(sizes)
    writes = [c for c in fake.calls if c[0] == "write"]
    assert sum(size for _, _, size, _ in writes) == data  # every data byte, once, via cuFile
    assert all(task == config.block_size for *_, task in writes)  # one kvikio task per request
    assert all(offset % 4096 == 0 and size <= config.block_size for _, offset, size, _ in writes)
    assert result.stats.bytes == data and 1 <= result.stats.max_inflight <= 3
    assert engine.device_bytes["write"] == data
    assert fake.opens == [(str(tmp_path / "k.bin"), "r+")]  # header written first, never truncated


@pytest.mark.parametrize("direct", [False, True])
def test_kvikio_write_mixed_host_and_device(tmp_path, direct):
    """Host-only windows go through the POSIX path, windows touching device memory through cuFile;
    an unaligned host tail written with O_DIRECT is padded, then truncated to the exact size."""
    config = IOConfig(queue_depth=2, block_size=65_536, direct_io=direct)
    sizes = [65_536, 65_536, 1_000, 65_536 - 1_000, 65_536, 5_000]
    sources, header = _sources(sizes, seed=1), _header(sizes)
    reference = posix.PosixEngine(config).write_file(str(tmp_path / "p.bin"), header, sources, 65_536)
    fake = FakeKvikio()
    engine = FakeDeviceEngine(config, kvikio_module=fake)
    engine.device_ids = {sources[1].data_ptr(), sources[3].data_ptr()}
    result = engine.write_file(str(tmp_path / "k.bin"), header, sources, 65_536)
    assert (tmp_path / "k.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    assert result.crcs == reference.crcs and result.size == os.path.getsize(tmp_path / "k.bin")
    start = len(header)
    # windows 1 (device) and 2 (host 1000 B + device) via cuFile; 0, 3 and 4 (host) via POSIX
    assert sorted(offset - start for op, offset, _, _ in fake.calls) == [65_536, 2 * 65_536]


def test_kvikio_write_of_host_only_sources_is_posix(tmp_path):
    fake = FakeKvikio()
    engine = kv.KvikioEngine(IOConfig(block_size=65_536, direct_io=False), kvikio_module=fake)
    sizes = [10_000, 20_000]
    engine.write_file(str(tmp_path / "k.bin"), _header(sizes), _sources(sizes), 65_536)
    assert fake.calls == [] and fake.opens == []


def test_kvikio_queue_depth_bound(tmp_path):
    fake = FakeKvikio(delay=0.02)
    config = IOConfig(queue_depth=3, block_size=65_536, direct_io=False)
    engine = FakeDeviceEngine(config, kvikio_module=fake)
    sizes = [12 * 65_536]
    result = engine.write_file(str(tmp_path / "k.bin"), _header(sizes), _sources(sizes), 65_536)
    assert fake.threads >= 3  # kvikio's pool has room for every request we keep in flight
    assert 2 <= fake.max_inflight <= 3
    assert result.stats.max_inflight <= 3 and result.stats.requests == 12


def test_kvikio_write_error_names_the_file(tmp_path):
    engine = FakeDeviceEngine(IOConfig(block_size=65_536, direct_io=False),
                              kvikio_module=FakeKvikio(fail=LIBCUDA_ERROR))
    with pytest.raises(OSError, match=r"kvikio write of 1000 bytes at offset \d+ failed.*libcuda"):
        engine.write_file(str(tmp_path / "k.bin"), _header([1000]), _sources([1000]), 65_536)


def _written(tmp_path, sizes, block=65_536):
    config = IOConfig(block_size=block, direct_io=False)
    sources = _sources(sizes, seed=7)
    path = str(tmp_path / "data.bin")
    result = posix.PosixEngine(config).write_file(path, _header(sizes), sources, config.checksum_block)
    return path, sources, result


def _plan(path, result, needs, verify=True):
    blocks = FileBlocks(result.data_start, result.size - result.data_start, result.checksum_block,
                        result.crcs) if verify else None
    return plan_reads(path, needs, max_request=65_536, blocks=blocks)


@pytest.mark.parametrize("verify", [True, False])
def test_kvikio_read_scatters_into_device_and_host_dests(tmp_path, verify):
    sizes = [150_000, 3, 70_000, 65_536]
    path, sources, result = _written(tmp_path, sizes)
    dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    needs, offset = [], result.data_start
    for index, n in enumerate(sizes):
        needs.append(Need(offset, n, index, 0))
        offset += n
    fake = FakeKvikio()
    engine = FakeDeviceEngine(IOConfig(queue_depth=2, block_size=65_536, direct_io=False),
                              kvikio_module=fake)
    engine.device_ids = {dests[0].data_ptr(), dests[2].data_ptr()}  # 1 and 3 stay host
    stats = engine.read(_plan(path, result, needs, verify), dests)
    for dest, source in zip(dests, sources):
        assert torch.equal(dest, source)
    assert fake.calls and all(op == "read" for op, *_ in fake.calls)
    assert stats.bytes >= sum(sizes) and stats.max_inflight <= 2
    assert engine.device_bytes["read"] > 0


def test_kvikio_read_of_a_slice_goes_straight_to_the_dest(tmp_path):
    path, sources, result = _written(tmp_path, [200_000])
    dest = torch.zeros(65_536, dtype=torch.uint8)
    fake = FakeKvikio()
    engine = FakeDeviceEngine(IOConfig(block_size=65_536, direct_io=False), kvikio_module=fake)
    requests = _plan(path, result, [Need(result.data_start + 65_536, 65_536, 0, 0)])
    assert len(requests) == 1 and len(requests[0].pieces) == 1
    stats = engine.read(requests, [dest])
    assert torch.equal(dest, sources[0][65_536 : 2 * 65_536])
    assert stats.copied_bytes == 0  # no staging buffer


def test_kvikio_read_detects_corruption(tmp_path):
    path, _, result = _written(tmp_path, [200_000])
    with open(path, "r+b") as f:
        f.seek(result.data_start + 70_000)
        f.write(b"\xff\x00\xff")
    dest = torch.zeros(200_000, dtype=torch.uint8)
    engine = FakeDeviceEngine(IOConfig(block_size=65_536, direct_io=False), kvikio_module=FakeKvikio())
    with pytest.raises(ChecksumMismatchError) as caught:
        engine.read(_plan(path, result, [Need(result.data_start, 200_000, 0, 0)]), [dest])
    lo = result.data_start + 65_536
    assert (caught.value.start, caught.value.end) == (lo, lo + 65_536) and caught.value.path == path


def test_kvikio_read_of_a_truncated_file(tmp_path):
    path, _, result = _written(tmp_path, [200_000])
    os.truncate(path, result.data_start + 100_000)
    dest = torch.zeros(200_000, dtype=torch.uint8)
    engine = FakeDeviceEngine(IOConfig(block_size=65_536, direct_io=False), kvikio_module=FakeKvikio())
    with pytest.raises(DCPNVMeError, match="is truncated"):
        engine.read(_plan(path, result, [Need(result.data_start, 200_000, 0, 0)]), [dest])


# --------------------------------------------------------------------------- through DCP, both ways


def _state_dict():
    gen = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(300, 257, generator=gen).to(torch.bfloat16),
        "b": torch.randn(1000, generator=gen),
        "i": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "empty": torch.empty(0, 5),
        "step": 7,
    }


def _blank(sd):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


@pytest.mark.parametrize("write_engine, read_engine", [("kvikio", "posix"), ("posix", "kvikio")])
def test_cross_engine_checkpoints(monkeypatch, fake_cuda, tmp_path, write_engine, read_engine):
    """The format does not depend on the engine: written by one, loaded (verified) by the other."""
    fake = FakeKvikio()
    install(monkeypatch, fake)
    monkeypatch.setattr(kv.KvikioEngine, "_on_device", lambda self, t: True)
    sd = _state_dict()
    options = dict(block_size=65_536, direct_io=False)
    writer = NVMeWriter(tmp_path, engine=write_engine, **options)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert writer.last_stats["engine"] == write_engine
    assert writer.last_stats["engine_reason"].startswith("requested")
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc["ranks"][0]["engine"] == write_engine
    back = _blank(sd)
    dcp.load(back, storage_reader=NVMeReader(tmp_path, engine=read_engine, **options), no_dist=True)
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert back[key] == value
    ops = {op for op, *_ in fake.calls}
    assert ops >= {"write" if write_engine == "kvikio" else "read"}


# --------------------------------------------------------------------------- POSIX bounce pipeline


def test_posix_device_bounce_overlaps_copy_and_write(monkeypatch, tmp_path):
    """Device sources (no host address) are staged through the bounce buffers: the copy of block
    k+1 runs while block k is being written (double buffering), and the file is byte-identical."""
    config = IOConfig(queue_depth=2, block_size=65_536, direct_io=False)
    sizes = [5 * 65_536 + 100]
    sources, header = _sources(sizes, seed=5), _header(sizes)
    reference = posix.PosixEngine(config).write_file(str(tmp_path / "ref.bin"), header, sources, 65_536)

    data_start = len(header)
    copy_of = {}  # window index -> Event set when its device copy starts
    overlapped = []
    real_copy, real_pwrite = windows.copy_bytes, windows.pwritev_all
    copy_offsets = iter(range(0, sum(sizes), 65_536))

    def fake_device_copy(dst, src):  # stands in for a CUDA -> pinned copy_
        window = next(copy_offsets) // 65_536
        copy_of.setdefault(window, threading.Event()).set()
        real_copy(dst, src)

    def slow_pwrite(fd, view, offset):
        if offset >= data_start:
            window = (offset - data_start) // 65_536
            nxt = copy_of.setdefault(window + 1, threading.Event())
            if window + 1 < 6:  # block k's write waits to see block k+1's copy begin
                overlapped.append(nxt.wait(timeout=5))
        real_pwrite(fd, view, offset)

    monkeypatch.setattr(windows, "host_address", lambda tensor: None)  # as if on a device
    monkeypatch.setattr(windows, "copy_bytes", fake_device_copy)
    monkeypatch.setattr(windows, "pwritev_all", slow_pwrite)
    result = posix.PosixEngine(config).write_file(str(tmp_path / "dev.bin"), header, sources, 65_536)
    assert (tmp_path / "dev.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert result.crcs == reference.crcs
    assert overlapped == [True] * 5
    assert result.stats.copied_bytes == sum(sizes)


# --------------------------------------------------------------------------- the GPU check script


@pytest.mark.slow  # other processes
def test_gpu_check_exits_cleanly_without_cuda(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = warm_python().run(["-m", "integration.gpu_check"], timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "no CUDA" in done.stdout and "0 passed, 0 failed" in done.stdout
    assert "Traceback" not in done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cuda"] is False and report["passed"] == 0
    strict = warm_python().run(["-m", "integration.gpu_check", "--require-cuda"], timeout=120, env=env, cwd=ROOT)
    assert strict.returncode == 1


@pytest.mark.parametrize("direct", [False, True])
def test_open_for_reading_refuses_fifo_and_link(tmp_path: Path, direct: bool) -> None:
    """A FIFO or symlink where a container should be is refused at once (no hang, no follow)."""
    from dcp_nvme.config import IOConfig
    from dcp_nvme.errors import ManifestError

    config = IOConfig(read_mode="direct" if direct else "buffered")
    fifo = tmp_path / "__0_0.distcp"
    os.mkfifo(fifo)
    with pytest.raises(ManifestError, match="regular"):
        files.open_for_reading(str(fifo), config)
    (tmp_path / "real").write_bytes(b"x" * 4096)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    with pytest.raises(ManifestError, match="regular"):
        files.open_for_reading(str(link), config)
    fd, _ = files.open_for_reading(str(tmp_path / "real"), config)
    os.close(fd)


def test_run_bounded_runs_a_lone_task_on_the_calling_thread():
    """A small save or load (one request) starts no thread; two or more go to the pool."""
    from dcp_nvme.engines.requests import run_bounded

    here = threading.current_thread().name
    ran: list[tuple[int, str]] = []
    run_bounded(4, iter([7]), lambda task: ran.append((task, threading.current_thread().name)), peek=True)
    assert ran == [(7, here)]
    ran.clear()
    run_bounded(4, iter([1, 2, 3]), lambda task: ran.append((task, threading.current_thread().name)), peek=True)
    assert sorted(task for task, _ in ran) == [1, 2, 3] and all(n.startswith("dcp-nvme-io") for _, n in ran)
    run_bounded(4, iter([]), lambda task: ran.append((task, "none")), peek=True)
    assert len(ran) == 3

    def fail(task: int) -> None:
        raise OSError(5, f"request {task} failed")

    for tasks in ([1], [1, 2]):
        with pytest.raises(OSError, match="request 1 failed"):
            run_bounded(4, tasks, fail, peek=True)


def test_run_bounded_draws_no_task_before_the_one_before_it_started():
    """Without ``peek`` a producer may wait on the work: the drain draws the pieces of a file
    still being coded, and the coder waits for the first piece to be sent."""
    from dcp_nvme.engines.requests import run_bounded

    started = threading.Event()

    def pieces():
        yield 1
        assert started.wait(10), "the second task was drawn before the first one started"
        yield 2

    ran: list[int] = []
    run_bounded(2, pieces(), lambda task: (started.set(), ran.append(task)))
    assert sorted(ran) == [1, 2]
