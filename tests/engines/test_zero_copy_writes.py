"""Zero-copy writes of plain host tensors: items placed congruent to their memory (pad entries
between them), each window one vectored write straight from the tensors' own memory; only the
unaligned edges bounce. Real saves, real files, both engines, O_DIRECT and buffered."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from dcp_nvme import NVMeReader, NVMeStager, NVMeWriter
from dcp_nvme.engines.host_io import DioAlignment, aligned_buffer, block_crcs, dio_alignment
from dcp_nvme.engines.uring import uring_unavailable_reason
from dcp_nvme.format.container import DIRECT_MIN, is_pad_key
from dcp_nvme.tools import export_hf, inspect_checkpoint, list_checkpoints, verify_checkpoint
from dcp_nvme.tools.convert import convert

ENGINES = ["posix"] + (["uring"] if uring_unavailable_reason() is None else [])
BLOCK = 256 << 10


def _filled(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    raw = tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    if tensor.dtype == torch.bool:
        raw.remainder_(2)
    return tensor


def awkward_state() -> dict[str, torch.Tensor]:
    """Every kind of source memory: page-aligned, off by odd bytes, tiny, empty, 0-dim, strided."""
    page = aligned_buffer(300_000 + 4096, pin=False)
    state = {
        "aligned": _filled(page[4096 : 4096 + 300_000], 1),
        "odd_u8": _filled(torch.empty(200_003, dtype=torch.uint8)[3:], 2),  # 3 bytes past 64
        "odd_f32": _filled(torch.empty(70_001)[1:], 3),  # 4 bytes past its allocation
        "tiny": _filled(torch.empty(3, dtype=torch.int16), 4),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "strided": _filled(torch.empty(400, 300), 5).t(),  # non-contiguous: written from a copy
        "every_other": _filled(torch.empty(100_000, dtype=torch.int32), 6)[::2],
        "mask": _filled(torch.empty(12_345, dtype=torch.bool), 7),
    }
    for index, dtype in enumerate([torch.float16, torch.bfloat16, torch.int8, torch.int64,
                                   torch.complex64, torch.float8_e4m3fn, torch.float64]):
        state[f"big_{dtype}".replace("torch.", "")] = _filled(torch.empty(90_000, dtype=dtype), 10 + index)
        state[f"small_{dtype}".replace("torch.", "")] = _filled(torch.empty(7, dtype=dtype), 20 + index)
    return state


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat_a, flat_b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))


def _dio_align(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        found = dio_alignment(fd)
    finally:
        os.close(fd)
    return max(found.memory, found.offset)


def _header(path) -> dict:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", [True, False])
def test_awkward_tensors_round_trip_and_open_in_safetensors(tmp_path, engine, direct):
    state = awkward_state()
    writer = NVMeWriter(tmp_path, engine=engine, direct_io=direct, block_size=BLOCK, queue_depth=3)
    dcp.save(state, storage_writer=writer, no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=NVMeReader(tmp_path, engine=engine, direct_io=direct, block_size=BLOCK),
             no_dist=True)
    for key, value in state.items():
        assert _same(back[key], value), key

    container = next(tmp_path.glob("rank_*.safetensors"))
    header = _header(container)
    pads = [k for k in header if is_pad_key(k)]
    assert pads  # the large odd tensors needed gaps before them
    with safe_open(str(container), framework="pt") as handle:  # still plain safetensors
        keys = set(handle.keys())
        assert keys == set(state) | set(pads)
        for key in pads:
            assert not handle.get_tensor(key).any()  # pads hold zeros
        for key, value in state.items():
            if header[key]["dtype"] != "U8" or value.dtype == torch.uint8:
                assert _same(handle.get_tensor(key), value.contiguous()), key
    io = writer.last_stats["io"]
    assert io["direct_io"] is direct
    # only edges, pads and small items bounce: well under the tensors' bytes
    total = sum(v.numel() * v.element_size() for v in state.values())
    assert io["copied_bytes"] < total * (0.15 if direct else 0.05), io
    report = verify_checkpoint(tmp_path)
    assert report.ok, report.problems


def model_like_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few dozen weights of 64 KiB to 16 MiB, with the small biases and norms between them."""
    g = torch.Generator().manual_seed(seed)
    sizes = [64 << 10, 192 << 10, 1 << 20, 3 << 20, 16 << 20]
    state = {}
    for layer in range(8):
        for index, nbytes in enumerate(sizes):
            state[f"layer{layer}.w{index}"] = torch.randn(nbytes // 4 + layer, generator=g)
        state[f"layer{layer}.bias"] = torch.randn(257 + layer, generator=g)
        state[f"layer{layer}.norm"] = torch.randn(64, generator=g).bfloat16()
    return state


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", [True, False])
def test_sync_save_of_host_tensors_bounces_under_5_percent(tmp_path, engine, direct):
    state = model_like_state()
    total = sum(v.numel() * v.element_size() for v in state.values())
    writer = NVMeWriter(tmp_path, engine=engine, direct_io=direct, block_size="1MiB")
    dcp.save(state, storage_writer=writer, no_dist=True)
    io = writer.last_stats["io"]
    assert io["bytes"] >= total and io["direct_io"] is direct
    assert io["copied_bytes"] <= 0.05 * total, (io["copied_bytes"], total)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=NVMeReader(tmp_path), no_dist=True)
    assert all(_same(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("direct", [True, False])
def test_staged_saves_stay_zero_copy(tmp_path, direct):
    """A staged arena (dtype padding included) keeps its layout in the container: every window is
    one span of the arena, written without a copy; only the unaligned tail may bounce."""
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(70_000, generator=g), "flags": torch.rand(1001, generator=g) > 0.5,
             "d": torch.randn(50_000, dtype=torch.float64, generator=g), "h": torch.randn(333, generator=g).half(),
             "e": torch.randn(300_000, generator=g)}
    stager = NVMeStager()
    try:
        for attempt in range(2):
            writer = NVMeWriter(tmp_path / f"s{attempt}", direct_io=direct, block_size=BLOCK)
            resp = dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True)
            resp.upload_completion.result()
            io = writer.last_stats["io"]
            container = next((tmp_path / f"s{attempt}").glob("rank_*"))
            header = _header(container)
            assert any(is_pad_key(k) for k in header)  # the arena's dtype padding, kept
            data_size = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
            # nothing bounces but the tail past the last O_DIRECT boundary (buffered: nothing)
            assert io["copied_bytes"] == (data_size % _dio_align(container) if direct else 0), io
            back = {k: torch.zeros_like(v) for k, v in state.items()}
            dcp.load(back, storage_reader=NVMeReader(tmp_path / f"s{attempt}"), no_dist=True)
            assert all(_same(back[k], v) for k, v in state.items())
    finally:
        stager.close()


