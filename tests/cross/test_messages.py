"""What the CLI and the run API say about things that are not plain dcp_nvme checkpoints: a file
given as a checkpoint, a stock DCP checkpoint, a checkpoint with a missing file, and what a
model export takes by default. The CLI runs as a subprocess, as a user runs it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.cli_runs import run_many
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter

import dcp_nvme
from dcp_nvme import NVMeWriter
from dcp_nvme.errors import CheckpointNotFoundError, InvalidInputError
from dcp_nvme.tools import export_hf
from dcp_nvme.tools.consolidate import model_selection
from dcp_nvme.tools.inspection import inspect_checkpoint

REPO = Path(__file__).resolve().parents[2]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state() -> dict:
    return {"model": {"model.embed.weight": torch.arange(12.0).reshape(3, 4), "lm_head.weight": torch.ones(2, 4)},
            "optim": {"state": {"exp_avg": torch.full((5,), 2.0)}}, "step": 7}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    dcp.save(_state(), storage_writer=NVMeWriter(root / "run" / "step_1"), no_dist=True)
    dcp.save(_state(), storage_writer=FileSystemWriter(root / "run" / "step_2"), no_dist=True)  # newer, stock
    dcp.save(_state(), storage_writer=NVMeWriter(root / "broken"), no_dist=True)
    for data in (root / "broken").glob("rank_*.safetensors"):
        data.unlink()
    torch.save({"w": torch.ones(2)}, root / "weights.pt")
    (root / "notes.txt").write_text("hello")
    return root


def test_cli_messages(run: Path):
    hf = run / "hf"
    inspect, status, verify, export = run_many(
        ["inspect", str(run / "notes.txt")],
        ["status", str(run / "run" / "step_2")],
        ["verify", str(run / "broken"), "--json"],
        ["export", str(run / "run" / "step_1"), "--to", "hf", str(hf), "--no-progress"],
        timeout=300,
    )
    lines = inspect.stderr.strip().splitlines()
    assert inspect.returncode == 1 and len(lines) == 1, inspect.stderr
    assert "notes.txt is a file of 5 bytes; a dcp_nvme checkpoint is a directory holding manifest.json" in lines[0]
    assert status.returncode == 0, status.stderr
    assert "step_2: foreign (a stock DCP checkpoint" in status.stdout and "uncommitted" not in status.stdout
    problems = json.loads(verify.stdout)["problems"]
    assert verify.returncode == 1 and [p["kind"] for p in problems] == ["missing"], problems
    assert export.returncode == 0, export.stderr
    assert "left out (not model weights): optim (1 tensor(s)); pass --include-optimizer" in export.stdout
    weights = {k: v for shard in hf.glob("*.safetensors") for k, v in load_file(shard).items()}
    expected = _state()["model"]
    assert weights.keys() == expected.keys()  # the names Hugging Face expects: no leading "model."
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    export_hf(run / "run" / "step_1", run / "hf_all", include_optimizer=True)
    names = set(json.loads((run / "hf_all" / "model.safetensors.index.json").read_text())["weight_map"])
    assert names == {"model.model.embed.weight", "model.lm_head.weight", "optim.state.exp_avg"}


def test_inspect_names_what_a_file_is(run: Path):
    for path, words in ((run / "weights.pt", ("torch.save file", "dcp-nvme convert")),
                        (next((run / "run" / "step_1").glob("rank_*")), ("a file of the checkpoint", "step_1")),
                        (run / "nope", ("does not exist",))):
        with pytest.raises(CheckpointNotFoundError) as info:
            inspect_checkpoint(path)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_latest_is_the_newest_checkpoint_our_reader_loads(run: Path):
    assert dcp_nvme.latest(run / "run") == run / "run" / "step_1"
    assert [c.kind for c in dcp_nvme.checkpoints(run / "run")] == ["nvme", "dcp"]


def test_model_selection_of_common_layouts():
    titan = model_selection(["tok_embeddings.weight", "layers.0.w", "optimizer.state.layers.0.w.exp_avg"])
    assert (titan.keys, titan.strip_prefix, titan.left_out) == (
        ["layers.*", "tok_embeddings.*"], None, {"optimizer": 1})
    lightning = model_selection(["state_dict.fc.weight", "optimizer_states.0.state.fc.weight.exp_avg"])
    assert (lightning.keys, lightning.strip_prefix) == (["state_dict.*"], "state_dict.")
    plain = model_selection(["fc.weight", "fc.bias"])
    assert (plain.keys, plain.left_out) == (None, {})
    with pytest.raises(InvalidInputError, match="only training state.*--include-optimizer"):
        model_selection(["optim.state.w.exp_avg"])
