"""torchtitan integration: a ``CheckpointManager`` whose local checkpoints go through dcp_nvme.

Hook points in torchtitan 0.3.0 (``torchtitan/components/checkpointer/{base,dcp}.py``):

* ``CheckpointManager.dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection,
  to_hf)`` and ``dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)``: public methods,
  overridden for local, non-HF checkpoints; everything else goes to torchtitan unchanged.
* ``BaseCheckpointManager._load(step)`` and ``_close()``: the hooks that torchtitan's base class
  documents for subclasses to override (its public ``load``/``close`` guard and dispatch to
  them). ``_load`` picks the newest committed ``step-N`` through :func:`dcp_nvme.checkpoints`
  when ``step == -1`` and hands the step to torchtitan's own ``_load``.
* ``Config``: a subclass of ``CheckpointManager.Config`` (torchtitan's config extension point:
  a ``Configurable`` nested Config builds its owner class) with the dcp_nvme I/O options that
  ``config.IOConfig`` gives a trainer (``config.IO_OPTIONS``), set
  wherever torchtitan sets config fields (a ``config_registry`` function, or
  ``--checkpoint.nvme_queue_depth 16`` on the command line).

A remote ``checkpoint.folder`` (``s3://``, ``gs://``...) stays torchtitan's: saves, discovery and
loads there use DCP's fsspec writer and reader exactly as stock torchtitan. A remote checkpoint
holding dcp_nvme's ``manifest.json`` (e.g. a drained mirror used as ``initial_load_path``) is
read with NVMeReader.

Importing this module imports torchtitan; without it the import raises an ImportError that names
the package to install (``pip install torchtitan``).
"""

from __future__ import annotations

import gc
from concurrent.futures import Future
from dataclasses import field, make_dataclass
from typing import Annotated, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_nvme.config import IO_OPTIONS, READER_IO, WRITER_IO
from dcp_nvme.integrations._common import make_reader, make_stager, make_writer, nvme_reader, nvme_writer
from dcp_nvme.lazy_imports import require
from dcp_nvme.load.load_planner import NVMeLoadPlanner
from dcp_nvme.storage.local_dir import is_remote_url
from dcp_nvme.storage.run_dir import checkpoints

_filesystem = require("torchtitan.tools.filesystem", needed_by=__name__, install="torchtitan")
try:
    # where torchtitan 0.3 keeps the manager (its __all__)
    _checkpoint = require("torchtitan.components.checkpointer", needed_by=__name__, install="torchtitan")
except ImportError:
    # releases before the move had one module; 0.3 keeps it as an alias that later ones drop
    _checkpoint = require("torchtitan.components.checkpoint", needed_by=__name__, install="torchtitan")
# Any: a class of a module require() imports at run time, which mypy does not follow
CheckpointManager: Any = _checkpoint.CheckpointManager
MODEL, AsyncMode = _checkpoint.MODEL, _checkpoint.AsyncMode

__all__ = ["NVMeCheckpointManager", "latest_step"]

STEP_PREFIX = "step-"
"""torchtitan names its checkpoint directories ``step-N`` (``_create_checkpoint_id``)."""


def latest_step(folder: str) -> int:
    """The newest committed ``step-N`` under a local ``folder`` (dcp_nvme's ``manifest.json`` or
    DCP's ``.metadata``), or -1 when there is none, as torchtitan's ``load(step=-1)`` expects."""
    steps = [c.step for c in checkpoints(folder) if c.step is not None and c.name == f"{STEP_PREFIX}{c.step}"]
    return max(steps, default=-1)


FIELD_PREFIX = "nvme_"
"""The config field of dcp_nvme option ``x`` is ``nvme_x``."""


def _io_options(config: Any) -> dict[str, Any]:
    """The dcp_nvme options set in the config (unset ones fall back to env / tuned / default)."""
    return {name: value for name in IO_OPTIONS if (value := getattr(config, FIELD_PREFIX + name)) is not None}


def _help(text: str) -> Any:
    """``text`` as the help torchtitan's command line (tyro) shows for a field; None without tyro."""
    try:
        from tyro.conf import arg
    except ImportError:  # the fields stand without their help
        return None
    return arg(help=text)


