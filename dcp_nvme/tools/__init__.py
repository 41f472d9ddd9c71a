"""Checkpoint tools: look inside a checkpoint, prove it intact, export it to Hugging Face.

    from dcp_nvme.tools import list_checkpoints, inspect_checkpoint, verify_checkpoint, export_hf
    for entry in list_checkpoints("/nvme/run1"): print(entry.name, entry.state)
    report = verify_checkpoint("/nvme/run1/step_1000", jobs=8); assert report.ok, report.problems
    export_hf("/nvme/run1/step_1000", "hf_out", keys="model.*", strip_prefix="model.", dtype="bf16")

The same as ``dcp-nvme list | inspect | verify | export``; ``dcp-nvme convert`` is
``dcp_nvme.tools.convert.convert``.
"""

from dcp_nvme.lazy_imports import lazy_names

# Names load on first use, so that ``dcp-nvme list --help`` (which imports this package for its
# commands module) starts without torch.
_LAZY = {
    "ExportResult": ".export", "export_hf": ".export",
    "Inspection": ".inspection", "ObjectInfo": ".inspection", "TensorInfo": ".inspection",
    "inspect_checkpoint": ".inspection",
    "CheckpointEntry": ".listing", "list_checkpoints": ".listing",
    "Problem": ".verify", "VerifyReport": ".verify", "verify_checkpoint": ".verify",
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)

__all__ = [
    "CheckpointEntry",
    "ExportResult",
    "Inspection",
    "ObjectInfo",
    "Problem",
    "TensorInfo",
    "VerifyReport",
    "export_hf",
    "inspect_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
]
