"""Megatron-Core ``dist_checkpointing`` integration.

Provides save/load sharded strategies (subclasses of
``megatron.core.dist_checkpointing.strategies.torch.TorchDistSaveShardedStrategy``
/ ``TorchDistLoadShardedStrategy``) that write the sharded part of a Megatron
checkpoint with dcp_nvme instead of Megatron's ``FileSystemWriterAsync`` and read
it with ``NVMeReader`` instead of ``_get_filesystem_reader``.

Importing this module imports megatron-core and registers both strategies under backend
``('dcp_nvme', 1)``, so Megatron's own tools (``dist_checkpointing.load``,
``load_tensors_metadata``, ``remove_sharded_tensors``...) find them from a checkpoint's
``metadata.json`` after that one import. Usage::

    import dcp_nvme
    from dcp_nvme.integrations import megatron as nv
    save_strategy = nv.install(checkpointing_context)   # Megatron-LM: its checkpointing_context (or None)
    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=save_strategy)
    req = dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=save_strategy,
                                  async_sharded_save=True)     # -> AsyncRequest
    req.execute_sync()                                         # or Megatron's AsyncCallsQueue
    ckpt_dir = dcp_nvme.latest(root, extra_markers=("metadata.json",))
    state = dist_checkpointing.load(sharded_sd, ckpt_dir)     # metadata.json says backend 'dcp_nvme'

Layout: ``<ckpt_dir>/common.pt`` and ``<ckpt_dir>/metadata.json`` are written by Megatron as
usual (``metadata.json`` last: it is Megatron's commit marker); the sharded tensors/objects are
a dcp_nvme checkpoint in ``<ckpt_dir>`` itself (``manifest.json``, its own commit marker), or in
``<ckpt_dir>/<subdir>`` when ``install(subdir=...)`` names one.

Async: ``async_save`` stages the state dict (NVMeStager) and starts
``torch.distributed.checkpoint.async_save`` on a dedicated gloo process group
*before returning*; the returned ``AsyncRequest`` has ``async_fn=None`` (no-op)
and a finalize function that waits for the upload.  Megatron appends its own
finalize (``metadata.json`` + barrier) after it.

Without megatron-core the import raises an ImportError that names the package to install
(``pip install megatron-core``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_nvme.integrations._common import (
    ReaderFactory,
    StagerFactory,
    WriterFactory,
    make_reader,
    make_stager,
    make_writer,
    wait_future,
)
from dcp_nvme.integrations._prune import remove_items
from dcp_nvme.lazy_imports import require

_NEEDS = {"needed_by": __name__, "install": "megatron-core"}
_dict_utils = require("megatron.core.dist_checkpointing.dict_utils", **_NEEDS)
_mapping = require("megatron.core.dist_checkpointing.mapping", **_NEEDS)
_async_utils = require("megatron.core.dist_checkpointing.strategies.async_utils", **_NEEDS)
_base = require("megatron.core.dist_checkpointing.strategies.base", **_NEEDS)
_mcore_torch = require("megatron.core.dist_checkpointing.strategies.torch", **_NEEDS)
ShardedObject, ShardedTensor = _mapping.ShardedObject, _mapping.ShardedTensor
# Any: classes of modules require() imports at run time, which mypy does not follow
AsyncRequest: Any = _async_utils.AsyncRequest
StrategyAction = _base.StrategyAction
MCoreLoadPlanner, MCoreSavePlanner = _mcore_torch.MCoreLoadPlanner, _mcore_torch.MCoreSavePlanner
TorchDistSaveShardedStrategy: Any = _mcore_torch.TorchDistSaveShardedStrategy
TorchDistLoadShardedStrategy: Any = _mcore_torch.TorchDistLoadShardedStrategy

__all__ = [
    "BACKEND",
    "VERSION",
    "NVMeSaveShardedStrategy",
    "NVMeLoadShardedStrategy",
    "register_strategies",
    "install",
]

BACKEND = "dcp_nvme"
VERSION = 1
DEFAULT_SUBDIR = ""
"""Where the storage writer's files go inside a Megatron checkpoint: the directory itself."""


def _sharded_dir(checkpoint_dir, subdir: str) -> Path:
    return Path(checkpoint_dir) / subdir if subdir else Path(checkpoint_dir)


