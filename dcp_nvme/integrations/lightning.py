"""PyTorch Lightning integration: a ModelParallelStrategy (FSDP2/TP) subclass
whose sharded checkpoints go through dcp_nvme.

Usage::

    import dcp_nvme
    from dcp_nvme.integrations.lightning import NVMeModelParallelStrategy
    strategy = NVMeModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(strategy=strategy, ...)
    trainer.save_checkpoint("ckpts/step-4")                       # sync
    trainer.save_checkpoint("ckpts/step-8", storage_options={"async_save": True})
    os.makedirs("ckpts", exist_ok=True)                          # latest() refuses a missing run dir
    trainer.fit(model, ckpt_path=dcp_nvme.latest("ckpts"))      # None on a fresh start

With ``ModelCheckpoint(dirpath=..., every_n_train_steps=N, save_last=True)`` the checkpoints
are directories ``epoch=E-step=N.ckpt`` and ``last.ckpt``; ``trainer.fit(ckpt_path="last")``
resumes from the latter.

Hook points in lightning 2.6 (``lightning.pytorch.strategies.model_parallel``):
``ModelParallelStrategy.save_checkpoint(checkpoint, filepath, storage_options=None)``
calls ``_distributed_checkpoint_save(converted_state, path)`` ->
``torch.distributed.checkpoint.save(state, checkpoint_id=path)`` and writes the
non-tensor rest with ``torch.save`` to ``<path>/meta.pt``;
``load_checkpoint(checkpoint_path, weights_only=None)`` calls
``lightning.fabric.strategies.model_parallel._load_checkpoint`` ->
``dcp.load(..., checkpoint_id=path)``.  Both are overridden here.

Layout difference: the Lightning metadata (loops, callbacks, lr schedulers,
hparams) is stored *inside* the DCP checkpoint as one bytes item
(``lightning_meta``) instead of ``meta.pt``, so the checkpoint is committed
atomically by dcp_nvme's commit marker.

Importing this module imports Lightning; without it the import raises an ImportError that names
the package to install (``pip install lightning``).
"""

from __future__ import annotations

import io
import pickle
import shutil
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_nvme.errors import UnknownOptionError, UnsafeItemError
from dcp_nvme.integrations._common import make_reader, make_stager, make_writer, wait_future
from dcp_nvme.lazy_imports import require
from dcp_nvme.load.load_planner import NVMeLoadPlanner

# Any: a class of a module require() imports at run time, which mypy does not follow
ModelParallelStrategy: Any = require("lightning.pytorch.strategies", needed_by=__name__,
                                     install="lightning").ModelParallelStrategy

__all__ = ["NVMeModelParallelStrategy", "META_KEY"]

META_KEY = "lightning_meta"


def _saves_sharded(strategy: Any) -> bool:
    """Whether ``strategy`` writes sharded (DCP) checkpoints: the ``save_distributed_checkpoint``
    argument of ``ModelParallelStrategy``, which Lightning 2.6 keeps only as the private attribute
    ``_save_distributed_checkpoint`` (it has no public accessor; its own state-dict methods read
    the same attribute). The one private touch-point of this module; tested by
    integration/test_integrations.py::test_lightning_private_touch_point."""
    return bool(strategy._save_distributed_checkpoint)


def _load_metadata(data: bytes, path: str, weights_only: bool | None) -> dict[str, Any]:
    """The pickled rest of Lightning's checkpoint (what stock Lightning keeps in meta.pt).

    Lightning's default ``None`` is weights-only, as in stock Lightning's ``torch.load``: a
    full unpickle, which runs whatever code the pickle names, only on an explicit ``False``."""
    try:
        return torch.load(io.BytesIO(data), weights_only=weights_only is not False)
    except pickle.UnpicklingError as exc:
        reason = next((line for line in str(exc).splitlines() if line.strip()), "")[:300]
        raise UnsafeItemError(
            f"{path}: Lightning's checkpoint metadata (item {META_KEY!r}) is not a weights-only pickle "
            f"({reason}); loading it would run the code it names. Only if you trust who wrote this "
            "checkpoint, load it with weights_only=False (trainer.fit(..., weights_only=False)), or "
            "allow its classes with torch.serialization.add_safe_globals") from None


