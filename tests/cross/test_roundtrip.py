"""Single-process saves and loads through DCP: every dtype, every awkward tensor, real files."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.format.container import FORMAT_VERSION, MANIFEST


def _dcp_can_plan(dtype):
    """DCP's own planner sizes items with torch._utils._element_size, which rejects a few
    exotic dtypes (bits*, uint1-7...): those never reach a storage writer."""
    try:
        torch.empty(2, dtype=dtype)
        torch._utils._element_size(dtype)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)
     and _dcp_can_plan(d) and not str(d).startswith("torch.q")},
    key=str,
)


def _random_bytes_tensor(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    element = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * element,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def _same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def save_load(tmp_path, state, dest, **options):
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=NVMeWriter(path, **options), no_dist=True)
    reader = NVMeReader(path, **options)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    return path, reader


def test_every_dtype_round_trips_byte_identical(tmp_path):
    state = {str(d): _random_bytes_tensor((3, 5), d, i) for i, d in enumerate(DTYPES)}
    dest = {k: torch.zeros_like(v) if v.dtype != torch.bool else torch.zeros(3, 5, dtype=torch.bool) for k, v in state.items()}
    save_load(tmp_path, state, dest)
    assert {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.bool} <= set(DTYPES)
    for key in state:
        _same_bytes(dest[key], state[key])


def test_awkward_tensors(tmp_path):
    big = torch.randn(1000, 100)
    state = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "transposed": torch.randn(6, 9).t(),
        "strided": torch.arange(100, dtype=torch.int32)[::3],
        "narrow": big[10:12],  # a view of a 400 KB storage: only its 800 bytes are written
        "bf16": torch.randn(33, dtype=torch.bfloat16),
    }
    dest = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    path, _ = save_load(tmp_path, state, dest)
    for key in state:
        _same_bytes(dest[key], state[key].contiguous())
    data = sum(os.path.getsize(path / n) for n in os.listdir(path) if n.endswith(".safetensors"))
    assert data < 4096 + 8192  # header + a few KB: not the 400 KB storage behind "narrow"


def test_non_tensor_items_round_trip(tmp_path):
    state = {"step": 1234, "name": "run-7", "lr": 3e-4, "w": torch.ones(4)}
    dest = {"step": 0, "name": "", "lr": 0.0, "w": torch.zeros(4)}
    save_load(tmp_path, state, dest)
    assert dest["step"] == 1234 and dest["name"] == "run-7" and dest["lr"] == 3e-4
    assert torch.equal(dest["w"], state["w"])


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("block_size,queue_depth", [(4096, 1), (65536, 3), (8 << 20, 8)])
def test_io_settings_do_not_change_results(tmp_path, direct_io, block_size, queue_depth):
    generator = torch.Generator().manual_seed(block_size)
    state = {f"t{i}": torch.randn(int(torch.randint(1, 50_000, (1,), generator=generator)), generator=generator)
             for i in range(25)}
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    _, reader = save_load(tmp_path, state, dest, direct_io=direct_io, block_size=block_size,
                          queue_depth=queue_depth)
    for key in state:
        assert torch.equal(dest[key], state[key])
    assert reader.last_stats["max_inflight"] <= queue_depth


def test_every_shard_opens_with_safetensors(tmp_path):
    state = {"a": torch.randn(4, 4), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(3, dtype=torch.bfloat16),
             "f8": torch.randn(8).to(torch.float8_e4m3fn), "c128": torch.randn(2, dtype=torch.complex128)}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(shards) == 1
    with safe_open(str(path / shards[0]), framework="pt") as handle:
        assert set(handle.keys()) == set(state)
        for key in ("a", "b", "c", "f8"):
            _same_bytes(handle.get_tensor(key), state[key])
        raw = handle.get_tensor("c128")  # no safetensors dtype: stored as its raw bytes
        assert torch.equal(raw, state["c128"].view(torch.uint8).reshape(-1))


def test_many_small_tensors_share_requests(tmp_path):
    state = {f"p{i}": torch.full((17,), float(i)) for i in range(2000)}
    dest = {k: torch.zeros(17) for k in state}
    path = tmp_path / "ckpt"
    writer = NVMeWriter(path)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.last_stats["io"]["requests"] == 1  # 136 KB coalesced into one request
    reader = NVMeReader(path)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert reader.last_stats["requests"] == 1
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_load_into_other_dtype_converts_like_dcp(tmp_path):
    state = {"w": torch.randn(64)}
    dest = {"w": torch.zeros(64, dtype=torch.float64)}
    save_load(tmp_path, state, dest)
    assert torch.equal(dest["w"], state["w"].double())


@pytest.mark.parametrize("refuse_at", ["open", "write"])
def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch, refuse_at, caplog):
    """Filesystems without O_DIRECT (older tmpfs, some FUSE and network mounts) refuse it with
    EINVAL, either at open or at the first write; the save goes on buffered and says why."""
    import errno

    from dcp_nvme.engines import host_io as files
    from dcp_nvme.engines import posix

    real_open, real_pwrite = os.open, os.pwrite
    direct_fds = set()

    def fake_open(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT and refuse_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, mode, **kwargs)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)  # fds are reused
        return fd

    def fake_pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(posix.os, "open", fake_open)
    monkeypatch.setattr(posix.os, "pwrite", fake_pwrite)
    monkeypatch.setattr(files, "_warned_dirs", set())
    state = {"w": torch.randn(2_400_000)}  # more than a request: the engine writes it (not engines.small)
    dest = {"w": torch.zeros(2_400_000)}
    path = tmp_path / "ckpt"
    writer = NVMeWriter(path, direct_io=True)
    with caplog.at_level("WARNING"):
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.last_stats["io"]["direct_io"] is False
    assert "O_DIRECT refused" in caplog.text
    monkeypatch.undo()
    dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True)
    assert torch.equal(dest["w"], state["w"])


def test_writer_and_reader_pickle(tmp_path):
    writer = NVMeWriter(tmp_path / "x", queue_depth=3, block_size="1MiB")
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.config == writer.config and clone.path == writer.path
    reader = pickle.loads(pickle.dumps(NVMeReader(tmp_path / "x", verify=False)))
    assert reader.config.verify is False


def test_manifest_records_planner_data_and_stats(tmp_path):
    import json

    state = {"model": {"layer": torch.ones(2)}, "step": 3}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    doc = json.loads((path / MANIFEST).read_text())
    assert doc["format_version"] == FORMAT_VERSION and doc["world_size"] == 1
    assert doc["planner_data"]["model.layer"] == {"__tuple__": ["model", "layer"]}
    assert doc["ranks"][0]["io"]["bytes"] > 0
