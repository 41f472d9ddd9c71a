"""Non-tensor items on load: decoded without running code unless the caller opts in to pickle."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.tools import verify_checkpoint

REPO = Path(__file__).resolve().parents[2]


class Payload:
    """What a hostile author stores: unpickling it runs ``os.mkdir(marker)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class Config:
    """A harmless user class: not on the weights-only allow-list until the user adds it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def blank(value):
    """The same structure with every leaf replaced, so a load must bring each value back."""
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank(v) for v in value]
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else "<blank>"


def save(path: Path, state: dict) -> Path:
    dcp.save(state, storage_writer=NVMeWriter(path, direct_io=False), no_dist=True)
    return path


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint whose ``weight`` and ``step`` are pickles that create ``marker`` when loaded."""
    marker = tmp_path / "marker"
    ckpt = save(tmp_path / "ckpt", {"weight": Payload(str(marker)), "step": Payload(str(marker)),
                                    "bias": torch.ones(3)})
    assert not marker.exists()  # saving a __reduce__ runs nothing
    return ckpt, marker


def test_object_where_a_tensor_is_expected_is_refused_and_runs_nothing(hostile):
    ckpt, marker = hostile
    victim = {"weight": torch.zeros(4), "bias": torch.zeros(3)}
    with pytest.raises(CheckpointException, match="ItemKindError: .*'weight' is a tensor in the state_dict"):
        dcp.load(victim, storage_reader=NVMeReader(ckpt, direct_io=False), no_dist=True)
    assert not marker.exists()
    assert torch.equal(victim["weight"], torch.zeros(4))  # untouched, still a tensor
    assert torch.equal(victim["bias"], torch.zeros(3))  # refused before anything was loaded


@pytest.mark.parametrize("planner", [None, DefaultLoadPlanner(), DefaultLoadPlanner(flatten_state_dict=False)])
def test_code_in_an_object_item_never_runs_by_default(hostile, planner):
    ckpt, marker = hostile
    victim = {"step": 0}
    with pytest.raises(CheckpointException,
                       match=r"UnsafeItemError: .*'step' cannot be loaded safely \(it imports posix.mkdir") as err:
        dcp.load(victim, storage_reader=NVMeReader(ckpt, direct_io=False), planner=planner, no_dist=True)
    assert "allow_pickle=True" in str(err.value)
    assert not marker.exists()
    assert victim == {"step": 0}


def test_full_pickle_only_with_the_opt_in(hostile):
    ckpt, marker = hostile
    victim = {"step": 0}
    dcp.load(victim, storage_reader=NVMeReader(ckpt, direct_io=False, allow_pickle=True), no_dist=True)
    assert marker.exists()  # the payload ran: the test above would have seen it


def test_planner_without_a_state_dict_still_gets_only_safe_bytes(hostile):
    ckpt, marker = hostile
    seen = {}

    class RawPlanner(DefaultLoadPlanner):
        """Unpickles whatever the reader hands it, with no state_dict for the kind check."""

        def load_bytes(self, read_item, value):
            import pickle

            seen[read_item.dest_index.fqn] = pickle.loads(value.read())  # noqa: S301

    planner = RawPlanner()
    with pytest.raises(CheckpointException, match="UnsafeItemError"):
        dcp.load({"step": 0}, storage_reader=NVMeReader(ckpt, direct_io=False), planner=planner, no_dist=True)
    assert not marker.exists() and not seen


def test_plain_python_state_round_trips_by_default(tmp_path: Path):
    rng = torch.get_rng_state()
    state = {
        "model": {"w": torch.randn(5, 3), "b": torch.arange(4)},
        "step": 1234, "lr": 3e-4, "name": "run-a", "done": False, "none": None,
        "history": [1, 2.5, "x", None, (1, (2, 3)), {"k": [True]}],
        "sched": {"milestones": {"10": 0.1, "20": 0.01}, "tags": {"a", "b"}, "blob": b"\x00\xff"},
        "rng": rng, "mixed": {"t": torch.ones(2, dtype=torch.bfloat16), "n": 7},
        "dtype": torch.float16, "shape": torch.Size([2, 3]),
    }
    ckpt = save(tmp_path / "ckpt", state)
    loaded = blank(state)
    dcp.load(loaded, storage_reader=NVMeReader(ckpt, direct_io=False), no_dist=True)
    for key in ("step", "lr", "name", "done", "none", "history", "dtype", "shape"):
        assert loaded[key] == state[key] and type(loaded[key]) is type(state[key]), key
    assert loaded["sched"] == state["sched"]
    assert torch.equal(loaded["rng"], rng)
    assert torch.equal(loaded["mixed"]["t"], state["mixed"]["t"]) and loaded["mixed"]["n"] == 7
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert verify_checkpoint(ckpt).ok


def test_user_classes_need_the_allow_list_or_the_opt_in(tmp_path: Path):
    ckpt = save(tmp_path / "ckpt", {"cfg": Config(3)})
    with pytest.raises(CheckpointException, match="UnsafeItemError: .*test_objects.Config"):
        dcp.load({"cfg": None}, storage_reader=NVMeReader(ckpt, direct_io=False), no_dist=True)
    loaded = {"cfg": None}
    with torch.serialization.safe_globals([Config]):
        dcp.load(loaded, storage_reader=NVMeReader(ckpt, direct_io=False), no_dist=True)
    assert isinstance(loaded["cfg"], Config) and loaded["cfg"].depth == 3
    loaded = {"cfg": None}
    dcp.load(loaded, storage_reader=NVMeReader(ckpt, direct_io=False, allow_pickle=True), no_dist=True)
    assert loaded["cfg"].depth == 3


