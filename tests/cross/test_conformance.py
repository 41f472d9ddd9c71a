"""Conformance: every behaviour DCP's own tests expect of a storage layer, for the stock
FileSystemWriter/FileSystemReader and for NVMeWriter/NVMeReader side by side.

Each test is parametrised over the two backends, so a behavioural difference shows as a pair in
which ``stock`` passes and ``nvme`` fails. Multi-rank cases live in ``conformance_ranks.py`` and
run in one spawned gloo group per world size (4 ranks, then 2); single-process cases run here.
Where dcp_nvme differs on purpose (``overwrite`` defaults to False) the test asserts the
documented difference; see docs/compat.md.
"""

from __future__ import annotations

import io
import json
import os
import time
import warnings
from fractions import Fraction

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from dcp_nvme_harness.conformance_backends import BACKENDS, assert_bitwise, full_tensor
from dcp_nvme_harness.conformance_ranks import CROSS_WORLD, cases_for, worker
from dcp_nvme_harness.dist_utils import free_port, preload_in_forkserver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.stateful import Stateful

pytestmark = pytest.mark.filterwarnings("ignore")

BACKEND_NAMES = list(BACKENDS)
SPAWN_DEADLINE_S = 300


# --------------------------------------------------------------------------- multi-rank runs


def _run_world(world: int, root: str, shared: str, out_dir: str) -> dict[str, list[str]]:
    """Spawn ``world`` ranks running every case; (backend:case) -> each rank's outcome."""
    os.makedirs(out_dir, exist_ok=True)
    # forkserver: torch and the cases are imported once, in the server, and each rank is forked
    # from it (a spawned rank imports torch itself: 4 imports at once on 2 loaded cores is minutes)
    preload_in_forkserver("dcp_nvme_harness.conformance_ranks")
    context = mp.start_processes(worker, args=(world, free_port(), root, shared, out_dir), nprocs=world,
                                 join=False, start_method="forkserver")
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    failure = None
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                failure = f"the {world}-rank run did not finish in {SPAWN_DEADLINE_S} s"
                break
    except Exception as exc:  # a rank died outside any case
        failure = f"the {world}-rank run failed: {exc}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    outcomes: dict[str, list[str]] = {}
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        recorded = json.load(open(path)) if os.path.exists(path) else {}
        for backend in BACKENDS:
            for name in cases_for(world):
                key = f"{backend}:{name}"
                outcomes.setdefault(key, []).append(recorded.get(key, failure or "no outcome recorded"))
    return outcomes


@pytest.fixture(scope="module")
def spawn_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("conformance"))


@pytest.fixture(scope="module")
def four_ranks(spawn_root) -> dict[str, list[str]]:
    return _run_world(4, os.path.join(spawn_root, "w4"), os.path.join(spawn_root, "shared"),
                      os.path.join(spawn_root, "out4"))


@pytest.fixture(scope="module")
def two_ranks(spawn_root, four_ranks) -> dict[str, list[str]]:
    # after the 4-rank run: load_saved_by_4_ranks reads what it saved
    return _run_world(2, os.path.join(spawn_root, "w2"), os.path.join(spawn_root, "shared"),
                      os.path.join(spawn_root, "out2"))


def _check(outcomes: dict[str, list[str]], backend: str, name: str) -> None:
    per_rank = outcomes[f"{backend}:{name}"]
    failed = [(rank, text) for rank, text in enumerate(per_rank) if text != "ok"]
    if failed:
        pytest.fail("\n".join(f"rank {rank}: {text}" for rank, text in failed), pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", cases_for(4))
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_four_ranks(four_ranks, backend, name):
    _check(four_ranks, backend, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", cases_for(2))
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_two_ranks(two_ranks, backend, name):
    _check(two_ranks, backend, name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_one_process_loads_what_4_ranks_saved(four_ranks, spawn_root, backend):
    """A 4-rank DTensor + ShardedTensor checkpoint loaded with no process group (4 -> 1)."""
    _check(four_ranks, backend, "save_for_other_world_sizes")
    path = os.path.join(spawn_root, "shared", backend, CROSS_WORLD)
    dest = {"d": torch.zeros(12, 6), "s": torch.zeros(10, 4, dtype=torch.bfloat16), "step": 0}
    dcp.load(dest, storage_reader=BACKENDS[backend].reader(path), no_dist=True)
    assert_bitwise(dest["d"], full_tensor("xd", (12, 6)), "d")
    assert_bitwise(dest["s"], full_tensor("xs", (10, 4), torch.bfloat16), "s")
    assert dest["step"] == 5


# --------------------------------------------------------------------------- one process


@pytest.fixture(params=BACKEND_NAMES)
def backend(request):
    return BACKENDS[request.param]


ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
              torch.float8_e4m3fn, torch.float8_e5m2]


def test_plain_round_trip_every_dtype(backend, tmp_path):
    saved = {str(d).removeprefix("torch."): full_tensor(str(d), (5, 3), d) for d in ALL_DTYPES}
    saved["scalar"] = torch.tensor(3.5)
    saved["empty"] = torch.empty(0, 4)
    saved["view"] = full_tensor("view", (8, 6))[:, 1:4]  # a non-contiguous view: only its bytes
    dcp.save(saved, storage_writer=backend.writer(tmp_path / "c"), no_dist=True)
    dest = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"), no_dist=True)
    for key, value in saved.items():
        assert_bitwise(dest[key], value.contiguous(), key)


@pytest.mark.parametrize("saved_dtype,loaded_dtype", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float64), (torch.int32, torch.int64), (torch.float16, torch.float32),
])
def test_dtype_cast_on_load(backend, tmp_path, saved_dtype, loaded_dtype):
    saved = full_tensor("cast", (7, 5), saved_dtype)
    dcp.save({"t": saved, "row": saved[2]}, storage_writer=backend.writer(tmp_path / "c"))
    dest = {"t": torch.zeros(7, 5, dtype=loaded_dtype), "row": torch.zeros(5, dtype=loaded_dtype)}
    dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"))
    assert_bitwise(dest["t"], saved.to(loaded_dtype), "t")
    assert_bitwise(dest["row"], saved[2].to(loaded_dtype), "row")