def _to_pyt(sharded_state_dict: dict, *, is_loading: bool, keep_only_main_replica: bool = False
            ) -> tuple[dict[str, Any], Callable[[dict[str, Any]], dict]]:
    """Megatron's translation of a sharded state dict into a DCP state dict keyed by the sharded
    keys, and the inverse for that dict once loaded (back to the caller's nesting and key types),
    exactly as ``TorchDistSaveShardedStrategy.async_save`` / ``TorchDistLoadShardedStrategy.load``
    do it.

    The one place that touches megatron-core's private helpers (``strategies.torch``:
    ``_replace_state_dict_keys_with_sharded_keys``, ``_replace_sharded_keys_with_state_dict_keys``,
    ``_unwrap_pyt_sharded_tensor``, ``_restore_dict_types``): megatron-core 0.16 has no public
    form of them. Tested by integration/test_integrations.py::test_megatron_private_touch_point."""
    sd, flat_mapping, rename_mapping = _mcore_torch._replace_state_dict_keys_with_sharded_keys(
        sharded_state_dict, keep_only_main_replica
    )
    pyt_state_dict = _mcore_torch.mcore_to_pyt_state_dict(sd, is_loading)

    def back(loaded: dict[str, Any]) -> dict:
        out = {k: _mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in loaded.items()}
        out = _mcore_torch._replace_sharded_keys_with_state_dict_keys(out, flat_mapping, rename_mapping)
        _mcore_torch._restore_dict_types(out, sharded_state_dict)
        return out

    return pyt_state_dict, back


class _AlreadyStaged:
    """AsyncStager that hands the (already staged) state dict through."""

    should_synchronize_after_execute = False
    _synchronize_after_execute = False  # what torch's AsyncStager protocol keeps the above in

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self):
        pass

    def close(self):
        pass


class NVMeSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """Sharded save strategy writing through a DCP StorageWriter (dcp_nvme by default)."""

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        keep_only_main_replica: bool = True,
        *,
        subdir: str = DEFAULT_SUBDIR,
        writer_factory=None,
        stager_factory=None,
        process_group: Any | None = None,
    ):
        super().__init__(backend, version, keep_only_main_replica=keep_only_main_replica)
        self.subdir = subdir
        self.writer_factory = writer_factory
        self.stager_factory = stager_factory
        self._pg = process_group
        self._stager = None
        self._pending: Future[Any] | AsyncSaveResponse | None = None

    def _prepare(self, sharded_state_dict, checkpoint_dir):
        pyt_state_dict, _ = _to_pyt(sharded_state_dict, is_loading=False,
                                    keep_only_main_replica=self.keep_only_main_replica)
        path = _sharded_dir(checkpoint_dir, self.subdir)
        planner = MCoreSavePlanner(
            dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
        )
        return pyt_state_dict, make_writer(str(path), self.writer_factory), planner

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        self.wait()
        pyt_state_dict, writer, planner = self._prepare(sharded_state_dict, checkpoint_dir)
        dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)

    def _stage(self, sharded_state_dict):
        # Megatron translates ShardedTensors to CheckpointableShardedTensor, which
        # rejects every tensor op (checkpointable.py: __torch_dispatch__ raises), so
        # neither torch's DefaultStager nor NVMeStager can stage the translated dict.
        # Stage the local shards *before* translation instead, through the stager,
        # as a flat {index: tensor} dict.
        if self._stager is None:
            self._stager = make_stager(self.stager_factory)
        sh_tens = [v for v in _dict_utils.nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        staged = self._stager.stage({str(i): t.data for i, t in enumerate(sh_tens)})
        if isinstance(staged, Future):
            staged = staged.result()
        if getattr(self._stager, "should_synchronize_after_execute", False):
            self._stager.synchronize_staging()
        by_id = {id(t): staged[str(i)] for i, t in enumerate(sh_tens)}

        def swap(v):
            if isinstance(v, ShardedTensor) and id(v) in by_id:
                return dataclasses.replace(v, data=by_id[id(v)])
            return v

        return _dict_utils.dict_list_map_outplace(swap, sharded_state_dict)

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        self.wait()
        staged_sd = self._stage(sharded_state_dict)
        pyt_state_dict, writer, planner = self._prepare(staged_sd, checkpoint_dir)
        if self._pg is None:
            # collectives of the upload thread must not share the training PG
            self._pg = dist.new_group(backend="gloo")
        fut = dcp.async_save(
            pyt_state_dict,
            storage_writer=writer,
            planner=planner,
            process_group=self._pg,
            async_stager=_AlreadyStaged(),
        )
        self._pending = fut

        def finalize_fn():
            if self._pending is fut:
                self._pending = None
            wait_future(fut)

        return AsyncRequest(None, (), [finalize_fn])

    def wait(self) -> None:
        fut, self._pending = self._pending, None
        wait_future(fut)

    def close(self) -> None:
        self.wait()
        if self._stager is not None and hasattr(self._stager, "close"):
            self._stager.close()
        self._stager = None


class NVMeLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Sharded load strategy reading through a DCP StorageReader.

    Mirrors ``TorchDistLoadShardedStrategy.load`` (megatron-core 0.16.1), which
    hard-codes ``_get_filesystem_reader``; only the reader differs.
    """

    def __init__(self, *, subdir: str = DEFAULT_SUBDIR, reader_factory=None):
        super().__init__()
        self.subdir = subdir
        self.reader_factory = reader_factory

    def _reader(self, checkpoint_dir):
        return make_reader(str(_sharded_dir(checkpoint_dir, self.subdir)), self.reader_factory)

    def remove_sharded_tensors(self, checkpoint_dir, key_prefix: str) -> None:
        """Megatron's ``dist_checkpointing.remove_sharded_tensors``: rewrite the checkpoint
        without the items whose key starts with ``key_prefix`` (see ``_prune``). Run it in
        one process; other ranks must not read the checkpoint meanwhile."""
        path = str(_sharded_dir(checkpoint_dir, self.subdir))
        removed = remove_items(path, key_prefix, reader_factory=self.reader_factory)
        if not removed:
            warnings.warn(f"{path} holds no item whose key starts with {key_prefix!r}; nothing removed",
                          stacklevel=2)

    def load(self, sharded_state_dict, checkpoint_dir):
        flexible_shape = [
            t for t in _dict_utils.nested_values(sharded_state_dict)
            if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch
        ]
        allow_mismatch = {
            t.key: t for t in _dict_utils.nested_values(sharded_state_dict)
            if isinstance(t, ShardedTensor) and t.allow_shape_mismatch
        }
        pyt_state_dict, back = _to_pyt(sharded_state_dict, is_loading=True)
        reader = self._reader(checkpoint_dir)
        dcp.load(
            pyt_state_dict,
            storage_reader=reader,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=flexible_shape,
                allow_shape_mismatch_sharded_tensors=allow_mismatch,
            ),
        )
        return back(pyt_state_dict)

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        if metadata is None:
            metadata = self._reader(checkpoint_dir).read_metadata()
        result = {}
        for k, tp in metadata.state_dict_metadata.items():
            if isinstance(tp, TensorStorageMetadata):
                # the fields torch.empty takes, by name: torch 2.15's TensorProperties adds ``strides``
                props = tp.properties
                result[k] = ShardedTensor.from_rank_offsets(
                    k, torch.empty(tp.size, dtype=props.dtype, layout=props.layout,
                                   requires_grad=props.requires_grad, pin_memory=props.pin_memory,
                                   memory_format=props.memory_format, device="meta")
                ).without_data()
        return result

    def load_sharded_metadata(self, checkpoint_dir):
        metadata = self._reader(checkpoint_dir).read_metadata()
        result = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                result[obj.unique_key] = obj
        result.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return result


def register_strategies(*, writer_factory: WriterFactory | None = None,
                        reader_factory: ReaderFactory | None = None,
                        stager_factory: StagerFactory | None = None, subdir: str = DEFAULT_SUBDIR) -> None:
    """Register the strategies under backend ``('dcp_nvme', 1)`` so that
    ``dist_checkpointing.save(..., sharded_strategy=('dcp_nvme', 1))`` and a plain
    ``dist_checkpointing.load(sd, dir)`` of a dcp_nvme checkpoint (its
    ``metadata.json`` names the backend) use them.  Uses Megatron's public
    ``register_default_strategy``; nothing is patched."""
    _base.register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
        NVMeSaveShardedStrategy(subdir=subdir, writer_factory=writer_factory, stager_factory=stager_factory),
    )
    _base.register_default_strategy(
        StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
        NVMeLoadShardedStrategy(subdir=subdir, reader_factory=reader_factory),
    )


def install(checkpointing_context: dict | None = None, *, writer_factory: WriterFactory | None = None,
            reader_factory: ReaderFactory | None = None, stager_factory: StagerFactory | None = None,
            subdir: str = DEFAULT_SUBDIR) -> NVMeSaveShardedStrategy:
    """The one call for a Megatron(-LM) run: registers both strategies under ``('dcp_nvme', 1)``
    (see :func:`register_strategies`) and, when given Megatron-LM's ``checkpointing_context``
    dict, seeds its ``"save_strategy"`` with the registered save strategy. Returns that strategy.

    Why the context: Megatron-LM's ``save_checkpoint`` takes ``checkpointing_context["save_strategy"]``
    when present and otherwise calls ``get_default_save_sharded_strategy("torch_dist")``, whose
    lookup re-registers Megatron's own ``torch_dist`` strategies on every call, so a registration
    under ``torch_dist`` would not stick. Loads need no context: ``metadata.json`` of a checkpoint
    written this way names backend ``dcp_nvme``, and ``get_default_load_sharded_strategy`` resolves
    it to the registered load strategy.
    """
    register_strategies(writer_factory=writer_factory, reader_factory=reader_factory,
                        stager_factory=stager_factory, subdir=subdir)
    strategy = _base.get_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION)
    if checkpointing_context is not None:
        checkpointing_context["save_strategy"] = strategy
    return strategy


def _register_at_import() -> None:
    """Megatron tools that never call :func:`install` find the strategies by backend name."""
    register_strategies()


_register_at_import()
