"""A torchtitan ``config_registry`` module selecting dcp_nvme's checkpoint manager, as a user's
own registry would (``--module integration.torchtitan_nvme_config --config nvme_run``).

torchtitan's real ``Trainer.Config`` cannot be imported on a CPU-only machine (its expert-parallel
kernels import triton), so the test builds this slice of it: the fields that
``ConfigManager.parse_args`` reads and the same ``checkpoint: BaseCheckpointManager.Config`` field.
In a real registry, return ``Trainer.Config(..., checkpoint=NVMeCheckpointManager.Config(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager

from dcp_nvme.integrations.torchtitan import NVMeCheckpointManager


@dataclass(kw_only=True, slots=True)
class RunConfig:
    hf_assets_path: str = "."
    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)


def nvme_run() -> RunConfig:
    return RunConfig(checkpoint=NVMeCheckpointManager.Config(enable=True, folder="ckpt", nvme_queue_depth=4))