def test_no_dist_empty_state(backend, tmp_path):
    dcp.save({}, storage_writer=backend.writer(tmp_path / "c"), no_dist=True)
    dcp.load({}, storage_reader=backend.reader(tmp_path / "c"), no_dist=True)
    assert backend.reader(tmp_path / "c").read_metadata().state_dict_metadata == {}


class _Empty(Stateful):
    def __init__(self) -> None:
        self.loaded = False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = True


class _RecordingDict(dict):
    """Tells whether DCP replaced a top-level value (it must not for a Stateful)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replaced = False

    def __setitem__(self, key, value) -> None:
        self.replaced = True
        super().__setitem__(key, value)


def test_stateful_empty_loads_in_place(backend, tmp_path):
    foo = _Empty()
    state = _RecordingDict(foo=foo)
    dcp.save(state, storage_writer=backend.writer(tmp_path / "c"))
    dcp.load(state, storage_reader=backend.reader(tmp_path / "c"))
    assert foo.loaded and state["foo"] is foo and not state.replaced


def test_non_stateful_values_are_replaced(backend, tmp_path):
    saved = {"foo": {"replicated": full_tensor("rep", (4, 4)), "bytes": [1, 2, 3, 4]}}
    dcp.save(saved, storage_writer=backend.writer(tmp_path / "c"))
    state = _RecordingDict(foo={"replicated": torch.zeros(4, 4), "bytes": None})
    dcp.load(state, storage_reader=backend.reader(tmp_path / "c"))
    assert state.replaced
    assert state["foo"]["bytes"] == [1, 2, 3, 4]
    assert_bitwise(state["foo"]["replicated"], saved["foo"]["replicated"], "replicated")


def test_bytes_items(backend, tmp_path):
    saved = {"obj": {"nested": (1, "two", 3.0)}, "none": None, "s": "text", "n": 12, "f": 0.25}
    dcp.save(saved, storage_writer=backend.writer(tmp_path / "c"))
    dest = {"obj": {"nested": None}, "none": 1, "s": "", "n": 0, "f": 0.0}
    dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"))
    assert dest == saved


def test_pickled_class_item_is_the_documented_difference(backend, tmp_path):
    """Stock unpickles any item (a checkpoint's pickle can run any code); ours refuses an item
    whose pickle imports a class unless allow_pickle=True, naming the item and the opt-in. A
    BytesIO is only its bytes: it loads by default in both."""
    blob = os.urandom(5000)
    dcp.save({"blob": io.BytesIO(blob), "ratio": Fraction(1, 3)}, storage_writer=backend.writer(tmp_path / "c"))
    dest = {"blob": io.BytesIO(), "ratio": None}
    if backend.name == "nvme":
        with pytest.raises(CheckpointException, match=r"'ratio'.*allow_pickle=True"):
            dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"))
    only_blob = {"blob": io.BytesIO()}
    dcp.load(only_blob, storage_reader=backend.reader(tmp_path / "c"))
    assert only_blob["blob"].getvalue() == blob
    dcp.load(dest, storage_reader=backend.reader(tmp_path / "c", trusted=True))
    assert dest["blob"].getvalue() == blob and dest["ratio"] == Fraction(1, 3)


def test_partial_load_of_chosen_keys(backend, tmp_path):
    saved = {"model": {"w": full_tensor("w", (6, 2)), "b": full_tensor("b", (2,))},
             "optim": {"state": {"m": full_tensor("m", (6, 2))}, "lr": 0.1}}
    dcp.save(saved, storage_writer=backend.writer(tmp_path / "c"))
    only_model = {"model": {"w": torch.zeros(6, 2)}}
    dcp.load(only_model, storage_reader=backend.reader(tmp_path / "c"))
    assert_bitwise(only_model["model"]["w"], saved["model"]["w"], "model.w")
    loaded = _load_state_dict_from_keys("optim.state", storage_reader=backend.reader(tmp_path / "c"))
    assert set(loaded) == {"optim"} and set(loaded["optim"]) == {"state"}
    assert_bitwise(loaded["optim"]["state"]["m"], saved["optim"]["state"]["m"], "optim.state.m")
    everything = _load_state_dict_from_keys(storage_reader=backend.reader(tmp_path / "c"))
    assert everything["optim"]["lr"] == 0.1
    assert_bitwise(everything["model"]["b"], saved["model"]["b"], "model.b")


def test_missing_key_fails_the_load(backend, tmp_path):
    dcp.save({"a": torch.ones(2)}, storage_writer=backend.writer(tmp_path / "c"))
    with pytest.raises((CheckpointException, RuntimeError), match="Missing key"):
        dcp.load({"a": torch.zeros(2), "b": torch.zeros(2)}, storage_reader=backend.reader(tmp_path / "c"))


def test_storage_meta_round_trip(backend, tmp_path):
    writer = backend.writer(tmp_path / "first")
    dcp.save({"t": torch.ones(2)}, storage_writer=writer, checkpoint_id=tmp_path / "c")  # reset() moves it
    assert writer.storage_meta().save_id == writer.save_id
    reader = backend.reader(tmp_path / "elsewhere")
    dest = {"t": torch.zeros(2)}
    dcp.load(dest, storage_reader=reader, checkpoint_id=tmp_path / "c")
    assert_bitwise(dest["t"], torch.ones(2), "t")
    meta = reader.read_metadata().storage_meta
    assert meta.save_id == writer.save_id and meta.load_id == reader.load_id
    assert os.fspath(meta.checkpoint_id) == os.fspath(tmp_path / "c")
    assert os.fspath(reader.checkpoint_id) == os.fspath(tmp_path / "c")
    before_save, before_load = writer.save_id, reader.load_id
    writer.reset()
    reader.reset()
    assert writer.save_id != before_save and reader.load_id != before_load  # new ids per operation


def test_same_metadata_as_stock(backend, tmp_path):
    """Our read_metadata describes a state like the stock reader does (keys, dtypes, shapes, chunks)."""
    state = {"w": full_tensor("w", (6, 3), torch.bfloat16), "n": 4, "b": io.BytesIO(b"xyz")}
    dcp.save(state, storage_writer=backend.writer(tmp_path / "c"))
    dcp.save(state, storage_writer=BACKENDS["stock"].writer(tmp_path / "ref"))
    ours = backend.reader(tmp_path / "c").read_metadata()
    ref = BACKENDS["stock"].reader(tmp_path / "ref").read_metadata()

    def summary(meta):
        out = {}
        for fqn, entry in meta.state_dict_metadata.items():
            if hasattr(entry, "chunks"):
                out[fqn] = (entry.properties.dtype, tuple(entry.size),
                            sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks))
            else:
                out[fqn] = type(entry).__name__
        return out

    assert summary(ours) == summary(ref)
    assert ours.version == ref.version


def test_overwrite_explicit(backend, tmp_path):
    first, second = full_tensor("1", (3,)), full_tensor("2", (3,))
    dcp.save({"v": first}, storage_writer=backend.writer(tmp_path / "c", overwrite=True))
    dcp.save({"v": second}, storage_writer=backend.writer(tmp_path / "c", overwrite=True))
    dest = {"v": torch.zeros(3)}
    dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"))
    assert_bitwise(dest["v"], second, "v")
    with pytest.raises(CheckpointException):
        dcp.save({"v": first}, storage_writer=backend.writer(tmp_path / "c", overwrite=False))
    dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"))
    assert_bitwise(dest["v"], second, "v after a refused save")


def test_overwrite_default_is_the_documented_difference(backend, tmp_path):
    """Stock overwrites by default (warning that this will change); dcp_nvme refuses and says how
    to opt in, because a checkpoint silently replaced by a mis-numbered step is lost work."""
    first, second = full_tensor("1", (3,)), full_tensor("2", (3,))
    dcp.save({"v": first}, storage_writer=backend.writer(tmp_path / "c"))
    dest = {"v": torch.zeros(3)}
    if backend.name == "stock":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"v": second}, storage_writer=backend.writer(tmp_path / "c"))
        dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"))
        assert_bitwise(dest["v"], second, "stock replaced the checkpoint")
    else:
        with pytest.raises(CheckpointException, match="overwrite=True"):
            dcp.save({"v": second}, storage_writer=backend.writer(tmp_path / "c"))
        dcp.load(dest, storage_reader=backend.reader(tmp_path / "c"))
        assert_bitwise(dest["v"], first, "dcp_nvme kept the checkpoint")

