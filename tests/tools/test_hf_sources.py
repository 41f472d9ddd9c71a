"""No lock-in, inward: NVMeReader and the tools take a Hugging Face model directory, a single
``.safetensors`` file and (with allow_pickle) a stock DCP checkpoint; anything else is named."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeReader
from dcp_nvme.errors import InvalidInputError, ManifestError
from dcp_nvme.tools.convert import convert
from dcp_nvme.tools.export import export_hf
from dcp_nvme.tools.inspection import inspect_checkpoint
from dcp_nvme.tools.verify import verify_checkpoint


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {"model.embed.weight": torch.randn(12, 8, generator=generator),
            "model.norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
            "lm_head.weight": torch.randn(5, 8, generator=generator).to(torch.float16)}


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def _load(path, **options) -> dict[str, torch.Tensor]:
    dest = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(dest, storage_reader=NVMeReader(path, **options), no_dist=True)
    return dest


@pytest.fixture
def sharded_hf(tmp_path):
    """A sharded Hugging Face directory: two shards and model.safetensors.index.json."""
    path = tmp_path / "hf"
    path.mkdir()
    state = _state()
    names = {"model.embed.weight": "model-00001-of-00002.safetensors"}
    for fqn in state:
        names.setdefault(fqn, "model-00002-of-00002.safetensors")
    for name in set(names.values()):
        save_file({k: v for k, v in state.items() if names[k] == name}, str(path / name), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return path


def test_nvmereader_loads_a_sharded_hf_directory_and_one_file(sharded_hf, tmp_path):
    assert _bits_equal(_load(sharded_hf), _state())
    single = tmp_path / "model.safetensors"
    save_file(_state(), str(single))
    assert _bits_equal(_load(single), _state())


def test_nvmereader_loads_what_torchs_hf_writer_wrote(tmp_path):
    path = str(tmp_path / "torch_hf")
    dcp.save(_state(), storage_writer=HuggingFaceStorageWriter(path), no_dist=True)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert _bits_equal(_load(path), _state())


def test_a_stock_dcp_checkpoint_needs_allow_pickle(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save({**_state(), "step": 4}, checkpoint_id=path, no_dist=True)
    with pytest.raises(CheckpointException) as caught:
        _load(path)
    assert (f"{path} is a stock DCP checkpoint (FileSystemWriter's .metadata, a pickle): NVMeReader reads it "
            "only with NVMeReader(path, allow_pickle=True), which runs any code that pickle holds; pass it "
            "for a checkpoint you trust, load it with torch's FileSystemReader, or convert it once: "
            f"dcp-nvme convert {path} OUT --to nvme") in str(caught.value)
    dest: dict = {k: torch.zeros_like(v) for k, v in _state().items()}
    dest["step"] = 0
    dcp.load(dest, storage_reader=NVMeReader(path, allow_pickle=True), no_dist=True)
    assert dest.pop("step") == 4 and _bits_equal(dest, _state())


def test_a_directory_of_nothing_says_what_it_is_not(tmp_path):
    with pytest.raises(CheckpointException) as caught:
        _load(tmp_path)
    assert (f"{tmp_path} is not a dcp_nvme checkpoint (no manifest.json), nor a stock DCP checkpoint "
            "(.metadata), a Hugging Face model directory (*.safetensors) or a single safetensors file") in str(caught.value)
    with pytest.raises(InvalidInputError) as refused:
        convert(tmp_path, tmp_path.parent / "out", "nvme")
    assert str(refused.value) == (
        f"{tmp_path} holds no checkpoint: neither a dcp_nvme checkpoint (manifest.json), a stock DCP "
        "checkpoint (.metadata), a Hugging Face model directory (*.safetensors) nor a single safetensors file")


def test_convert_names_its_source_and_round_trips_bitwise(sharded_hf, tmp_path):
    result = convert(sharded_hf, tmp_path / "ours", "nvme")
    assert (result.src_format, result.tensors) == ("hf", 3)
    assert _bits_equal(_load(tmp_path / "ours"), _state())
    single = tmp_path / "one.safetensors"
    save_file(_state(), str(single))
    assert convert(single, tmp_path / "one.pt", "torch").src_format == "safetensors"
    assert _bits_equal(torch.load(tmp_path / "one.pt", weights_only=True), _state())


def test_inspect_verify_export_take_a_hf_directory(sharded_hf, tmp_path):
    info = inspect_checkpoint(sharded_hf)
    assert info.ok and info.state == "a Hugging Face model directory"
    assert {t.fqn: (t.dtype, t.shape) for t in info.tensors} == {
        "model.embed.weight": ("float32", (12, 8)), "model.norm.weight": ("bfloat16", (8,)),
        "lm_head.weight": ("float16", (5, 8))}
    report = verify_checkpoint(sharded_hf)
    assert report.ok and report.files == 2
    out = tmp_path / "exported"
    export_hf(sharded_hf, out, include_optimizer=True)
    back = NVMeReader(out)
    dest = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(dest, storage_reader=back, no_dist=True)
    assert _bits_equal(dest, _state())
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".export-source-")]


def test_hostile_index_and_header_are_refused_naming_the_file(sharded_hf):
    index = sharded_hf / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointException) as caught:
        _load(sharded_hf)
    assert (f"{index}: 'a' is in '../elsewhere.safetensors', not the bare name of a .safetensors file beside "
            "the index") in str(caught.value)
    report = verify_checkpoint(sharded_hf)
    assert [p.kind for p in report.problems] == ["index"]
    index.unlink()
    shard = sharded_hf / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])  # its last item ends past the end of the file
    report = verify_checkpoint(sharded_hf)
    assert [(p.file, p.kind) for p in report.problems] == [(shard.name, "header")]
    assert "past the file's" in report.problems[0].message
    with pytest.raises(ManifestError):
        from dcp_nvme.format.safetensors_files import scan_file

        scan_file(str(shard))
