"""Trainer integration scenarios: real trainer libraries on CPU + gloo, checkpointing through
dcp_nvme (NVMeWriter / NVMeReader / NVMeStager), resumed at 2 and 1 ranks.

Each ``test_scenario`` runs one scenario's ``run(root)`` (a single spawn of 2 processes, see
dcp_nvme_harness/scenarios.py) and then checks on disk that the checkpoints are dcp_nvme's (manifest.json +
rank_*.safetensors). The other tests are single-process: Megatron's tools after only the import
(registration, ``remove_sharded_tensors``), torchtitan's config fields and discovery, remote
folders left to torchtitan, the one private touch-point of each of Lightning and Megatron, and
the imports (no trainer imported by ``dcp_nvme``; a missing trainer named). Tests are skipped
when their trainer library is not installed
(``pip install -c constraints.txt -r integration/requirements.txt``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INTEGRATIONS = {"lightning": "lightning", "torchtitan": "torchtitan", "megatron": "megatron-core"}
"""dcp_nvme.integrations.<name> -> the pip package of its trainer."""
TRAINER_MODULES = ("lightning", "pytorch_lightning", "lightning_fabric", "torchtitan", "megatron")


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
    importlib.import_module(f"integration.{scenario}").run(tmp_path)


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter with this checkout first on the path; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_package_imports_no_trainer() -> None:
    """``import dcp_nvme`` and ``import dcp_nvme.integrations`` leave every trainer unimported."""
    out = _python("import sys, json; import dcp_nvme; import dcp_nvme.integrations; "
                  f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {TRAINER_MODULES!r})))")
    assert json.loads(out) == []


def test_missing_trainer_names_the_package(tmp_path, monkeypatch) -> None:
    """With its trainer absent (``sys.modules[name] = None``), importing an integration raises an
    ImportError that names the pip package; a module that is there but misses one of its own
    imports keeps its own error."""
    out = _python(f"""
import json, sys
for name in ("lightning", "torchtitan", "megatron"):
    sys.modules[name] = None
errors = {{}}
for integration in {sorted(INTEGRATIONS)!r}:
    try:
        __import__("dcp_nvme.integrations." + integration)
    except ImportError as exc:
        errors[integration] = [type(exc).__name__, str(exc)]
print(json.dumps(errors))
""")
    got = json.loads(out)
    assert got == {name: ["ModuleNotFoundError", f"dcp_nvme.integrations.{name} needs {pip}: pip install {pip}"]
                   for name, pip in INTEGRATIONS.items()}

    from dcp_nvme.lazy_imports import require

    (tmp_path / "half_installed.py").write_text("import no_such_dependency_of_half_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as missing:
        require("half_installed", needed_by="probe", install="half-installed")
    assert missing.value.name == "no_such_dependency_of_half_installed"


def test_lightning_private_touch_point() -> None:
    """_saves_sharded reads Lightning's save_distributed_checkpoint (its private attribute)."""
    if not _has("lightning"):
        pytest.skip("lightning is not installed (see integration/requirements.txt)")
    from dcp_nvme.integrations.lightning import NVMeModelParallelStrategy, _saves_sharded

    assert _saves_sharded(NVMeModelParallelStrategy()) is True
    assert _saves_sharded(NVMeModelParallelStrategy(save_distributed_checkpoint=False)) is False


class RunsCodeWhenUnpickled:
    """A value whose pickle runs a shell command on load (what a hostile checkpoint would hold)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_lightning_metadata_is_unpickled_weights_only_unless_asked(tmp_path, one_rank_group) -> None:
    """Lightning's default ``weights_only=None`` (and ``True``) refuses a metadata pickle that
    would run code, as stock Lightning's ``torch.load`` does; only ``weights_only=False`` runs it."""
    if not _has("lightning"):
        pytest.skip("lightning is not installed (see integration/requirements.txt)")
    import torch

    from dcp_nvme.errors import UnsafeItemError
    from dcp_nvme.integrations.lightning import NVMeModelParallelStrategy

    marker = tmp_path / "code-ran"
    strategy = NVMeModelParallelStrategy()
    strategy.model = torch.nn.Linear(3, 2)
    ckpt = tmp_path / "step-1.ckpt"
    strategy.save_checkpoint({"state_dict": strategy.model.state_dict(), "global_step": 1,
                              "hostile": RunsCodeWhenUnpickled(marker)}, ckpt)
    assert not marker.exists()
    for weights_only in (None, True):
        with pytest.raises(UnsafeItemError, match="weights_only=False") as refused:
            strategy.load_checkpoint(ckpt, weights_only=weights_only)
        assert str(ckpt) in str(refused.value)
        assert not marker.exists()
    loaded = strategy.load_checkpoint(ckpt, weights_only=False)
    assert marker.exists() and loaded["global_step"] == 1


