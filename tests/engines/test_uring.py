"""The io_uring engine: byte-identical containers to the threads engine, every source shape,
reads with verification, truncation, and the fallback when the kernel refuses io_uring (a real
seccomp filter in a child process, not a mock)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.config import IOConfig, resolve_config
from dcp_nvme.engines.host_io import aligned_buffer
from dcp_nvme.engines.posix import PosixEngine
from dcp_nvme.engines.uring import UringEngine, uring_unavailable_reason
from dcp_nvme.errors import DCPNVMeError
from dcp_nvme.format.container import ItemSpec, plan_container
from dcp_nvme.load.planning import FileBlocks, Need, plan_reads

ROOT = Path(__file__).resolve().parents[2]

needs_uring = pytest.mark.skipif(uring_unavailable_reason() is not None,
                                 reason=f"io_uring unavailable: {uring_unavailable_reason()}")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "aligned": torch.randn(256, 1024, generator=g),          # 1 MiB, page-sized
        "unaligned": torch.randn(1001, 3, generator=g).to(torch.bfloat16),
        "tiny": torch.tensor([7], dtype=torch.int8),
        "empty": torch.empty(0, 5),
        "big": torch.randn(600_001, generator=g),                 # several requests, odd tail
    }


def _content(path: Path) -> tuple[dict, bytes]:
    """A container's tensor entries and data region (the per-save key in its metadata differs)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__")
    return header, raw[8 + length :]


@needs_uring
@pytest.mark.parametrize("direct_io", [True, False])
def test_uring_checkpoint_matches_threads_engine(tmp_path, direct_io):
    """Same state saved by both engines: identical container bytes; each loads the other's."""
    sd = _state()
    options = dict(block_size=65_536, queue_depth=4, direct_io=direct_io)
    for engine in ("uring", "posix"):
        writer = NVMeWriter(tmp_path / engine, engine=engine, **options)
        dcp.save(sd, storage_writer=writer, no_dist=True)
        assert writer.last_stats["engine"] == engine
    files = {e: sorted((tmp_path / e).glob("*.safetensors")) for e in ("uring", "posix")}
    assert [_content(p) for p in files["uring"]] == [_content(p) for p in files["posix"]]
    for write_engine, read_engine in (("uring", "uring"), ("posix", "uring"), ("uring", "posix")):
        back = {k: torch.full_like(v, 1) for k, v in sd.items()}
        reader = NVMeReader(tmp_path / write_engine, engine=read_engine, **options)
        dcp.load(back, storage_reader=reader, no_dist=True)
        for key, value in sd.items():
            assert torch.equal(back[key], value), (write_engine, read_engine, key)


def _header(sizes):
    return plan_container([ItemSpec(f"t{i}", n, "U8", (n,)) for i, n in enumerate(sizes)], {}).header