def test_tools_never_show_pads(tmp_path):
    state = {f"w{i}": torch.empty(100_001 + i)[1:] for i in range(3)}  # off their pages
    for index, value in enumerate(state.values()):
        _filled(value, index)
    dcp.save(state, storage_writer=NVMeWriter(tmp_path / "c", block_size=BLOCK), no_dist=True)
    assert any(is_pad_key(k) for k in _header(next((tmp_path / "c").glob("rank_*"))))
    info = inspect_checkpoint(tmp_path / "c")
    assert {t.fqn for t in info.tensors} == set(state)
    os.rename(tmp_path / "c" / "manifest.json", tmp_path / "manifest.bak")  # headers only now
    partial = inspect_checkpoint(tmp_path / "c")
    (desc,) = partial.partial.values()
    assert desc["items"] == 3 and desc["bytes"] == sum(v.numel() * 4 for v in state.values())
    os.rename(tmp_path / "manifest.bak", tmp_path / "c" / "manifest.json")
    result = export_hf(tmp_path / "c", tmp_path / "hf")
    exported = set()
    for shard in result.shards:
        with safe_open(str(tmp_path / "hf" / shard), framework="pt") as handle:
            exported |= set(handle.keys())
    assert exported == set(state)
    convert(tmp_path / "c", tmp_path / "t.pt", "torch")
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert set(loaded) == set(state) and all(_same(loaded[k], v) for k, v in state.items())
    (entry,) = list_checkpoints(tmp_path / "c")
    assert entry.state == "committed"


def test_block_crcs_continue_across_segments():
    data = os.urandom(10_000)
    cuts = [0, 1, 4095, 4096, 7000, 10_000]
    views = [memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])] + [memoryview(bytes(96))]  # + fill
    assert block_crcs(views, len(data), 4096) == [crc32c.crc32c(data[i : i + 4096]) for i in range(0, 10_000, 4096)]


def test_small_items_stay_back_to_back(tmp_path):
    state = {f"s{i}": torch.randn(100 + i) for i in range(20)}  # all well under DIRECT_MIN
    assert all(v.numel() * 4 < DIRECT_MIN for v in state.values())
    dcp.save(state, storage_writer=NVMeWriter(tmp_path, block_size=BLOCK), no_dist=True)
    header = _header(next(tmp_path.glob("rank_*")))
    pads = [v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if is_pad_key(k)]
    assert all(n < 16 for n in pads)  # at most a rare itemsize-sized gap


