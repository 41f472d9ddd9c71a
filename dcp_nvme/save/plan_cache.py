"""Saves with DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``).

When a rank's plan has not changed, its planner sends the coordinator an empty plan marked
``usable=False`` and, given one back, writes with the plan it cached from an earlier save, whose
``storage_data`` names that save's key: its container would be written under an old key (over
the files of the checkpoint it belongs to, when the directory is the same). So the coordinator
hands each such rank the full plan it sent it last time (marked usable, with this save's key
added by the writer): the ranks still gather no plans and the planner still skips its global
planning; only the scatter carries the plans again."""

from __future__ import annotations

from dataclasses import replace

from torch.distributed.checkpoint.planner import SavePlan

from ..errors import InvalidInputError


def with_cached_plans(plans: list[SavePlan], last: list[SavePlan] | None,
                      where: str) -> tuple[list[SavePlan], bool]:
    """``plans`` with each unusable (cached, unchanged) one replaced by the rank's plan of the
    last save, and whether any was. The planner's stand-ins carry no ``storage_data``, so the
    rank's tag of the last save comes with its plan: the caller keeps that save's topology (its
    probes are gone). Refused when this writer did not plan that save (nothing to resend)."""
    if all(plan.usable for plan in plans):
        return plans, False
    if last is None or len(last) != len(plans):
        raise InvalidInputError(
            f"{where}: the save planner reused cached plans (enable_plan_caching=True), but this "
            "NVMeWriter did not plan the save they come from: reuse one NVMeWriter for every save "
            "with plan caching (pass checkpoint_id= to dcp.save for each step)")
    return [plan if plan.usable else replace(last[rank], usable=True) for rank, plan in enumerate(plans)], True
