"""Checkpoint tools: look inside a checkpoint, prove it intact, export it to Hugging Face.

    from dcp_nvme.tools import list_checkpoints, inspect_checkpoint, verify_checkpoint, export_hf
    for entry in list_checkpoints("/nvme/run1"): print(entry.name, entry.state)
    report = verify_checkpoint("/nvme/run1/step_1000", jobs=8); assert report.ok, report.problems
    export_hf("/nvme/run1/step_1000", "hf_out", keys="model.*", strip_prefix="model.", dtype="bf16")

The same as ``dcp-nvme list | inspect | verify | export | convert``.
"""

from .convert import ConvertResult, convert
from .export import ExportResult, export_hf
from .inspection import Inspection, ObjectInfo, TensorInfo, inspect_checkpoint
from .listing import CheckpointEntry, list_checkpoints
from .verify import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "CheckpointEntry",
    "ConvertResult",
    "ExportResult",
    "Inspection",
    "ObjectInfo",
    "Problem",
    "TensorInfo",
    "VerifyReport",
    "convert",
    "export_hf",
    "inspect_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
]
