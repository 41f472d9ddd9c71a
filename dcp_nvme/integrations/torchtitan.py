"""torchtitan integration: a ``CheckpointManager`` subclass that saves and
loads through dcp_nvme.

Hook points in torchtitan 0.3.0 (``torchtitan/components/checkpointer/dcp.py``,
re-exported by ``torchtitan/components/checkpoint.py``)::

    CheckpointManager.dcp_save(self, state_dict, checkpoint_id: str, async_mode: AsyncMode,
                               enable_garbage_collection=False, to_hf=False)
        -> Future | AsyncSaveResponse | None
    CheckpointManager.dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool,
                               from_quantized: bool) -> None
    CheckpointManager._find_load_step(self, folder="") -> int
        # scans step-N dirs; valid iff ".metadata" or "model.safetensors.index.json" exists

Everything except the non-HF DCP path is delegated to torchtitan.  Use it by
pointing the trainer's ``checkpoint`` config at ``NVMeCheckpointManager.Config``
(its nested ``Config`` builds this class), or construct it directly.
"""

from __future__ import annotations

from typing import Any

from ._common import (
    NVME_COMMIT_MARKER,
    is_committed,
    make_reader,
    make_stager,
    make_writer,
)

__all__ = ["NVMeCheckpointManager"]

# created on first access by __getattr__ (the trainer is imported lazily)
NVMeCheckpointManager: type
_CLASSES: dict = {}


def _build():
    import re
    from concurrent.futures import Future
    from dataclasses import dataclass

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager

    class NVMeCheckpointManager(CheckpointManager):
        """torchtitan CheckpointManager writing via dcp_nvme (NVMeWriter/Reader/Stager).

        Keyword-only extras: ``writer_factory(path)``, ``reader_factory(path)``,
        ``stager_factory()`` (defaults: dcp_nvme's classes; the reader falls back
        to FileSystemReader for plain-DCP checkpoints, e.g. initial_load_path).
        Both async modes run the upload in a thread (DCP THREAD executor) with
        the dcp_nvme stager; torchtitan's pinned-memory mode otherwise uses a
        process executor and torch's DefaultStager.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            pass

        def __init__(self, config, *, writer_factory=None, reader_factory=None,
                     stager_factory=None, **kwargs: Any) -> None:
            self._nvme_writer_factory = writer_factory
            self._nvme_reader_factory = reader_factory
            self._nvme_stager_factory = stager_factory
            self._nvme_stager = None
            super().__init__(config, **kwargs)
            if getattr(self, "enable", False) and self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                # pre-empt torchtitan's DefaultStager (created lazily in _save)
                self.stager = self._get_stager()

        def _get_stager(self):
            if self._nvme_stager is None:
                self._nvme_stager = make_stager(self._nvme_stager_factory)
            return self._nvme_stager

        @torch.no_grad()
        def dcp_save(self, state_dict, checkpoint_id: str, async_mode, enable_garbage_collection: bool = False,
                     to_hf: bool = False):
            if to_hf:
                return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                        enable_garbage_collection=enable_garbage_collection, to_hf=True)
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
                    ret = ret.upload_completion
                elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM and not isinstance(ret, AsyncSaveResponse):
                    staged: Future = Future()
                    staged.set_result(None)
                    ret = AsyncSaveResponse(staging_completion=staged, upload_completion=ret)
            if enable_garbage_collection:
                import gc

                gc.collect(1)
            return ret

        def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
            if from_hf:
                return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            dcp.load(state_dict, storage_reader=make_reader(checkpoint_id, self._nvme_reader_factory))
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(state_dict)

        def _find_load_step(self, folder: str = "") -> int:
            import os

            folder = folder or self.folder
            if not os.path.isdir(folder):
                return -1
            steps = []
            for name in os.listdir(folder):
                m = re.search(r"step-(\d+)", name)
                if not m:
                    continue
                path = os.path.join(folder, name)
                if is_committed(path) or os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
                    steps.append(int(m.group(1)))
            return max(steps) if steps else -1

        def _close(self):
            try:
                super()._close()
            finally:
                st, self._nvme_stager = self._nvme_stager, None
                if st is not None and st is not getattr(self, "stager", None) and hasattr(st, "close"):
                    st.close()

    NVMeCheckpointManager.COMMIT_MARKER = NVME_COMMIT_MARKER
    _CLASSES["NVMeCheckpointManager"] = NVMeCheckpointManager


def __getattr__(name: str):
    if name == "NVMeCheckpointManager":
        if not _CLASSES:
            _build()
        return _CLASSES[name]
    raise AttributeError(name)
