"""Compressed drains: the mirror holds byte-grouped .dcz files, loads bit for bit (directory and
S3, resharded, ranged), is confirmed like a plain one, and damage is caught."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.cli import main as cli_main
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.tiers import (
    MIRRORED,
    Drainer,
    DrainError,
    DrainOptions,
    codec,
    drain,
    drain_state,
    verify_mirror,
)
from dcp_nvme.tiers.compress_sample import Measure, pays
from dcp_nvme.tiers.drainer import set_drain_hook

MiB = 1 << 20
FAST = dict(part_size=5 * MiB, retries=0, backoff=0.01, max_transfers=3)


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "w_bf16": (torch.randn(1537, 1001, generator=g) * 0.02).to(torch.bfloat16),  # 3 MB, odd size
        "adam_fp32": torch.randn(700_001, generator=g) * 1e-3,
        "fp16": torch.randn(12345, generator=g).to(torch.float16),
        "fp64": torch.randn(999, generator=g, dtype=torch.float64),
        "i64": torch.arange(1001, dtype=torch.int64) * 7 + seed,
        "i8": torch.randint(-128, 127, (3001,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (17,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(4097, generator=g) > 0.5,
        "c64": torch.randn(333, generator=g, dtype=torch.complex64),
        "empty": torch.empty(0, 5),
        "t_view": torch.randn(300, 200, generator=g).t(),  # a non-contiguous source
        "meta": {"step": seed, "note": "compressed"},
    }
    if hasattr(torch, "float8_e4m3fn"):
        sd["f8"] = torch.randn(5001, generator=g).to(torch.float8_e4m3fn)
    return sd


def blank_like(sd: dict) -> dict:
    return {k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else {"step": -1, "note": ""})
            for k, v in sd.items()}


def assert_same(a: dict, b: dict) -> None:
    for key, value in b.items():
        if isinstance(value, torch.Tensor):
            assert a[key].dtype == value.dtype and a[key].shape == value.shape, key
            assert a[key].contiguous().view(torch.uint8).numpy().tobytes() == \
                value.contiguous().view(torch.uint8).numpy().tobytes(), key
        else:
            assert a[key] == value


def save(path, sd: dict) -> str:
    dcp.save(sd, storage_writer=NVMeWriter(str(path)), no_dist=True)
    return str(path)


def load(reader: NVMeReader, sd: dict) -> dict:
    out = blank_like(sd)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def mirror_doc(target) -> dict:
    return json.loads(open(os.path.join(target, MANIFEST)).read())


def test_compressed_drain_to_directory_loads_bit_for_bit(tmp_path):
    sd = make_state()
    local = save(tmp_path / "run" / "step_1", sd)
    target = str(tmp_path / "pfs" / "step_1")
    result = drain(local, target, options=DrainOptions(**FAST, compress="bytegroup"))
    names = sorted(os.listdir(target))
    assert [n for n in names if n.endswith(".safetensors")] == []
    assert len([n for n in names if n.endswith(".safetensors.dcz")]) == 1
    section = mirror_doc(target)["compression"]
    assert section["codec"] == codec.CODEC and section["version"] == codec.CODEC_VERSION
    assert section["ratio"] > 1.05 and result.compression["ratio"] == pytest.approx(section["ratio"], rel=1e-3)
    assert result.bytes_sent == section["stored_bytes"] < section["bytes"]
    assert result.compression["cpu_seconds"] > 0 and result.compression["threads"] >= 1
    assert drain_state(local).state == MIRRORED
    assert not [n for n in os.listdir(local) if n.startswith(".drain-zip")]  # scratch removed
    reader = NVMeReader(target, block_size="1MiB", queue_depth=3)
    assert_same(load(reader, sd), sd)
    assert verify_mirror(local, target).bytes_verified_remote == section["bytes"]


def test_compressed_drain_to_s3_loads_bit_for_bit_with_readback(tmp_path, seaweed, seaweed_bucket, seaweed_fs):
    sd = make_state(3)
    local = save(tmp_path / "run" / "step_3", sd)
    url = f"s3://{seaweed_bucket}/run/step_3"
    result = drain(local, url, filesystem=seaweed_fs,
                   options=DrainOptions(**FAST, compress="bytegroup", verify="readback", codec_threads=2))
    assert result.bytes_verified_remote == result.bytes_sent
    reader = NVMeReader(url, storage_options=seaweed.storage_options(retries=1), block_size="512KiB")
    assert_same(load(reader, sd), sd)
    assert reader.last_stats["requests"] > 3  # ranged reads of the .dcz, not one GET


def _load_columns(rank: int, world: int, mirror: str, expected: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = expected["w_bf16"]
    out = {"w_bf16": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)]),
           "adam_fp32": distribute_tensor(torch.zeros_like(expected["adam_fp32"]), mesh, [Shard(0)])}
    dcp.load(out, storage_reader=NVMeReader(mirror, block_size="256KiB"))
    mine = out["w_bf16"].to_local()
    cols = full.shape[1] // world + (1 if full.shape[1] % world else 0)
    want = full[:, rank * cols: (rank + 1) * cols]
    assert torch.equal(mine.view(torch.int16), want.contiguous().view(torch.int16))
    assert torch.equal(out["adam_fp32"].to_local(), expected["adam_fp32"].chunk(world)[rank])


def test_compressed_mirror_resharded_column_slices(tmp_path):
    sd = make_state(5)
    local = save(tmp_path / "step_5", sd)
    target = str(tmp_path / "mirror")
    drain(local, target, options=DrainOptions(**FAST, compress="bytegroup"))
    run_ranks(2, _load_columns, target, {k: sd[k] for k in ("w_bf16", "adam_fp32")})


def _dcz(target: str) -> str:
    return os.path.join(target, next(n for n in os.listdir(target) if n.endswith(".dcz")))


def test_corrupted_chunk_on_mirror_is_detected(tmp_path):
    sd = make_state(7)
    local = save(tmp_path / "step_7", sd)
    target = str(tmp_path / "mirror")
    drain(local, target, options=DrainOptions(**FAST, compress="bytegroup"))
    path = _dcz(target)
    blob = bytearray(open(path, "rb").read())
    _, count, size, crc = codec.parse_header(blob)
    entries = codec.parse_table(blob[codec.HEADER_SIZE: codec.HEADER_SIZE + count * codec.ENTRY_SIZE],
                                count, size, crc, len(blob))
    victim = max(entries, key=lambda e: e.stored_length)
    blob[victim.stored_offset + victim.stored_length // 2] ^= 0x10
    with open(path, "r+b") as handle:
        handle.write(blob)
    with pytest.raises(CheckpointException) as caught:
        load(NVMeReader(target), sd)
    error = caught.value.failures[0]
    error = error[0] if isinstance(error, tuple) else error  # (exception, traceback)
    assert isinstance(error, codec.CodecError) and os.path.basename(path) in str(error)
    assert f"bytes {victim.offset}-{victim.end}" in str(error)
    with pytest.raises(Exception, match=os.path.basename(path)):
        verify_mirror(local, target)


def test_killed_compressed_drain_resumes_without_resending_confirmed_pieces(tmp_path):
    sd = make_state(9)
    local = save(tmp_path / "step_9", sd)
    target = str(tmp_path / "mirror")
    sent = []

    def crash_after_first(point, info):
        if point == "piece-journaled":
            sent.append(info["piece"])
            raise ConnectionError("link dropped")

    previous = set_drain_hook(crash_after_first)
    try:
        with pytest.raises(DrainError):
            drain(local, target, options=DrainOptions(part_size=1 * MiB, retries=0, max_transfers=1,
                                                      compress="bytegroup"))
    finally:
        set_drain_hook(previous)
    assert sent and not os.path.exists(os.path.join(target, MANIFEST))
    again = drain(local, target, options=DrainOptions(part_size=1 * MiB, retries=0, compress="bytegroup"))
    assert again.bytes_skipped == sent[0].length  # re-encoded identically: the piece was confirmed
    assert_same(load(NVMeReader(target), sd), sd)


def test_plain_then_compressed_drain_leaves_only_the_compressed_files(tmp_path):
    sd = make_state(11)
    local = save(tmp_path / "step_11", sd)
    target = str(tmp_path / "mirror")
    drain(local, target, options=DrainOptions(**FAST))
    assert any(n.endswith(".safetensors") for n in os.listdir(target))
    drain(local, target, options=DrainOptions(**FAST, compress="bytegroup"))
    assert not any(n.endswith(".safetensors") for n in os.listdir(target))
    assert_same(load(NVMeReader(target), sd), sd)
    drain(local, target, options=DrainOptions(**FAST))  # and back to plain
    assert not any(n.endswith(".dcz") for n in os.listdir(target))
    assert "compression" not in mirror_doc(target)
    assert_same(load(NVMeReader(target), sd), sd)


def test_auto_decides_from_codec_and_link():
    fast = Measure(throughput=800e6, ratio=1.4)
    assert pays(fast, 50e6)[0]
    assert not pays(fast, 2e9)[0]                     # the link outruns the codec
    assert not pays(Measure(800e6, 1.0), 50e6)[0]     # nothing to gain
    assert not pays(Measure(800e6, 1.005), 50e6)[0]  # too little to be worth the CPU
    go, why = pays(fast, None)
    assert not go and "unknown" in why


def test_auto_in_a_drain(tmp_path):
    sd = make_state(13)
    local = save(tmp_path / "step_13", sd)
    slow = drain(local, str(tmp_path / "slow"), options=DrainOptions(**FAST, compress="auto", link_rate=1e6))
    assert slow.compression["codec"] == codec.CODEC and "beats" in slow.compression["decision"]
    unknown = drain(local, str(tmp_path / "unknown"), options=DrainOptions(**FAST, compress="auto"))
    assert "codec" not in unknown.compression and "unknown" in unknown.compression["decision"]
    assert "compression" not in mirror_doc(tmp_path / "unknown")
    assert_same(load(NVMeReader(str(tmp_path / "slow")), sd), sd)


def test_writer_mirror_compress_and_cli(tmp_path, capsys):
    sd = make_state(15)
    drainer = Drainer(DrainOptions(**FAST))
    from dcp_nvme.tiers import set_default_drainer

    previous = set_default_drainer(drainer)
    try:
        writer = NVMeWriter(str(tmp_path / "a"), mirror=str(tmp_path / "ma"), compress="bytegroup")
        dcp.save(sd, storage_writer=writer, no_dist=True)
        assert writer.drain_future.result().compression["codec"] == codec.CODEC
    finally:
        set_default_drainer(previous)
        drainer.close()
    assert "compression" in mirror_doc(tmp_path / "ma")
    with pytest.raises(ValueError, match="compress must be one of"):
        NVMeWriter(str(tmp_path / "b"), compress="lz4")
    local = save(tmp_path / "c", sd)
    assert cli_main(["drain", local, "--to", str(tmp_path / "mc"), "--compress", "bytegroup",
                     "--part-size", "5MiB", "--codec-threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "compressed (bytegroup)" in out and "CPU s on 1 thread" in out
    assert cli_main(["status", local]) == 0
    assert "[compressed bytegroup, " in capsys.readouterr().out
    assert_same(load(NVMeReader(str(tmp_path / "mc")), sd), sd)


def test_tools_read_a_compressed_mirror(tmp_path, capsys):
    from dcp_nvme.tools.listing import describe
    from dcp_nvme.tools.verify import verify_checkpoint

    sd = make_state(17)
    local = save(tmp_path / "step_17", sd)
    target = str(tmp_path / "mirror")
    drain(local, target, options=DrainOptions(**FAST, compress="bytegroup"))
    report = verify_checkpoint(target, progress=False)
    assert report.ok and report.bytes_read == mirror_doc(target)["compression"]["bytes"]
    assert describe(target).state == "committed"
    assert cli_main(["inspect", target]) == 0
    assert f"compressed:  bytegroup v{codec.CODEC_VERSION}" in capsys.readouterr().out
    from safetensors.torch import load_file

    from dcp_nvme.tools import export_hf

    export_hf(target, tmp_path / "hf", keys=["w_bf16", "adam_fp32"])
    exported = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(shard))
    assert torch.equal(exported["w_bf16"].view(torch.int16), sd["w_bf16"].view(torch.int16))
    assert torch.equal(exported["adam_fp32"], sd["adam_fp32"])
    path = _dcz(target)
    blob = bytearray(open(path, "rb").read())
    blob[-5] ^= 0xFF  # inside the last chunk
    open(path, "wb").write(blob)
    report = verify_checkpoint(target, progress=False)  # a report, not a raise (test_compress_verify)
    assert not report.ok and any(os.path.basename(path) in p.message for p in report.problems)


def _step(sd: dict, seed: int) -> dict:
    """The next checkpoint: a small update of the weights and moments, the rest unchanged."""
    g = torch.Generator().manual_seed(seed)
    out = dict(sd)
    out["w_bf16"] = (sd["w_bf16"].float() + torch.randn(sd["w_bf16"].shape, generator=g) * 1e-4).to(torch.bfloat16)
    out["adam_fp32"] = sd["adam_fp32"] * 0.9 + torch.randn(sd["adam_fp32"].shape, generator=g) * 1e-5
    out["meta"] = {"step": seed, "note": "compressed"}
    return out


def relocated(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """A fresh copy of ``tensor`` whose data starts ``shift`` bytes into its own allocation: at
    another address modulo 4 KiB than any earlier copy, so the container places it elsewhere."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return tensor.clone()
    out = torch.empty(nbytes + shift, dtype=torch.uint8)[shift: shift + nbytes].view(tensor.dtype).view(tensor.shape)
    return out.copy_(tensor)


