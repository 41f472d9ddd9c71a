"""No lock-in, inward: NVMeReader and the tools take a Hugging Face model directory, a single
``.safetensors`` file and (with allow_pickle) a stock DCP checkpoint; anything else is named."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.hostile_kit import within
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


def _refused_everywhere(path, match: str, state=None) -> None:
    """NVMeReader, inspect, verify and convert --to nvme all refuse ``path`` before reading data,
    each within seconds (a FIFO opened blocking would hang them)."""
    dest = {k: torch.zeros_like(v) for k, v in (state or _state()).items()}
    with pytest.raises(CheckpointException, match=match):
        within(20, lambda: dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True))
    with pytest.raises(ManifestError, match=match):
        within(20, lambda: inspect_checkpoint(path))
    report = within(20, lambda: verify_checkpoint(path))
    assert not report.ok and any(re.search(match, p.message) for p in report.problems), report.problems
    out = path.parent / "converted"
    with pytest.raises((ManifestError, CheckpointException), match=match):
        within(20, lambda: convert(path, out, "nvme"))
    assert not (out / "manifest.json").exists()


def test_a_fifo_shard_or_a_link_outside_is_refused_not_read(sharded_hf, tmp_path):
    (sharded_hf / "model.safetensors.index.json").unlink()  # every *.safetensors there is a shard
    shard = sharded_hf / "model-00002-of-00002.safetensors"
    outside = tmp_path / "outside.safetensors"
    os.replace(shard, outside)
    os.mkfifo(shard)
    _refused_everywhere(sharded_hf, "model-00002-of-00002.safetensors is a FIFO; a model's shards must be "
                                    "regular files")
    shard.unlink()
    os.symlink(outside, shard)
    _refused_everywhere(sharded_hf, "model-00002-of-00002.safetensors is a symbolic link to .*outside.safetensors, "
                                    "outside .*copy the file there")
    # a link inside the directory, or from the Hugging Face cache's snapshot into its blobs/, is read
    cache = tmp_path / "models--x" / "snapshots" / "abc"
    (tmp_path / "models--x" / "blobs").mkdir(parents=True)
    shutil.copytree(sharded_hf, cache, symlinks=False, ignore=shutil.ignore_patterns("model-00002*"))
    os.replace(outside, tmp_path / "models--x" / "blobs" / "f00d")
    os.symlink("../../blobs/f00d", cache / shard.name)
    assert _bits_equal(_load(cache), _state())


def _torch_sharded(tmp_path, ranks: int = 3):
    """What torch's HF writer writes with save_distributed=True: a file per rank of row chunks
    placed by DCP_SHARDING_INFO, written here one rank at a time (as ranks write them)."""
    path = tmp_path / "sharded_hf"
    path.mkdir()
    full = torch.arange(36 * 4, dtype=torch.float32).reshape(36, 4)
    rows = 36 // ranks
    for rank in range(ranks):
        info = {"w": {"saved_offsets": [rank * rows, 0]}}
        save_file({"w": full[rank * rows:(rank + 1) * rows].clone()}, str(path / f"shard-0000{rank + 1}-model-00001"
                  f"-of-00001.safetensors"), metadata={"DCP_SHARDING_INFO": json.dumps(info)})
    return path, full


def test_a_sharded_layout_that_does_not_tile_its_tensor_is_refused_before_any_read(tmp_path):
    path, full = _torch_sharded(tmp_path)
    dest = {"w": torch.zeros_like(full)}
    dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True)
    assert torch.equal(dest["w"], full) and verify_checkpoint(path).ok
    middle = path / "shard-00002-model-00001-of-00001.safetensors"
    kept = middle.read_bytes()
    middle.unlink()
    _refused_everywhere(path, r"'w''s chunks cover 96 of the 144 elements of its shape \[36, 4\]: a shard file "
                              "is missing", dest)
    info = {"w": {"saved_offsets": [6, 0]}}  # rows 6..17 overlap the first file's 0..11
    save_file({"w": full[12:24].clone()}, str(middle), metadata={"DCP_SHARDING_INFO": json.dumps(info)})
    _refused_everywhere(path, r"'w''s chunk at offsets \[0, 0\] in .*shard-00001.* overlaps the one at \[6, 0\]",
                        dest)
    middle.write_bytes(kept)


@pytest.mark.slow  # holds a few hundred MiB
def test_a_large_tensor_is_read_straight_into_its_destination(tmp_path):
    """Peak RSS while loading a 128 MiB tensor from .safetensors: the destination only, no
    buffer of the tensor's size between the file and it (VmHWM, reset just before the load)."""
    size = 128 << 20
    big = torch.ones(size // 4, dtype=torch.float32)
    save_file({"big": big}, str(tmp_path / "big.safetensors"))
    del big
    dest = {"big": torch.zeros(size // 4, dtype=torch.float32)}
    reader = NVMeReader(tmp_path / "big.safetensors")

    def peak_and_now() -> tuple[int, int]:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmHWM"].split()[0]) << 10, int(fields["VmRSS"].split()[0]) << 10

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from what is resident now
    before = peak_and_now()[1]
    dcp.load(dest, storage_reader=reader, no_dist=True)
    extra = peak_and_now()[0] - before
    assert bool(dest["big"].eq(1).all())
    assert extra < size // 8, f"the load took {extra / size:.2f}x the tensor's size on top of it"