def test_o_direct_refusing_tensor_memory_falls_back_to_bouncing(tmp_path, monkeypatch, caplog):
    """Should O_DIRECT refuse a write from tensor memory (EINVAL: the reported alignment was not
    enough), the window is written again through a bounce buffer, and so is the rest."""
    from dcp_nvme.engines import posix

    real = os.pwritev
    refused = []

    def picky_pwritev(fd, views, offset):  # as if the device wanted page-aligned memory
        if any(ctypes.addressof(ctypes.c_char.from_buffer(v)) % 4096 for v in views):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, views, offset)

    monkeypatch.setattr(posix.os, "pwritev", picky_pwritev)
    state = model_like_state()
    writer = NVMeWriter(tmp_path, engine="posix", direct_io=True, block_size="1MiB")
    with caplog.at_level("WARNING"):
        dcp.save(state, storage_writer=writer, no_dist=True)
    monkeypatch.undo()
    if not writer.last_stats["io"]["direct_io"]:
        pytest.skip("no O_DIRECT on this filesystem")
    assert refused and "bouncing every write" in caplog.text
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=NVMeReader(tmp_path), no_dist=True)
    assert all(_same(back[k], v) for k, v in state.items())
    assert verify_checkpoint(tmp_path).ok


def test_every_io_thread_refused_at_once_still_finishes(tmp_path, monkeypatch):
    """All queue_depth I/O threads refused together: each must hand its bounce buffer back
    before writing its window again, or every thread waits for a buffer none will return."""
    import threading

    from dcp_nvme.engines import posix

    depth = 2
    real = os.pwritev
    together = threading.Barrier(depth)

    def refuse_all_at_once(fd, views, offset):
        if any(ctypes.addressof(ctypes.c_char.from_buffer(v)) % 4096 for v in views):
            try:
                together.wait(timeout=5)  # both threads hold a buffer here
            except threading.BrokenBarrierError:
                pass
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, views, offset)

    monkeypatch.setattr(posix.os, "pwritev", refuse_all_at_once)
    state = model_like_state()
    writer = NVMeWriter(tmp_path, engine="posix", direct_io=True, block_size="1MiB", queue_depth=depth)
    saving = threading.Thread(target=dcp.save, args=(state,), kwargs={"storage_writer": writer, "no_dist": True},
                              daemon=True)
    saving.start()
    saving.join(timeout=60)
    assert not saving.is_alive(), "the save deadlocked waiting for a bounce buffer"
    monkeypatch.undo()
    if not writer.last_stats["io"]["direct_io"]:
        pytest.skip("no O_DIRECT on this filesystem")
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=NVMeReader(tmp_path), no_dist=True)
    assert all(_same(back[k], v) for k, v in state.items())


def test_uring_resubmits_the_rest_of_a_short_vectored_write():
    from dcp_nvme.engines.uring import _remaining

    spans = [(1000, 512), (5000, 1024), (9000, 7)]
    assert _remaining(spans, 0) == spans
    assert _remaining(spans, 512) == spans[1:]
    assert _remaining(spans, 600) == [(5088, 936), (9000, 7)]
    assert _remaining(spans, 1536 + 6) == [(9006, 1)]
    assert _remaining(spans, 1543) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_an_alignment_the_kernel_refuses_falls_back_to_bouncing(tmp_path, monkeypatch, caplog, engine):
    """statx or the device claiming less alignment than O_DIRECT really needs: the kernel's
    EINVAL on a direct span makes that window and the rest of the file bounce, page-aligned."""
    from dcp_nvme.engines import posix as windows

    monkeypatch.setattr(windows, "dio_alignment", lambda fd: DioAlignment(64, 64, "test"))
    state = model_like_state()
    writer = NVMeWriter(tmp_path, engine=engine, direct_io=True, block_size="1MiB")
    with caplog.at_level("WARNING"):
        dcp.save(state, storage_writer=writer, no_dist=True)
    if not writer.last_stats["io"]["direct_io"]:
        pytest.skip("no O_DIRECT on this filesystem")
    if _dio_align(next(tmp_path.glob("rank_*"))) > 64:  # the kernel refused: we fell back
        assert "bouncing every write" in caplog.text
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=NVMeReader(tmp_path), no_dist=True)
    assert all(_same(back[k], v) for k, v in state.items())
    assert verify_checkpoint(tmp_path).ok