def delta_chain(tmp_path, first: dict, steps: int, seed: int, every: int = 3, mirror: str | None = None,
                filesystem=None, realloc: bool = False, states: list[dict] | None = None) -> tuple[list[dict], list]:
    """``first`` and ``steps`` - 1 small updates of it (or the given ``states``), saved to
    run/step_<i> and drained with compress="delta" to <mirror>/step_<i> (default: pfs/ beside
    run/): the states and the drain results. Saved from live tensors updated in place, as
    training does, or with ``realloc`` from fresh tensors at other addresses at every save
    (the container places them at other offsets than in the base)."""
    mirror = mirror or str(tmp_path / "pfs")
    if states is None:
        states = [first]
        for i in range(1, steps):
            states.append(_step(states[-1], seed + i))
    opts = DrainOptions(**FAST, compress="delta", delta_every=every)
    results = []
    live = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states[0].items()}
    for i, sd in enumerate(states, start=1):
        if realloc:
            live = {k: relocated(v.contiguous(), 64 + 1024 * (i % 4)) if isinstance(v, torch.Tensor) else v
                    for k, v in sd.items()}
        else:
            for key, value in sd.items():
                if isinstance(value, torch.Tensor):
                    live[key].copy_(value)
                else:
                    live[key] = value
        local = save(tmp_path / "run" / f"step_{i}", live)
        results.append(drain(local, f"{mirror}/step_{i}", filesystem=filesystem, options=opts))
    return states, results


