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


@pytest.mark.slow
@pytest.mark.gpu
def test_megatron_stock_cuda_calls_without_shim(tmp_path) -> None:
    """On a GPU machine the Megatron scenario runs without the CPU shim: Megatron's
    AsyncCallsQueue uses its own torch.cuda calls and dcp_nvme's strategies need none."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: Megatron's AsyncCallsQueue puts its tensors on "
                    "torch.cuda.current_device(); on CPU the scenario shims that call")
    if not _has("megatron.core"):
        pytest.skip("megatron.core is not installed (see integration/requirements.txt)")
    importlib.import_module("megatron_scenario").run(tmp_path, cpu_shim=False)


def test_find_latest_checkpoint_skips_uncommitted(tmp_path) -> None:
    """The resume helper picks the newest step dir that holds a commit marker."""
    from dcp_nvme.integrations._common import find_latest_checkpoint

    assert find_latest_checkpoint(tmp_path / "missing") is None
    for step, marker in ((2, "manifest.json"), (10, "manifest.json"), (12, None), (11, ".metadata")):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / "rank_00000.x.safetensors").write_bytes(b"")
        if marker:
            (d / marker).write_text("{}")
    (tmp_path / "step-99.tmp").mkdir()  # does not match the pattern
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step-11"
    (tmp_path / "step-11" / ".metadata").unlink()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step-10"