def _config_class() -> Any:
    """``CheckpointManager.Config`` with a field ``nvme_<option>`` for each I/O option IOConfig
    gives a trainer (``config.IO_OPTIONS``), in its form there, unset by default; its help is
    what torchtitan's command line shows."""
    fields = []
    for name, (kind, text) in IO_OPTIONS.items():
        shown = _help(f"dcp_nvme: {text}")
        hint = Annotated[kind | None, shown] if shown is not None else kind | None
        fields.append((FIELD_PREFIX + name, hint, field(default=None)))
    config = make_dataclass("Config", fields, bases=(CheckpointManager.Config,), kw_only=True, slots=True)
    config.__module__, config.__qualname__ = __name__, "NVMeCheckpointManager.Config"
    config.__doc__ = "torchtitan's checkpoint Config with dcp_nvme's I/O options as ``nvme_*`` fields."
    return config


class NVMeCheckpointManager(CheckpointManager):
    """torchtitan CheckpointManager writing local checkpoints with dcp_nvme.

    Keyword-only extras: ``writer_factory(path)``, ``reader_factory(path)``,
    ``stager_factory()`` (defaults: dcp_nvme's classes with the config's ``nvme_*`` options;
    the reader falls back to FileSystemReader for plain-DCP checkpoints, e.g. an
    ``initial_load_path`` written by stock torchtitan). Both async modes run the upload in a
    thread (DCP THREAD executor) with the dcp_nvme stager.
    """

    Config = _config_class()

    def __init__(self, config, *, writer_factory=None, reader_factory=None,
                 stager_factory=None, **kwargs: Any) -> None:
        options = _io_options(config)
        writes = {name: value for name, value in options.items() if name in WRITER_IO}
        reads = {name: value for name, value in options.items() if name in READER_IO}
        self._nvme_writer_factory = writer_factory or (lambda path: nvme_writer(path, **writes))
        self._nvme_reader_factory = reader_factory or (lambda path: nvme_reader(path, **reads))
        self._nvme_custom_reader = reader_factory is not None
        self._nvme_stager_factory = stager_factory
        self._nvme_stager = None
        super().__init__(config, **kwargs)
        if getattr(self, "enable", False) and self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # torchtitan creates its DefaultStager only while self.stager is None
            self.stager = self._get_stager()

    def _get_stager(self):
        if self._nvme_stager is None:
            self._nvme_stager = make_stager(self._nvme_stager_factory)
        return self._nvme_stager

    @torch.no_grad()
    def dcp_save(self, state_dict, checkpoint_id: str, async_mode, enable_garbage_collection: bool = False,
                 to_hf: bool = False):
        if to_hf or is_remote_url(checkpoint_id):  # HF export and remote folders: torchtitan's
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection=enable_garbage_collection, to_hf=to_hf)
        writer = make_writer(checkpoint_id, self._nvme_writer_factory)
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer)
            ret = None
        else:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                 async_stager=self._get_stager())
            # torchtitan asserts Future for ASYNC and AsyncSaveResponse for
            # ASYNC_WITH_PINNED_MEM; normalise whatever the stager produced.
            if async_mode == AsyncMode.ASYNC and isinstance(ret, AsyncSaveResponse):
                # ASYNC never calls maybe_wait_for_staging: the copy must be done before the
                # optimizer step, so it is waited for here (ASYNC_WITH_PINNED_MEM overlaps it)
                ret.staging_completion.result()
                ret = ret.upload_completion
            elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM and not isinstance(ret, AsyncSaveResponse):
                staged: Future = Future()
                staged.set_result(None)
                ret = AsyncSaveResponse(staging_completion=staged, upload_completion=ret)
        if enable_garbage_collection:
            gc.collect(1)
        return ret

    def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or not self._reads_as_nvme(checkpoint_id):
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=make_reader(checkpoint_id, self._nvme_reader_factory),
                 planner=NVMeLoadPlanner())
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _reads_as_nvme(self, checkpoint_id: str) -> bool:
        """Local checkpoints (ours or plain DCP, see make_reader) and remote dcp_nvme ones."""
        if self._nvme_custom_reader or not is_remote_url(checkpoint_id):
            return True
        return _filesystem.isfile(_filesystem.join(checkpoint_id, "manifest.json"))

    def _load(self, step: int = -1) -> bool:
        if step == -1 and not is_remote_url(self.folder):
            step = latest_step(self.folder)  # torchtitan's own scan knows only .metadata
        return super()._load(step)

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            stager, self._nvme_stager = self._nvme_stager, None
            if stager is not None and stager is not getattr(self, "stager", None) and hasattr(stager, "close"):
                stager.close()