def test_tensor_in_checkpoint_where_an_object_is_expected_names_the_key(tmp_path: Path):
    ckpt = save(tmp_path / "ckpt", {"step": torch.ones(2)})
    victim = {"step": 5}
    with pytest.raises(CheckpointException, match="for step"):  # DCP refuses while planning
        dcp.load(victim, storage_reader=NVMeReader(ckpt, direct_io=False), no_dist=True)
    assert victim == {"step": 5}


@pytest.mark.slow  # other processes
def test_verify_lists_items_that_need_the_opt_in_apart_from_integrity(hostile):
    """An intact checkpoint is intact whatever its items' pickles import: verify lists the items
    that only allow_pickle=True loads, with what they import, and says OK."""
    ckpt, marker = hostile
    report = verify_checkpoint(ckpt)
    assert report.ok and report.problems == []
    assert sorted(item.split(":")[0] for item in report.needs_pickle) == ["step", "weight"]
    assert all("posix.mkdir" in item for item in report.needs_pickle), report.needs_pickle
    assert verify_checkpoint(ckpt, allow_pickle=True).needs_pickle == report.needs_pickle
    assert not marker.exists()

    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = [sys.executable, "-m", "dcp_nvme", "verify", str(ckpt), "--no-progress"]
    said = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    assert said.returncode == 0, said.stdout + said.stderr
    assert "PICKLE weight: it imports posix.mkdir" in said.stdout and "allow_pickle=True" in said.stdout
    assert "OK " in said.stdout and "BAD" not in said.stdout
    as_json = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert as_json.returncode == 0, as_json.stderr
    assert len(json.loads(as_json.stdout)["needs_pickle"]) == 2
    damaged = next(ckpt.glob("rank_*"))
    with open(damaged, "r+b") as f:  # integrity still fails as before
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert subprocess.run(run, capture_output=True, text=True, timeout=120, env=env).returncode == 1
    assert not marker.exists()


def test_a_save_says_which_items_need_the_opt_in(tmp_path: Path, torch_safe_globals_of_torch_only):
    """What users keep in a state (an argparse.Namespace, numpy's RNG state) saves fine but only
    loads with allow_pickle=True: the save says so, naming each item and the option."""
    import argparse

    import numpy as np

    from dcp_nvme.save import items

    items._pickle_checked.clear()
    state = {"args": argparse.Namespace(lr=0.1), "rng": np.random.get_state(), "step": 7, "w": torch.ones(2)}
    with pytest.warns(UserWarning) as said:
        save(tmp_path / "ckpt", state)
    text = [str(w.message) for w in said if "allow_pickle=True" in str(w.message)]
    assert any("'args' imports argparse.Namespace" in t for t in text), text
    assert any("'rng'" in t and "numpy" in t for t in text), text
    assert not any("'step'" in t for t in text), text  # a plain value loads by default
    loaded = {"args": None, "rng": None, "step": 0, "w": torch.zeros(2)}
    with pytest.raises(CheckpointException, match="UnsafeItemError"):
        dcp.load(loaded, storage_reader=NVMeReader(tmp_path / "ckpt", direct_io=False), no_dist=True)
    dcp.load(loaded, storage_reader=NVMeReader(tmp_path / "ckpt", direct_io=False, allow_pickle=True), no_dist=True)
    assert loaded["args"].lr == 0.1 and loaded["step"] == 7


class BufferState:
    """A Stateful that keeps a buffer, as in PyTorch's own test_e2e_save_and_load."""

    def __init__(self, data: bytes) -> None:
        self.buffer = io.BytesIO(data)

    def state_dict(self) -> dict:
        return {"buffer": self.buffer}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = state["buffer"]


def test_a_bytesio_round_trips_safely_as_its_bytes(tmp_path: Path):
    """A BytesIO is only bytes: it loads without the opt-in, with the same bytes and position,
    top-level, in a Stateful, and next to other values; verify does not call it unsafe."""
    data = bytes(range(256)) * 9
    saved = io.BytesIO(data)
    saved.seek(17)
    ckpt = save(tmp_path / "ckpt", {"b": saved, "empty": io.BytesIO(), "s": BufferState(b"stateful"),
                                    "w": torch.arange(3.0), "no_bytes": b""})
    loaded = {"b": io.BytesIO(), "empty": io.BytesIO(b"x"), "s": BufferState(b""), "w": torch.zeros(3),
              "no_bytes": b"x"}
    dcp.load(loaded, storage_reader=NVMeReader(ckpt, direct_io=False), no_dist=True)
    assert isinstance(loaded["b"], io.BytesIO) and loaded["b"].getvalue() == data and loaded["b"].tell() == 17
    assert loaded["empty"].getvalue() == b""
    assert loaded["s"].buffer.getvalue() == b"stateful"
    assert torch.equal(loaded["w"], torch.arange(3.0)) and loaded["no_bytes"] == b""
    assert verify_checkpoint(ckpt).ok


class HugeBytes:
    """A pickle that names only ``bytes``, but calls it to allocate a TiB."""

    def __reduce__(self):
        return (bytes, (1 << 40,))


@pytest.mark.parametrize("value", ["code", "huge"])
def test_a_bytesio_next_to_code_is_still_refused(tmp_path: Path, value):
    """Allowing bytes and BytesIO allows nothing else: a pickle naming them and a callable is
    refused, and so is ``bytes(n)`` (only ``bytes()`` is how ``b""`` is pickled)."""
    marker = tmp_path / "marker"
    hostile = Payload(str(marker)) if value == "code" else HugeBytes()
    ckpt = save(tmp_path / "ckpt", {"mix": [io.BytesIO(b"x"), hostile]})
    with pytest.raises(CheckpointException, match="UnsafeItemError"):
        dcp.load({"mix": None}, storage_reader=NVMeReader(ckpt, direct_io=False), no_dist=True)
    assert not marker.exists()