class NVMeModelParallelStrategy(ModelParallelStrategy):
    """ModelParallelStrategy that saves/loads sharded checkpoints via dcp_nvme.

    Extra keyword arguments (all optional):
      writer_factory(path) -> StorageWriter   (default: dcp_nvme.NVMeWriter(path, overwrite=True))
      reader_factory(path) -> StorageReader   (default: NVMeReader, or FileSystemReader
                                               for plain-DCP checkpoints)
      stager_factory() -> AsyncStager | None  (default: dcp_nvme.NVMeStager())
      async_save: bool — default mode for saves (ModelCheckpoint calls
                         trainer.save_checkpoint without storage_options)
    Per call: ``trainer.save_checkpoint(path, storage_options={"async_save": bool})``.
    """

    def __init__(
        self,
        *args: Any,
        writer_factory=None,
        reader_factory=None,
        stager_factory=None,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._nvme_writer_factory = writer_factory
        self._nvme_reader_factory = reader_factory
        self._nvme_stager_factory = stager_factory
        self._nvme_async_default = async_save
        self._nvme_pending: Future[Any] | AsyncSaveResponse | None = None
        self._nvme_stager = None
        self._nvme_ckpt_pg = None

    # -- process group for background saves ---------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        # A dedicated gloo group: the async upload thread runs DCP
        # collectives concurrently with FSDP collectives on the default PG.
        self._nvme_ckpt_pg = dist.new_group(backend="gloo")

    # -- save ------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not _saves_sharded(self):
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        opts = dict(storage_options or {})
        async_save = bool(opts.pop("async_save", self._nvme_async_default))
        if opts:
            raise UnknownOptionError(f"unsupported storage_options for {type(self).__name__}: {sorted(opts)}")
        path = str(self.broadcast(str(filepath)))
        # one save in flight at a time; the previous one must be committed
        self.wait_for_checkpoint()

        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        state.update(
            {f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}
        )
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        state[META_KEY] = buf.getvalue()

        writer = make_writer(path, self._nvme_writer_factory)
        if async_save:
            if self._nvme_stager is None:
                self._nvme_stager = make_stager(self._nvme_stager_factory)
            self._nvme_pending = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._nvme_ckpt_pg,
                async_stager=self._nvme_stager,
            )
            # Lightning has no hook between here and the next write into the tensors (callbacks,
            # a training-mode forward's buffer updates): the copy is waited for before returning;
            # the write still runs in the background
            staging = getattr(self._nvme_pending, "staging_completion", None)
            if staging is not None:
                staging.result()
        else:
            dcp.save(state, storage_writer=writer)

    def wait_for_checkpoint(self) -> None:
        """Block until the in-flight async save (if any) is committed."""
        fut, self._nvme_pending = self._nvme_pending, None
        wait_future(fut)

    # -- load ------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        path = str(self.broadcast(str(checkpoint_path)))
        assert self.model is not None
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        optimizers = {f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        for key, opt in optimizers.items():
            state[key] = get_optimizer_state_dict(self.model, opt)
        state[META_KEY] = b""
        dcp.load(state, storage_reader=make_reader(path, self._nvme_reader_factory), planner=NVMeLoadPlanner())
        set_model_state_dict(
            self.model, state["state_dict"], options=StateDictOptions(strict=strict)
        )
        for key, opt in optimizers.items():
            set_optimizer_state_dict(self.model, opt, optim_state_dict=state[key])
        return _load_metadata(state[META_KEY], path, weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.wait_for_checkpoint()
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        try:
            self.wait_for_checkpoint()
        finally:
            if self._nvme_stager is not None and hasattr(self._nvme_stager, "close"):
                self._nvme_stager.close()
            self._nvme_stager = None
            super().teardown()
