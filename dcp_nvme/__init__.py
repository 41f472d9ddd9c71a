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
from .rundir import CheckpointDir, checkpoints, latest

# The torch-backed classes load on first use, so that `dcp-nvme --help` and tools that only need
# the light modules start without importing torch.
_LAZY = {"NVMeReader": ".reader", "NVMeStager": ".staging", "NVMeWriter": ".writer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