def test_remove_items_rewrites_without_prefix(tmp_path) -> None:
    """What Megatron's remove_sharded_tensors runs: the kept items load bitwise, bytes items are
    carried unpickled, the removed ones are gone, the old files are replaced."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_nvme import NVMeReader, NVMeWriter
    from dcp_nvme.format.container import save_key_of
    from dcp_nvme.integrations._prune import remove_items

    ckpt = tmp_path / "iter_1"
    saved = {"model.w": torch.randn(6, 4), "model.b": torch.arange(5, dtype=torch.bfloat16),
             "optim.m": torch.randn(1000), "optim.step": torch.tensor(3), "meta": {"it": 1}}
    dcp.save(saved, storage_writer=NVMeWriter(ckpt), no_dist=True)
    old_files = {p.name for p in ckpt.iterdir()}
    size_before = sum(p.stat().st_size for p in ckpt.iterdir())

    assert remove_items(ckpt, "optim.") == ["optim.m", "optim.step"]
    assert sorted(NVMeReader(ckpt).read_metadata().state_dict_metadata) == ["meta.it", "model.b", "model.w"]
    old_saved = {n for n in old_files if save_key_of(n)}  # data files and tables of the first save
    assert old_saved and not old_saved & {p.name for p in ckpt.iterdir()}
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < size_before
    got = {"model.w": torch.zeros(6, 4), "model.b": torch.zeros(5, dtype=torch.bfloat16), "meta": {"it": 0}}
    dcp.load(got, storage_reader=NVMeReader(ckpt), no_dist=True)
    assert torch.equal(got["model.w"], saved["model.w"]) and torch.equal(got["model.b"], saved["model.b"])
    assert got["meta"] == {"it": 1}
    with pytest.raises(CheckpointException) as failed:
        dcp.load({"optim.m": torch.zeros(1000)}, storage_reader=NVMeReader(ckpt), no_dist=True)
    assert "optim.m" in str(failed.value.failures[0][0])
    assert remove_items(ckpt, "nothing.") == []
    with pytest.raises(ValueError, match="every item"):
        remove_items(ckpt, "")
    assert sorted(NVMeReader(ckpt).read_metadata().state_dict_metadata) == ["meta.it", "model.b", "model.w"]


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-rank gloo process group (torchtitan's CheckpointManager asks for ranks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _titan_parts(seed: int):
    import torch
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=10)
    return model, dict(dataloader=None, model_parts=[model], optimizers=optimizers,
                       lr_schedulers=lr_schedulers, states={}, sd_adapter=None)


def test_torchtitan_config_fields_save_and_newest_load(tmp_path, one_rank_group) -> None:
    """dcp_nvme fields set in a config_registry function and on torchtitan's command line reach
    the writer; load() picks the newest committed step-N (an uncommitted newer one is skipped)."""
    if not _has("torchtitan"):
        pytest.skip("torchtitan is not installed (see integration/requirements.txt)")
    import json
    import shutil

    import torch
    from torchtitan.config.manager import ConfigManager

    from dcp_nvme.integrations import torchtitan as tt

    config = ConfigManager().parse_args(["--module", "integration.torchtitan_nvme_config", "--config", "nvme_run",
                                         "--checkpoint.nvme_block_size", "1MiB"])
    assert type(config.checkpoint) is tt.NVMeCheckpointManager.Config
    assert (config.checkpoint.nvme_queue_depth, config.checkpoint.nvme_block_size) == (4, "1MiB")

    model, parts = _titan_parts(seed=0)
    manager = config.checkpoint.build(**parts, base_folder=str(tmp_path))
    assert isinstance(manager, tt.NVMeCheckpointManager)
    assert manager.save(curr_step=500)
    manager.close()
    step = tmp_path / "ckpt" / "step-500"
    written = json.loads((step / "manifest.json").read_text())["config"]
    assert (written["queue_depth"], written["block_size"]) == (4, 1 << 20)
    shutil.copytree(step, tmp_path / "ckpt" / "step-900")  # a save killed before its commit
    (tmp_path / "ckpt" / "step-900" / "manifest.json").unlink()
    assert tt.latest_step(str(tmp_path / "ckpt")) == 500

    fresh, parts = _titan_parts(seed=1)
    manager = config.checkpoint.build(**parts, base_folder=str(tmp_path))
    assert manager.load()
    manager.close()
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_torchtitan_config_carries_iofigs_shared_options_in_their_config_form(tmp_path, one_rank_group) -> None:
    """NVMeCheckpointManager.Config has a field ``nvme_<option>`` for each option IOConfig gives a
    trainer, in its form there (every engine IOConfig knows, ``uring`` too; a size as text), and
    each set field reaches the writer or the reader that takes it."""
    if not _has("torchtitan"):
        pytest.skip("torchtitan is not installed (see integration/requirements.txt)")
    import dataclasses
    import typing

    from dcp_nvme import config as io
    from dcp_nvme.integrations import torchtitan as tt

    added = {f.name for f in dataclasses.fields(tt.NVMeCheckpointManager.Config)} - \
        {f.name for f in dataclasses.fields(tt.CheckpointManager.Config)}
    assert added == {f"nvme_{name}" for name in io.IO_OPTIONS}
    hints = typing.get_type_hints(tt.NVMeCheckpointManager.Config)
    assert set(typing.get_args(typing.get_args(hints["nvme_engine"])[0])) == set(io.ENGINES)
    assert tt.NVMeCheckpointManager.Config._owner is tt.NVMeCheckpointManager
    config = tt.NVMeCheckpointManager.Config(enable=True, folder="ckpt", nvme_engine="uring",
                                             nvme_block_size="1MiB", nvme_verify=False)
    assert tt._io_options(config) == {"block_size": "1MiB", "engine": "uring", "verify": False}
    _, parts = _titan_parts(seed=0)
    manager = config.build(**parts, base_folder=str(tmp_path))
    try:
        writer = manager._nvme_writer_factory(str(tmp_path / "w"))
        assert (writer.config.block_size, writer.config.engine) == (1 << 20, "uring")
        reader = manager._nvme_reader_factory(str(tmp_path / "r"))
        assert (reader.config.block_size, reader.config.engine, reader.config.verify) == (1 << 20, "uring", False)
    finally:
        manager.close()


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_torchtitan_async_modes_wait_for_the_background_copy(tmp_path, one_rank_group, monkeypatch, mode) -> None:
    """NVMeStager copies host tensors on its own thread. torchtitan's ``async`` mode never waits
    for staging, so the manager's save waits for the copy; ``async_with_pinned_mem`` waits in
    ``maybe_wait_for_staging`` before its optimizer step. Either way the checkpoint holds the
    values of the save although the parameters change right after that wait."""
    if not _has("torchtitan"):
        pytest.skip("torchtitan is not installed (see integration/requirements.txt)")
    import threading

    import torch

    from dcp_nvme.integrations.torchtitan import NVMeCheckpointManager
    from dcp_nvme.save import arena
    from dcp_nvme.save import stager as stager_module

    copying = threading.Event()

    def slow_copy(dst, src):  # a copy that is still running when the step would come
        copying.set()
        threading.Event().wait(0.3)
        arena.copy_host_chunked(dst, src)

    monkeypatch.setattr(stager_module, "copy_host_chunked", slow_copy)
    config = NVMeCheckpointManager.Config(enable=True, folder="ckpt", keep_latest_k=0, async_mode=mode)
    model, parts = _titan_parts(seed=0)
    manager = NVMeCheckpointManager(config, **parts, base_folder=str(tmp_path))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    assert manager.save(curr_step=500)
    manager.maybe_wait_for_staging()  # what torchtitan's trainer calls before optimizers.step()
    assert copying.is_set()  # the copy went through the stager's staging thread
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1).add_(3)
    manager.close()
    fresh, parts = _titan_parts(seed=1)
    manager = NVMeCheckpointManager(config, **parts, base_folder=str(tmp_path))
    assert manager.load(step=500)
    manager.close()
    for name, value in expected.items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_torchtitan_manager_is_found_where_each_release_keeps_it(monkeypatch) -> None:
    """torchtitan moved its manager to ``torchtitan.components.checkpointer``; the module of
    before (``torchtitan.components.checkpoint``) is an alias in 0.3 that later releases drop.
    The integration imports without that alias, and with only it (a release before the move)."""
    if not _has("torchtitan"):
        pytest.skip("torchtitan is not installed (see integration/requirements.txt)")
    import types

    import torchtitan.components.checkpointer as moved

    def fresh_import() -> types.ModuleType:
        monkeypatch.delitem(sys.modules, "dcp_nvme.integrations.torchtitan", raising=False)
        return importlib.import_module("dcp_nvme.integrations.torchtitan")

    monkeypatch.setitem(sys.modules, "torchtitan.components.checkpoint", None)  # a release without the alias
    assert fresh_import().CheckpointManager is moved.CheckpointManager
    old = types.ModuleType("torchtitan.components.checkpoint")  # a release before the move
    old.MODEL, old.AsyncMode, old.CheckpointManager = moved.MODEL, moved.AsyncMode, moved.CheckpointManager
    monkeypatch.setitem(sys.modules, "torchtitan.components.checkpoint", old)
    monkeypatch.setitem(sys.modules, "torchtitan.components.checkpointer", None)
    assert fresh_import().NVMeCheckpointManager.__mro__[1] is moved.CheckpointManager


def test_torchtitan_remote_folder_stays_torchtitans(tmp_path, one_rank_group) -> None:
    """A remote checkpoint.folder (fsspec URL) is saved, found and loaded by torchtitan's own
    path (DCP's fsspec writer, .metadata), not rejected by dcp_nvme's local writer."""
    if not _has("torchtitan"):
        pytest.skip("torchtitan is not installed (see integration/requirements.txt)")
    import fsspec
    import torch

    from dcp_nvme.integrations.torchtitan import NVMeCheckpointManager

    folder = f"memory://titan-{tmp_path.name}/ckpt"
    config = NVMeCheckpointManager.Config(enable=True, folder=folder, keep_latest_k=0)
    model, parts = _titan_parts(seed=0)
    manager = config.build(**parts)
    assert manager.save(curr_step=500)
    manager.close()
    fs = fsspec.filesystem("memory")
    assert fs.isfile(f"{folder}/step-500/.metadata")

    fresh, parts = _titan_parts(seed=1)
    manager = config.build(**parts)
    assert manager.load()
    manager.close()
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_megatron_private_touch_point(one_rank_group) -> None:
    """_to_pyt (megatron-core's private translation helpers): DCP keys are the sharded keys, the
    save side drops non-main replicas when asked, and the inverse restores nesting, lists and
    non-str keys with the same tensors."""
    if not _has("megatron.core"):
        pytest.skip("megatron.core is not installed (see integration/requirements.txt)")
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    from dcp_nvme.integrations import megatron as nv

    w, b = torch.randn(4, 2), torch.arange(3.0)
    state = {"decoder": {"w": ShardedTensor.from_rank_offsets("decoder.w", w, (0, 0, 1)),
                         3: [ShardedTensor.from_rank_offsets("decoder.3.b", b, (0, 0, 1))]}}
    pyt, back = nv._to_pyt(state, is_loading=True)
    assert sorted(pyt) == ["decoder.3.b", "decoder.w"]
    out = back(pyt)
    assert list(out) == ["decoder"] and sorted(out["decoder"], key=str) == [3, "w"]
    assert torch.equal(out["decoder"]["w"], w) and torch.equal(out["decoder"][3][0], b)

    replicated = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2), (0, 0, 1)),
                  "r": ShardedTensor.from_rank_offsets("r", torch.ones(2), (0, 0, 1), replica_id=1)}
    assert sorted(nv._to_pyt(replicated, is_loading=False, keep_only_main_replica=True)[0]) == ["a"]
    assert sorted(nv._to_pyt(replicated, is_loading=False)[0]) == ["a", "r"]


def test_megatron_tensors_metadata_passes_torch_empty_only_its_own_fields() -> None:
    """load_tensors_metadata makes each tensor from the metadata's TensorProperties: torch 2.15
    adds a field there (``strides``) that torch.empty does not take."""
    if not _has("megatron.core"):
        pytest.skip("megatron.core is not installed (see integration/requirements.txt)")
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcp_nvme.integrations.megatron import NVMeLoadShardedStrategy

    props = TensorProperties(dtype=torch.bfloat16)
    props.strides = (4, 1)  # as torch 2.15 records it
    chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4]))
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([2, 4]), [chunk])})
    (got,) = NVMeLoadShardedStrategy().load_tensors_metadata("unused", metadata=metadata).values()
    assert (got.key, got.dtype, tuple(got.local_shape)) == ("w", torch.bfloat16, (2, 4))


def test_megatron_tools_after_one_import(tmp_path, one_rank_group) -> None:
    """A 1-rank Megatron checkpoint written through install(); then, in a fresh process that
    only imports dcp_nvme.integrations.megatron, Megatron's own tools resolve the backend, read
    it and remove_sharded_tensors drops the optimizer items (megatron_tools_check.py)."""
    if not _has("megatron.core"):
        pytest.skip("megatron.core is not installed (see integration/requirements.txt)")
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from dcp_nvme.integrations import megatron as nv

    def sharded(key, shape):
        return ShardedTensor.from_rank_offsets(key, torch.randn(*shape), (0, 0, 1))

    ckpt = tmp_path / "iter_0000004"
    ckpt.mkdir()
    state = {"model": {"w1": sharded("model.w1", (8, 4)), "w2": sharded("model.w2", (1, 8))},
             "optim": {"w1": sharded("optim.w1.exp_avg", (8, 4)),
                       "step": ShardedTensor.from_rank_offsets("optim.step", torch.tensor([4.0]))},
             "iteration": 4}
    dist_checkpointing.save(state, str(ckpt), sharded_strategy=nv.install())
    tools = Path(__file__).resolve().parent / "megatron_tools_check.py"
    proc = subprocess.run([sys.executable, str(tools), str(ckpt)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "megatron tools check OK" in proc.stdout
