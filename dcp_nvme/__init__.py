"""dcp_nvme: a fast, verified storage plugin for torch.distributed.checkpoint.

    import torch.distributed.checkpoint as dcp
    from dcp_nvme import NVMeWriter, NVMeReader
    dcp.save(state_dict, storage_writer=NVMeWriter("/nvme/run1/step_1000"))
    dcp.load(state_dict, storage_reader=NVMeReader("/nvme/run1/step_1000"))
"""

from .config import IOConfig
from .errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    DCPNVMeError,
    EngineUnavailableError,
    ManifestError,
)
from .reader import NVMeReader
from .rundir import CheckpointDir, checkpoints, latest
from .staging import NVMeStager
from .writer import NVMeWriter

__all__ = [
    "CheckpointDir",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotCommittedError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "DCPNVMeError",
    "EngineUnavailableError",
    "IOConfig",
    "ManifestError",
    "NVMeReader",
    "NVMeStager",
    "NVMeWriter",
    "checkpoints",
    "latest",
]
__version__ = "0.1.0"
