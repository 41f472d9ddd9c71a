"""Two tiers: checkpoints commit on node-local NVMe, then drain to an fsspec target.

    from dcp_nvme.tiers import drain, drain_state, Drainer, DrainOptions, apply_retention, wait_for_drains
    NVMeWriter(local, mirror="s3://bucket/run/step_10")   # drains after each local commit
    wait_for_drains(timeout=600)                          # (a script's exit waits for them anyway)

See docs/tiers.md. ``register`` adds ``dcp-nvme drain`` and ``dcp-nvme status``.
"""

from dcp_nvme.errors import DrainError
from dcp_nvme.tiers.background import Drainer, default_drainer, set_default_drainer, wait_for_drains
from dcp_nvme.tiers.drainer import DrainResult, drain
from dcp_nvme.tiers.journal import DRAINING, FAILED, LOCAL, MIRRORED, UNCOMMITTED, DrainState, drain_state
from dcp_nvme.tiers.options import DrainOptions
from dcp_nvme.tiers.retention import apply_retention, plan_retention
from dcp_nvme.tiers.verify import verify_mirror

__all__ = [
    "DRAINING", "FAILED", "LOCAL", "MIRRORED", "UNCOMMITTED",
    "DrainError", "DrainOptions", "DrainResult", "DrainState", "Drainer",
    "apply_retention", "default_drainer", "drain", "drain_state", "plan_retention",
    "register", "set_default_drainer", "submit_mirror", "verify_mirror", "wait_for_drains",
]


def submit_mirror(local: str, target: str, storage_options: dict | None = None, *,
                  compress: str | None = None):
    """Hand a just-committed checkpoint to the process-wide Drainer; returns its Future.
    ``compress`` overrides the drainer's option for this checkpoint."""
    return default_drainer().submit(local, target, storage_options=storage_options, compress=compress)


def register(subparsers) -> None:
    from dcp_nvme.tiers.commands import register as _register

    _register(subparsers)