def test_delta_chain_loads_through_its_bases_and_a_missing_base_is_refused(tmp_path):
    states, results = delta_chain(tmp_path, make_state(21), 4, 21)
    docs = [mirror_doc(tmp_path / "pfs" / f"step_{i}")["compression"] for i in range(1, 5)]
    assert "delta" not in docs[0] and "no earlier mirrored" in results[0].compression["base"]
    assert docs[1]["delta"]["base"] == str(tmp_path / "pfs" / "step_1") and docs[1]["delta"]["depth"] == 1
    assert docs[2]["delta"]["base"] == str(tmp_path / "pfs" / "step_2") and docs[2]["delta"]["depth"] == 2
    assert "delta" not in docs[3] and "coding full" in results[3].compression["base"]  # full every 3
    assert docs[1]["ratio"] > docs[0]["ratio"]  # a small update codes smaller against its base
    decoded = {}
    for i in (1, 2, 3):  # step_3 reads step_2, which reads step_1
        reader = NVMeReader(str(tmp_path / "pfs" / f"step_{i}"), block_size="1MiB")
        assert_same(load(reader, states[i - 1]), states[i - 1])
        decoded[i] = reader.last_stats["decoded_bytes"]
    # each base's bytes under the delta-coded items decoded too (with the pads between them that
    # a base read spans: their sizes follow the tensors' addresses), never more than a full load
    # of the base, and the same bytes at each level
    under = decoded[2] - decoded[1]
    assert results[1].compression["delta"]["delta_bytes"] <= under <= decoded[1]
    assert decoded[3] == decoded[2] + under
    assert verify_mirror(str(tmp_path / "run" / "step_3"), str(tmp_path / "pfs" / "step_3")).bytes_verified_remote
    os.remove(tmp_path / "pfs" / "step_1" / MANIFEST)  # the chain's full base is gone
    with pytest.raises(CheckpointException) as caught:
        load(NVMeReader(str(tmp_path / "pfs" / "step_3")), states[2])
    error = caught.value.failures[0]
    error = error[0] if isinstance(error, tuple) else error
    assert isinstance(error, codec.CodecError)
    assert f"delta against {tmp_path / 'pfs' / 'step_1'}" in str(error) and "missing" in str(error)
    assert_same(load(NVMeReader(str(tmp_path / "pfs" / "step_4")), states[3]), states[3])  # full: unaffected


