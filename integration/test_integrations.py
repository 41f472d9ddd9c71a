"""Trainer integration scenarios: real trainer libraries on CPU + gloo, checkpointing through
dcp_nvme (NVMeWriter / NVMeReader / NVMeStager), resumed at 2 and 1 ranks.

Each test runs one scenario's ``run(root)`` (a single spawn of 2 processes, see _storage.py) and
then checks on disk that the checkpoints are dcp_nvme's (manifest.json + rank_*.safetensors).
A scenario is skipped when its trainer library is not installed
(``pip install -c constraints.txt -r integration/requirements.txt``).
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


CASES = [
    # (scenario module, trainer module it needs or None)
    ("fsdp2_scenario", None),
    ("lightning_scenario", "lightning"),
    ("torchtitan_scenario", "torchtitan"),
    ("megatron_scenario", "megatron.core"),
]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,needs", CASES, ids=[c[0].removesuffix("_scenario") for c in CASES])
def test_scenario(scenario: str, needs: str | None, tmp_path) -> None:
    if needs is not None and not _has(needs):
        pytest.skip(f"{needs} is not installed (see integration/requirements.txt)")
    importlib.import_module(scenario).run(tmp_path)


def test_remove_items_rewrites_without_prefix(tmp_path) -> None:
    """What Megatron's remove_sharded_tensors runs: the kept items load bitwise, bytes items are
    carried unpickled, the removed ones are gone, the old files are replaced."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_nvme import NVMeReader, NVMeWriter
    from dcp_nvme.integrations._prune import remove_items

    ckpt = tmp_path / "iter_1"
    saved = {"model.w": torch.randn(6, 4), "model.b": torch.arange(5, dtype=torch.bfloat16),
             "optim.m": torch.randn(1000), "optim.step": torch.tensor(3), "meta": {"it": 1}}
    dcp.save(saved, storage_writer=NVMeWriter(ckpt), no_dist=True)
    old_files = {p.name for p in ckpt.iterdir()}
    size_before = sum(p.stat().st_size for p in ckpt.iterdir())

    assert remove_items(ckpt, "optim.") == ["optim.m", "optim.step"]
    assert sorted(NVMeReader(ckpt).read_metadata().state_dict_metadata) == ["meta.it", "model.b", "model.w"]
    assert not (old_files - {"manifest.json"}) & {p.name for p in ckpt.iterdir()}
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < size_before
    got = {"model.w": torch.zeros(6, 4), "model.b": torch.zeros(5, dtype=torch.bfloat16), "meta": {"it": 0}}
    dcp.load(got, storage_reader=NVMeReader(ckpt), no_dist=True)
    assert torch.equal(got["model.w"], saved["model.w"]) and torch.equal(got["model.b"], saved["model.b"])
    assert got["meta"] == {"it": 1}
    with pytest.raises(Exception, match="optim.m"):
        dcp.load({"optim.m": torch.zeros(1000)}, storage_reader=NVMeReader(ckpt), no_dist=True)
    assert remove_items(ckpt, "nothing.") == []
