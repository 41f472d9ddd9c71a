"""dcp_nvme: a fast, verified storage plugin for torch.distributed.checkpoint.

    import torch.distributed.checkpoint as dcp
    from dcp_nvme import NVMeWriter, NVMeReader
    dcp.save(state_dict, storage_writer=NVMeWriter("/nvme/run1/step_1000"))
    dcp.load(state_dict, storage_reader=NVMeReader("/nvme/run1/step_1000"))
"""

from dcp_nvme import seams
from dcp_nvme.config import IOConfig
from dcp_nvme.errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    DCPNVMeError,
    InvalidInputError,
    UnsafeItemError,
)
from dcp_nvme.lazy_imports import lazy_names
from dcp_nvme.storage.run_dir import CheckpointDir, checkpoints, latest

# The torch-backed classes load on first use, so that `dcp-nvme --help` and tools that only need
# the light modules start without importing torch.
_LAZY = {"NVMeAsyncSaver": ".save.async_saver", "NVMeLoadPlanner": ".load.load_planner",
         "NVMeReader": ".load.reader", "NVMeStager": ".save.stager", "NVMeWriter": ".save.writer"}


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)

# The optional systems, plugged into the core's seams by name: imported at their first use only.
seams.drain.plug("dcp_nvme.tiers:submit_mirror")
seams.replicate.plug("dcp_nvme.peers.replicate:start_replication")
seams.replication_group.plug("dcp_nvme.peers.replicate:replication_group")
seams.restore.plug("dcp_nvme.peers.restore:open_restore")
seams.coded_engine.plug("dcp_nvme.tiers.coded:coded_engine")
seams.decoded_store.plug("dcp_nvme.tiers.coded:decoded_store")
seams.object_store.plug("dcp_nvme.tiers.s3_client:object_store")
seams.mirror_restored.plug("dcp_nvme.tiers.journal:journal_restored")


__all__ = [
    "CheckpointDir",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotCommittedError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "DCPNVMeError",
    "IOConfig",
    "InvalidInputError",
    "NVMeAsyncSaver",
    "NVMeLoadPlanner",
    "NVMeReader",
    "NVMeStager",
    "NVMeWriter",
    "UnsafeItemError",
    "checkpoints",
    "latest",
]
__version__ = "0.1.0"