@needs_uring
def test_uring_write_zero_copy_and_bounced_crcs_match(tmp_path):
    """An aligned arena goes out from its own memory (nothing copied); scattered tensors bounce;
    the crcs and bytes agree with the threads engine either way."""
    config = IOConfig(queue_depth=3, block_size=65_536, direct_io=True)
    arena = aligned_buffer(5 * 65_536, pin=False)
    arena.copy_(torch.randint(0, 256, (arena.numel(),), dtype=torch.uint8))
    scattered = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (10, 70_000, 0, 4096, 3)]
    for sources in ([arena], scattered):
        sizes = [int(s.numel()) for s in sources]
        header = _header(sizes)
        engine = UringEngine(config)
        try:
            got = engine.write_file(str(tmp_path / "u.bin"), header, sources, 65_536)
        finally:
            engine.close()
        ref = PosixEngine(config).write_file(str(tmp_path / "p.bin"), header, sources, 65_536)
        assert got.crcs == ref.crcs and got.size == ref.size
        assert (tmp_path / "u.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
        expect_copied = 0 if sources[0] is arena else sum(sizes)
        assert got.stats.copied_bytes == expect_copied


@needs_uring
def test_uring_read_of_truncated_file_names_it(tmp_path):
    sd = {"x": torch.randn(100_000)}
    dcp.save(sd, storage_writer=NVMeWriter(tmp_path, engine="uring", block_size=65_536), no_dist=True)
    container = next(tmp_path.glob("*.safetensors"))
    with open(container, "r+b") as handle:
        handle.truncate(container.stat().st_size - 5000)
    back = {"x": torch.zeros(100_000)}
    reader = NVMeReader(tmp_path, engine="uring", block_size=65_536)
    with pytest.raises(BaseException) as info:  # DCP wraps it in CheckpointException
        dcp.load(back, storage_reader=reader, no_dist=True)
    assert "truncated" in str(info.value) and container.name in str(info.value)


@needs_uring
def test_uring_read_verifies_checksums(tmp_path):
    """A flipped byte is caught by the uring read path (the same checks as the threads engine)."""
    sizes = [300_000]
    header = _header(sizes)
    source = torch.randint(0, 256, (sizes[0],), dtype=torch.uint8)
    config = IOConfig(queue_depth=2, block_size=65_536, direct_io=True)
    written = PosixEngine(config).write_file(str(tmp_path / "f.bin"), header, [source], 65_536)
    blocks = FileBlocks(written.data_start, sizes[0], 65_536, written.crcs)
    requests = plan_reads(str(tmp_path / "f.bin"), [Need(written.data_start, sizes[0], 0, 0)],
                          max_request=65_536, blocks=blocks)
    dest = torch.zeros(sizes[0], dtype=torch.uint8)
    engine = UringEngine(config)
    try:
        engine.read(requests, [dest])
        assert torch.equal(dest, source)
        with open(tmp_path / "f.bin", "r+b") as handle:
            handle.seek(written.data_start + 200_000)
            handle.write(bytes([source[200_000].item() ^ 0xFF]))
        with pytest.raises(DCPNVMeError):
            engine.read(requests, [torch.zeros_like(dest)])
    finally:
        engine.close()


_SECCOMP_CHILD = textwrap.dedent("""
    import ctypes, json, logging, sys, struct
    import torch, torch.distributed.checkpoint as dcp
    # deny io_uring_setup (425) with EPERM, allow everything else: a real kernel refusal
    def stmt(code, k): return struct.pack("HBBI", code, 0, 0, k)
    def jump(code, k, jt, jf): return struct.pack("HBBI", code, jt, jf, k)
    prog = (stmt(0x20, 0) + jump(0x15, 425, 0, 1) + stmt(0x06, 0x00050000 | 1)
            + stmt(0x06, 0x7FFF0000))
    buf = ctypes.create_string_buffer(prog)
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
    from dcp_nvme import NVMeReader, NVMeWriter
    sd = {"w": torch.arange(100_000, dtype=torch.float32)}
    writer = NVMeWriter(sys.argv[1], engine="uring", block_size=65536)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    back = {"w": torch.zeros(100_000)}
    dcp.load(back, storage_reader=NVMeReader(sys.argv[1], engine="uring"), no_dist=True)
    print("RESULT", json.dumps({"engine": writer.last_stats["engine"],
                                "reason": writer.last_stats["engine_reason"],
                                "equal": bool(torch.equal(back["w"], sd["w"]))}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux only")
def test_uring_refused_by_seccomp_falls_back_to_threads_with_a_warning(tmp_path):
    result = subprocess.run([sys.executable, "-c", _SECCOMP_CHILD, str(tmp_path / "ckpt")],
                            capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    warning = [line for line in lines if line.startswith("WARNING") and "uring" in line]
    assert warning and "Operation not permitted" in warning[0] and "threads engine" in warning[0]
    outcome = json.loads(next(line for line in lines if line.startswith("RESULT"))[7:])
    assert outcome["engine"] == "posix" and outcome["equal"]
    assert "unavailable" in outcome["reason"] and "io_uring_setup failed" in outcome["reason"]
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["ranks"][0]["engine"] == "posix"


def test_uring_is_refused_off_x86_64_with_the_reason(monkeypatch):
    """A CPU the ring's memory ordering is not written for reports io_uring unavailable
    (and ``engine='uring'`` then falls back, as in the seccomp test)."""
    import dcp_nvme.engines.ring as ring

    monkeypatch.setattr(ring.platform, "machine", lambda: "aarch64")
    reason = ring.unavailable_reason()
    assert reason is not None and "x86_64 only" in reason


def test_pick_host_engine_needs_throughput_and_less_cpu():
    from dcp_nvme.tune.probe import pick_host_engine

    posix = {"write_gbps": 2.0, "cpu_seconds_per_gb": 0.30}
    assert pick_host_engine({"posix": posix, "uring": {"write_gbps": 2.0, "cpu_seconds_per_gb": 0.1}}) == "uring"
    assert pick_host_engine({"posix": posix, "uring": {"write_gbps": 1.5, "cpu_seconds_per_gb": 0.1}}) == "posix"
    assert pick_host_engine({"posix": posix, "uring": {"write_gbps": 2.5, "cpu_seconds_per_gb": 0.4}}) == "posix"
    assert pick_host_engine({"posix": posix, "uring": {"unavailable": "seccomp"}}) == "posix"


@needs_uring
def test_auto_runs_the_tuned_host_engine(tmp_path, monkeypatch, caplog):
    """A tune file that found io_uring better makes engine='auto' use it for host tensors."""
    tune_file = tmp_path / "tune.json"
    tune_file.write_text(json.dumps({"best": {"host_engine": "uring"}}))
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune_file))
    sd = {"w": torch.randn(10_000)}
    writer = NVMeWriter(tmp_path / "c", block_size=65_536)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert writer.last_stats["engine"] == "uring"
    assert "host_engine=uring" in writer.last_stats["engine_reason"]
    with pytest.raises(ValueError, match="host_engine='threads' from the argument"):
        resolve_config(host_engine="threads")
    tune_file.write_text(json.dumps({"best": {"host_engine": "threads"}}))  # named and skipped
    with caplog.at_level("WARNING", logger="dcp_nvme.config"):
        assert NVMeWriter(tmp_path / "d").config.host_engine == "posix"
    assert f"ignoring host_engine of tune file {tune_file}" in caplog.text
