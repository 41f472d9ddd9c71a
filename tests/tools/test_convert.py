"""``dcp-nvme convert``: nvme <-> stock DCP <-> torch.save, bitwise, and the pointer left for
stock DCP entry points that meet a dcp_nvme checkpoint."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.conformance_backends import assert_bitwise, full_tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.cli import main as cli_main
from dcp_nvme.save.dropin import POINTER
from dcp_nvme.tools.convert import convert, detect_format

pytestmark = pytest.mark.filterwarnings("ignore")


def sample_state() -> dict:
    return {
        "model": {"w": full_tensor("w", (64, 48)), "b": full_tensor("b", (48,), torch.bfloat16),
                  "i": full_tensor("i", (5, 7), torch.int32), "mask": full_tensor("m", (9,), torch.bool),
                  "f8": full_tensor("f8", (4, 4), torch.float8_e4m3fn),
                  "c": full_tensor("c", (3,), torch.complex64), "scalar": torch.tensor(2.5, dtype=torch.float64)},
        "optim": {"state": {"0": {"exp_avg": full_tensor("e", (64, 48)), "step": torch.tensor(7.0)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": ["0"]}]},
        "epoch": 3,
        "note": "text",
    }


def zeros_like_state(state):
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def assert_same_state(actual, expected, where="state"):
    if isinstance(expected, torch.Tensor):
        assert_bitwise(actual, expected, where)
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), (where, sorted(actual), sorted(expected))
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_state(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, (where, actual, expected)


def save_nvme(path, state):
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)


def load_with(reader, like):
    dest = zeros_like_state(like)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    return dest


def stored_bytes(reader) -> dict[str, bytes]:
    """Every stored chunk and item of a checkpoint as raw bytes, keyed by fqn and offsets."""
    metadata = reader.read_metadata()
    out = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        chunks = getattr(meta, "chunks", None)
        if chunks is None:
            continue
        full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        dcp.load({fqn: full}, storage_reader=reader, no_dist=True)
        out[fqn] = full.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if full.numel() else b""
    return out


# --------------------------------------------------------------------------- round trips


def test_nvme_to_dcp_to_nvme_is_bitwise(tmp_path):
    state = sample_state()
    save_nvme(tmp_path / "a", state)
    result = convert(tmp_path / "a", tmp_path / "stock", "dcp")
    assert detect_format(tmp_path / "stock") == "dcp" and result.src_format == "nvme"
    assert result.tensors == 9 and result.objects >= 3
    assert_same_state(load_with(FileSystemReader(tmp_path / "stock"), state), state)
    convert(tmp_path / "stock", tmp_path / "b", "nvme")
    assert_same_state(load_with(NVMeReader(tmp_path / "b"), state), state)
    assert stored_bytes(NVMeReader(tmp_path / "b")) == stored_bytes(NVMeReader(tmp_path / "a"))
    # the stock layout's own tools read the converted checkpoint
    dcp_to_torch_save(tmp_path / "stock", tmp_path / "stock.pt")
    assert_same_state(torch.load(tmp_path / "stock.pt", weights_only=True), state)


def test_torch_file_to_nvme_and_back_is_bitwise(tmp_path):
    state = sample_state()
    torch.save(state, tmp_path / "in.pt")
    convert(tmp_path / "in.pt", tmp_path / "ck", "nvme")
    assert_same_state(load_with(NVMeReader(tmp_path / "ck"), state), state)
    result = convert(tmp_path / "ck", tmp_path / "out.pt", "torch")
    assert result.to == "torch" and result.tensors == 9
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=True), state)


def test_stock_tools_output_converts(tmp_path):
    """torch_save_to_dcp's output -> nvme -> torch equals the original file."""
    state = sample_state()
    torch.save(state, tmp_path / "in.pt")
    torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "stock")
    convert(tmp_path / "stock", tmp_path / "ck", "nvme")
    convert(tmp_path / "ck", tmp_path / "out.pt", "torch")
    assert_same_state(torch.load(tmp_path / "out.pt", weights_only=True), state)
    convert(tmp_path / "stock", tmp_path / "direct.pt", "torch")
    assert_same_state(torch.load(tmp_path / "direct.pt", weights_only=True), state)


