"""The bench's view of the three queue-depth layers: the block layer under the directory, the node
budget against the per-rank depth it replaces, and drive health over the run; plus the save's
per-rank/per-node telemetry and the node-budget targets."""

from __future__ import annotations

from typing import Any

from dcp_nvme.bench.core import BenchCore, IOKwargs
from dcp_nvme.bench.records import Row, Skip
from dcp_nvme.observe.blockdev import check_queues, format_device
from dcp_nvme.observe.drive_health import DriveWatch, format_drive
from dcp_nvme.save.results import format_summary, layer_summary

LAYER_TARGETS = (
    # (name, ratio key, threshold), checked when a node budget is set over 2+ ranks; the report
    # prints the figure under its label, the thresholds are in docs/benchmarks.md
    ("node-budget save >= 0.9 x fio numjobs=ranks at the same total depth", "save_vs_device", 0.9),
    ("node-budget save >= the per-rank-depth save it replaces", "save_vs_per_rank_depth", 1.0),
)
LAYER_LABELS = (
    "node-budget save / fio numjobs=ranks at the same total depth",
    "node-budget save / the per-rank-depth save it replaces",
)


class LayerRows(BenchCore):
    """The row that measures what the node budget replaces, and the layers' document."""

    def start_layers(self) -> None:
        self.drive_watch = DriveWatch(self.options.directory) if self.group.rank == 0 else None

    def per_rank_depth_save(self) -> None:
        """The same sync save with every rank at its own ``queue_depth`` (no node budget): what
        ``node_queue_depth`` replaces, in the same run."""
        row = self.add(Row("dcp_nvme.save.per_rank_depth",
                           "dcp_nvme save, per-rank depth (no node budget)", "write", "ours"))
        if self.config.node_queue_depth is None or self.group.world < 2:
            raise Skip("runs with --node-queue-depth over 2+ ranks")
        per_rank = self.config.queue_depth
        # node_queue_depth = depth x ranks gives each rank exactly `depth`, whatever env or tune file say
        kwargs: IOKwargs = {**self.io_kwargs, "queue_depth": per_rank, "node_queue_depth": per_rank * self.group.world}
        stats = self._writer_saves(row, "dcp_nvme_per_rank_depth", kwargs)
        row.extra = {"queue_depth": per_rank, "total_depth": per_rank * self.group.world,
                     "max_inflight": max(s.get("io", {}).get("max_inflight", 0) for s in self.group.gather(stats[-1]))}
        row.note = f"{self.group.world} ranks x queue_depth {per_rank}"

    def _writer_saves(self, row: Row, kind: str, kwargs: IOKwargs) -> list[dict[str, Any]]:
        """The row's repeated sync saves through NVMeWriter(**kwargs); this rank's stats of each."""
        from dcp_nvme.save.writer import NVMeWriter

        dcp = self._dcp()

        def save(path: str) -> dict[str, Any]:
            writer = NVMeWriter(path, **kwargs)
            dcp.save(self.state, storage_writer=writer, no_dist=not self.group.is_dist)
            return writer.last_stats or {}

        return self._repeat_saves(row, kind, save, keep=False)

    def other_order_save(self) -> None:
        """The same budgeted save with the node's ranks in the other write order (together vs
        staggered), so the run shows which one this drive prefers."""
        order = "together" if self.config.node_write_order == "staggered" else "staggered"
        row = self.add(Row(f"dcp_nvme.save.{order}", f"dcp_nvme save, node ranks {order}", "write", "ours"))
        stats = self._writer_saves(row, f"dcp_nvme_{order}", {**self.writer_kwargs, "node_write_order": order})
        depths = [s.get("config", {}).get("queue_depth") for s in self.group.gather(stats[-1])]
        row.extra = {"node_write_order": order, "queue_depth": depths}
        row.note = f"{self.group.world} ranks {order}, queue_depth {depths[0]} each"

    def layers_document(self, rows: list[dict[str, Any]], ratios: dict[str, Any]) -> dict[str, Any]:
        """Block layer, advice, drive health over the run, the save's telemetry, the targets."""
        device = self.drive_watch.device if self.drive_watch else None
        advice = check_queues(device, self.device_config.queue_depth, self.group.world,
                              self.config.block_size) if device else []
        by_key = {r["key"]: r for r in rows}
        ours, replaced = by_key.get("dcp_nvme.save"), by_key.get("dcp_nvme.save.per_rank_depth")
        if ours and replaced and not ours["skipped"] and not replaced["skipped"] and replaced["gbps"]:
            ratios["save_vs_per_rank_depth"] = round(ours["gbps"] / replaced["gbps"], 3)
        by_order = {order: by_key.get(f"dcp_nvme.save.{order}") for order in ("together", "staggered")}
        by_order[self.config.node_write_order] = ours  # the main save row ran in the configured order
        staggered, together = by_order["staggered"], by_order["together"]
        if staggered and together and not staggered["skipped"] and not together["skipped"] and together["gbps"]:
            ratios["staggered_vs_together"] = round(staggered["gbps"] / together["gbps"], 3)
        budget = self.config.node_queue_depth is not None and self.group.world > 1
        targets = []
        for name, key, threshold in LAYER_TARGETS:
            value = ratios.get(key) if budget else None
            targets.append({"target": name, "ratio": key, "value": value, "threshold": threshold,
                            "met": None if value is None else value >= threshold})
        saves = self.dcp_stats.get("save")
        return {
            "node_queue_depth": self.config.node_queue_depth, "per_rank_depth": self.device_config.queue_depth,
            "node_write_order": self.config.node_write_order,
            "staggered_vs_together": ratios.get("staggered_vs_together"),
            "local_ranks": self.group.world,
            "block_layer": {"device": device.to_dict() if device else None, "advice": [str(a) for a in advice]},
            "drive": self.drive_watch.finish() if self.drive_watch else None,
            "save": layer_summary([s for s in saves if s]) if saves else None,
            "targets": targets,
        }


def format_layers(layers: dict[str, Any] | None) -> list[str]:
    """The LAYERS section of the report."""
    if not layers:
        return []
    depth = layers["per_rank_depth"]
    budget = (f"node_queue_depth {layers['node_queue_depth']} over {layers['local_ranks']} rank(s) = {depth} per rank"
              if layers["node_queue_depth"] else
              f"no node budget: {layers['local_ranks']} rank(s) x queue_depth {depth} = {layers['local_ranks'] * depth}")
    lines = ["LAYERS", f"  framework: {budget}"]
    if layers.get("staggered_vs_together") is not None:
        lines.append(f"  write order: {layers.get('node_write_order')}; staggered / together = "
                     f"{layers['staggered_vs_together']:.2f} (same run; `dcp-nvme tune --ranks N` stores the faster)")
    from dcp_nvme.observe.blockdev import BlockDevice, DiskQueue

    device = layers["block_layer"]["device"]
    if device is not None:
        device = BlockDevice(device["name"], device["chain"], None,
                             [DiskQueue(**{**d, "schedulers": tuple(d["schedulers"])}) for d in device["disks"]])
    lines += ["  " + line for line in format_device(device)]
    lines += [f"  warning: {advice}" for advice in layers["block_layer"]["advice"]]
    if layers["drive"]:
        lines += ["  " + line for line in format_drive(layers["drive"])]
    if layers["save"]:
        lines.append("  save telemetry: " + format_summary(layers["save"]))
    for target, label in zip(layers["targets"], LAYER_LABELS):
        value = ("not measured (needs --node-queue-depth, --ranks 2+)" if target["value"] is None
                 else f"{target['value']:.2f}")
        lines.append(f"  {label:<70} {value}")
    return lines