def test_a_delta_base_given_as_a_relative_path_loads_from_any_working_directory(tmp_path, monkeypatch):
    """Drained with relative paths from one directory, the delta names its base so that a load
    from anywhere else finds it (not 'pfs/step_1' relative to wherever the load runs)."""
    work, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    states, _ = delta_chain(Path("."), make_state(31), 2, 31, mirror="pfs")
    base = mirror_doc(work / "pfs" / "step_2")["compression"]["delta"]["base"]
    assert base == str(work / "pfs" / "step_1")
    monkeypatch.chdir(elsewhere)
    assert_same(load(NVMeReader(str(work / "pfs" / "step_2")), states[1]), states[1])


@pytest.fixture
def small_tier(tmp_path):
    """A 48 MiB filesystem of its own (tmpfs; root only): the fast tier that fills up."""
    mount = tmp_path / "tier"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_coded_drain_never_fills_the_fast_tier(small_tier, tmp_path):
    """26 MiB of incompressible state on a 48 MiB tier: the coded copy would not fit, so the
    drain sends it plain (and says why) instead of dying on ENOSPC with its scratch and journal
    temp left behind; the next save still takes its lock and commits."""
    g = torch.Generator().manual_seed(7)
    sd = {"noise": torch.randint(0, 256, (26 << 20,), dtype=torch.uint8, generator=g)}
    run = small_tier / "run"
    dcp.save(sd, storage_writer=NVMeWriter(str(run / "step_1")), no_dist=True)
    result = drain(str(run / "step_1"), str(tmp_path / "pfs" / "step_1"),
                   options=DrainOptions(**FAST, compress="bytegroup"))
    assert "sent plain, not coded" in result.compression["decision"]
    assert drain_state(run / "step_1").state == "mirrored"
    leftovers = [n for n in os.listdir(run / "step_1") if n.startswith((".drain-zip", "..drain", ".drain.json.tmp"))]
    assert leftovers == []
    out = {"noise": torch.zeros(26 << 20, dtype=torch.uint8)}
    dcp.load(out, storage_reader=NVMeReader(str(tmp_path / "pfs" / "step_1")), no_dist=True)
    assert torch.equal(out["noise"], sd["noise"])
    small = {"w": torch.ones(1024)}
    dcp.save(small, storage_writer=NVMeWriter(str(run / "step_2")), no_dist=True)  # lock and commit work
    assert (run / "step_2" / "manifest.json").exists()


def test_a_drain_that_fails_on_a_full_disk_still_reports_a_drain_error(tmp_path, monkeypatch):
    """The journal update of the failure path hits the same full disk: the caller still gets a
    DrainError naming the drain's own failure, and the coded scratch is gone."""
    from dcp_nvme.tiers.journal import Journal

    local = save(tmp_path / "run" / "step_1", make_state(5))
    (tmp_path / "blocker").write_text("a file where the target's parent directory should be")
    real = Journal.update

    def full_when_failing(self, **fields):
        if fields.get("state") == "failed":
            raise OSError(28, "No space left on device")
        return real(self, **fields)

    monkeypatch.setattr(Journal, "update", full_when_failing)
    with pytest.raises(DrainError):
        drain(local, str(tmp_path / "blocker" / "step_1"), options=DrainOptions(**FAST, compress="bytegroup"))
    assert not [n for n in os.listdir(local) if n.startswith(".drain-zip")]