def test_memory_budget_bounds_each_group(tmp_path):
    """Each group of at most memory_budget bytes (or one bigger chunk) is read then written."""
    full = full_tensor("big", (40, 30))
    save_nvme(tmp_path / "a", {"t": full, "obj": {"k": [1, 2]}})
    stock = FileSystemReader(tmp_path / "a_stock")
    result = convert(tmp_path / "a", tmp_path / "a_stock", "dcp", memory_budget=100)
    assert result.groups == 2 and result.largest_group_bytes == full.numel() * 4
    meta = stock.read_metadata()
    assert [tuple(c.sizes) for c in meta.state_dict_metadata["t"].chunks] == [(40, 30)]
    convert(tmp_path / "a_stock", tmp_path / "a.pt", "torch")
    assert_same_state(torch.load(tmp_path / "a.pt", weights_only=True), {"t": full, "obj": {"k": [1, 2]}})


def _save_two_shards(path, full):
    """A checkpoint whose tensor is stored as two row chunks, written by two simulated ranks."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from dcp_nvme.tools.convert import _GroupPlanner

    writer = NVMeWriter(path)
    writer.set_up_storage_writer(True)
    half = full.shape[0] // 2
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([half, full.shape[1]])),
              ChunkStorageMetadata(torch.Size([half, 0]), torch.Size([full.shape[0] - half, full.shape[1]]))]
    props = TensorProperties(dtype=full.dtype)
    items = [WriteItem(MetadataIndex("t", c.offsets), WriteItemType.SHARD,
                       tensor_data=TensorWriteData(c, props, full.shape)) for c in chunks]
    plans = writer.prepare_global_plan([writer.prepare_local_plan(SavePlan([i])) for i in items])
    results = []
    for item, chunk, plan in zip(items, chunks, plans):
        planner = _GroupPlanner()
        planner.tensors[item.index] = full[chunk.offsets[0]:chunk.offsets[0] + chunk.sizes[0]].clone()
        results.append(writer.write_data(plan, planner).wait())
    writer.finish(Metadata({"t": TensorStorageMetadata(props, full.shape, chunks)}), results)


def test_chunks_survive_every_conversion(tmp_path):
    full = full_tensor("rows", (10, 6))
    _save_two_shards(tmp_path / "a", full)
    convert(tmp_path / "a", tmp_path / "stock", "dcp", memory_budget=1)
    chunks = FileSystemReader(tmp_path / "stock").read_metadata().state_dict_metadata["t"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (5, 0)]
    convert(tmp_path / "stock", tmp_path / "b", "nvme")
    back = NVMeReader(tmp_path / "b").read_metadata().state_dict_metadata["t"].chunks
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in back] == [((0, 0), (5, 6)), ((5, 0), (5, 6))]
    convert(tmp_path / "b", tmp_path / "t.pt", "torch")
    assert_bitwise(torch.load(tmp_path / "t.pt", weights_only=True)["t"], full, "reassembled")


def test_bytes_items_are_copied_not_unpickled(tmp_path, torch_safe_globals_of_torch_only):
    """Between checkpoint layouts a non-tensor item is bytes: a pickled class that torch's
    restricted unpickler refuses (io.BytesIO) converts unchanged, never unpickled; --to torch
    refuses it by name."""
    from dcp_nvme.tools.convert import _entries, _open_reader, _read_group

    def raw_blob(reader):
        entries = [e for e in _entries(_open_reader(reader)) if e.fqn == "blob"]
        return _read_group(reader, entries).raw["blob"]

    dcp.save({"t": torch.ones(3), "blob": io.BytesIO(b"payload")},
             storage_writer=NVMeWriter(tmp_path / "a"), no_dist=True)
    convert(tmp_path / "a", tmp_path / "stock", "dcp")
    convert(tmp_path / "stock", tmp_path / "b", "nvme")
    # allow_pickle: the reader hands over the stored bytes; _read_group keeps them as bytes
    original = raw_blob(NVMeReader(tmp_path / "a", allow_pickle=True))
    assert raw_blob(FileSystemReader(tmp_path / "stock")) == original
    assert raw_blob(NVMeReader(tmp_path / "b", allow_pickle=True)) == original
    with pytest.raises(ValueError, match="'blob'.*restricted unpickler"):
        convert(tmp_path / "b", tmp_path / "x.pt", "torch")
    assert not (tmp_path / "x.pt").exists()


def test_torch_file_with_a_pickled_class_is_refused(tmp_path):
    torch.save({"t": torch.ones(2), "obj": io.StringIO("x")}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="pickled classes are not converted"):
        convert(tmp_path / "bad.pt", tmp_path / "out", "nvme")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_empty_checkpoint_converts(tmp_path):
    save_nvme(tmp_path / "a", {})
    convert(tmp_path / "a", tmp_path / "stock", "dcp")
    convert(tmp_path / "stock", tmp_path / "b", "nvme")
    assert NVMeReader(tmp_path / "b").read_metadata().state_dict_metadata == {}
    convert(tmp_path / "b", tmp_path / "e.pt", "torch")
    assert torch.load(tmp_path / "e.pt", weights_only=True) == {}


def test_destination_rules(tmp_path):
    save_nvme(tmp_path / "a", {"t": torch.ones(2)})
    convert(tmp_path / "a", tmp_path / "out", "dcp")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(tmp_path / "a", tmp_path / "out", "dcp")
    convert(tmp_path / "a", tmp_path / "out", "dcp", overwrite=True)
    with pytest.raises(ValueError, match="already a nvme checkpoint"):
        convert(tmp_path / "a", tmp_path / "x", "nvme")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="neither"):
        convert(tmp_path / "plain", tmp_path / "y", "dcp")
    with pytest.raises(FileNotFoundError):
        convert(tmp_path / "missing", tmp_path / "z", "dcp")
    with pytest.raises(ValueError, match="unknown target"):
        convert(tmp_path / "a", tmp_path / "z", "safetensors")
    with pytest.raises(ValueError, match="overlaps"):
        convert(tmp_path / "out", tmp_path, "nvme", overwrite=True)
    assert detect_format(tmp_path / "out") == "dcp"  # nothing was removed
    with pytest.raises(ValueError, match="local paths"):
        convert("s3://bucket/step_1", tmp_path / "z", "dcp")


# --------------------------------------------------------------------------- command line


def test_cli_convert(tmp_path, capsys):
    state = {"w": full_tensor("w", (8, 8)), "step": 4}
    save_nvme(tmp_path / "a", state)
    assert cli_main(["convert", str(tmp_path / "a"), str(tmp_path / "s.pt"), "--to", "torch"]) == 0
    assert "converted nvme" in capsys.readouterr().out
    assert_same_state(torch.load(tmp_path / "s.pt", weights_only=True), state)
    assert cli_main(["convert", str(tmp_path / "s.pt"), str(tmp_path / "d"), "--to", "dcp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["src_format"] == "torch" and report["tensors"] == 1
    assert cli_main(["convert", str(tmp_path / "a"), str(tmp_path / "d"), "--to", "dcp"]) == 1
    assert "--overwrite" in capsys.readouterr().err


# --------------------------------------------------------------------------- stock entry points


def test_stock_entry_points_meet_a_pointer(tmp_path):
    """dcp.load without a reader cannot find .metadata in our directory (torch's auto-detection
    picks FileSystemReader and cannot be extended); the directory holds, where .metadata would
    be, a file that says how to load or convert it. No stock-readable (pickled) .metadata is
    written: see docs/compat.md."""
    save_nvme(tmp_path / "a", {"t": torch.ones(2)})
    assert not (tmp_path / "a" / ".metadata").exists()
    with pytest.raises(CheckpointException, match=r"\.metadata"):
        dcp.load({"t": torch.zeros(2)}, checkpoint_id=tmp_path / "a")
    pointer = (tmp_path / "a" / POINTER).read_text()
    assert "NVMeReader" in pointer and "dcp-nvme convert" in pointer
    assert sorted(n for n in os.listdir(tmp_path / "a") if n.startswith(".metadata")) == [POINTER]
    # the converted copy is what stock entry points read
    convert(tmp_path / "a", tmp_path / "stock", "dcp")
    dest = {"t": torch.zeros(2)}
    dcp.load(dest, checkpoint_id=tmp_path / "stock")
    assert_bitwise(dest["t"], torch.ones(2), "t")
    # a writer that overwrites keeps one pointer, and the save still commits
    dcp.save({"t": torch.zeros(2)}, storage_writer=NVMeWriter(tmp_path / "a", overwrite=True), no_dist=True)
    assert (tmp_path / "a" / POINTER).read_text() == pointer


def test_our_reader_on_a_stock_checkpoint_names_the_converter(tmp_path):
    dcp.save({"t": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)
    with pytest.raises(FileNotFoundError, match="dcp-nvme convert .* --to nvme"):
        NVMeReader(tmp_path / "stock").read_metadata()


def test_stock_writer_output_matches_ours_for_stock_readers(tmp_path):
    """The same state saved by the stock writer and converted from ours loads identically."""
    state = sample_state()
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)
    save_nvme(tmp_path / "a", state)
    convert(tmp_path / "a", tmp_path / "conv", "dcp")
    ours = load_with(FileSystemReader(tmp_path / "conv"), state)
    theirs = load_with(FileSystemReader(tmp_path / "stock"), state)
    assert_same_state(ours, theirs)


# --------------------------------------------------------------------------- memory


class _AnonPeak:
    """Peak anonymous memory (RssAnon: not the page cache, not mapped files) of this process
    while the block runs, sampled every 5 ms."""

    def __enter__(self):
        import threading

        self.base = self.peak = self._anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def grown(self) -> int:
        return self.peak - self.base

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._anon())
            self._stop.wait(0.005)

    @staticmethod
    def _anon() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_chunked_conversions_hold_a_budget_not_the_model(tmp_path, monkeypatch):
    """192 MiB of tensors converted with a 16 MiB budget: nvme -> dcp, dcp -> nvme and
    torch -> nvme (mmap) each grow anonymous memory by far less than the model."""
    monkeypatch.setenv("DCP_NVME_QUEUE_DEPTH", "2")  # small engine buffers: the budget shows
    monkeypatch.setenv("DCP_NVME_BLOCK_SIZE", "1MiB")
    state = {f"layer{i}": full_tensor(f"l{i}", (1024, 2048)) for i in range(24)}  # 24 x 8 MiB
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    save_nvme(tmp_path / "a", state)
    torch.save(state, tmp_path / "m.pt")
    del state
    grown = {}
    for name, src, dst, to in [("nvme->dcp", "a", "s", "dcp"), ("dcp->nvme", "s", "b", "nvme"),
                               ("torch->nvme", "m.pt", "c", "nvme")]:
        with _AnonPeak() as peak:
            convert(tmp_path / src, tmp_path / dst, to, memory_budget="16MiB")
        grown[name] = peak.grown
    assert all(g < 64 << 20 for g in grown.values()), {k: f"{v / 2**20:.1f} MiB" for k, v in grown.items()}
    assert model_bytes == 192 << 20
    expected = {f"layer{i}": full_tensor(f"l{i}", (1024, 2048)) for i in (0, 23)}
    for ckpt in ("b", "c"):
        dest = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(dest, storage_reader=NVMeReader(tmp_path / ckpt), no_dist=True)
        assert_same_state(dest, expected, ckpt)
