"""The table and notes printed at the end of a run, from the results document."""

from __future__ import annotations

from typing import Any

from dcp_nvme.humanize import format_size


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_report(doc: dict[str, Any]) -> str:
    """The table and notes printed at the end of a run."""
    cfg, machine = doc["config"], doc["machine"]
    rows = doc["rows"]
    by_key = {r["key"]: r for r in rows}
    io = cfg["io"]
    lines = [
        f"dcp-nvme bench: {format_size(cfg['state_bytes'])} state over {cfg['ranks']} rank(s) in "
        f"{cfg['directory']} ({machine.get('fstype', '?')} on {machine.get('device', '?')})",
        f"  state: {cfg['model']['description']}",
        f"  dcp_nvme I/O: queue_depth {io['queue_depth']}, block_size {format_size(io['block_size'])}, "
        f"O_DIRECT {'on' if io['direct_io'] else 'off'} (from {io['source']})",
        f"  machine: {machine.get('cpu_count')} CPUs, torch {machine.get('torch')}, "
        f"fio {cfg['fio']['version'] if cfg['fio'] else 'not installed'}; every save is fsynced into a "
        "new directory",
    ]
    if cfg.get("eviction"):
        cached = cfg.get("cached_after_eviction_max")
        lines.append(f"  cold loads: page cache evicted by {cfg['eviction']}"
                     + (f"; at most {cached:.0%} of sampled pages still cached after" if cached is not None else ""))
    lines.append("")
    ours = {"write": by_key.get("dcp_nvme.save"), "read": by_key.get("dcp_nvme.load")}
    limit = {"write": by_key.get("device.write"), "read": by_key.get("device.read")}
    header = f"  {'':<52} {'GB/s':>7} {'seconds':>8} {'÷ device':>9} {'dcp_nvme ÷ this':>16}"
    for op, title in (("write", "SAVE (higher is better)"), ("read", "LOAD (higher is better)")):
        lines.append(title)
        lines.append(header)
        for row in (r for r in rows if r["op"] == op):
            lines.append(_row_line(row, ours[op], limit[op]))
        lines.append("")
    floor = by_key.get("memory.copy")
    if floor and not floor["skipped"]:
        lines.append(f"memory copy floor: {floor['gbps']:.2f} GB/s ({floor['note']})")
    reshard = [r for r in rows if r["op"] == "reshard"]
    if reshard:
        lines.append("RESHARDED LOAD" + (f": {reshard[0]['note']}" if reshard[0]["note"] else ""))
        for row in reshard:
            if row["skipped"] or row.get("error"):
                lines.append(f"  {row['label']:<58} " + (f"skipped: {row['skipped']}" if row["skipped"]
                                                           else "FAILED (see below)"))
                continue
            extra = row["extra"]
            read = extra.get("bytes_read")
            lines.append(f"  {row['label']:<58} read {format_size(read) if read else '?':>9} for "
                         f"{format_size(extra['bytes_needed'])} needed, {row['median_seconds']:.3f} s")
        lines.append("")
    for name, key in (("save", "dcp_nvme.save"), ("load", "dcp_nvme.load")):
        row = by_key.get(key)
        if row and not row["skipped"] and row["extra"].get("requests"):
            lines.append(f"dcp_nvme {name} internals: " + _internals(row["extra"], io))
    from dcp_nvme.bench.layers import format_layers

    layer_lines = format_layers(doc.get("layers"))
    if layer_lines:
        lines += layer_lines
    lines.append("")
    from dcp_nvme.bench.targets import RATIO_LABELS

    lines.append("RATIOS (this run)")
    for key, label in RATIO_LABELS.items():
        value = doc.get("ratios", {}).get(key)
        lines.append(f"  {label:<62} {'not measured' if value is None else f'{value:.2f}':>6}")
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines.append("")
        lines.append("FAILED")
        for row in failed:
            lines.append(f"  {row['label']}: {row['error']}")
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        lines.append("")
        lines.append("SKIPPED")
        for row in skipped:
            lines.append(f"  {row['label']}: {row['skipped']}")
    return "\n".join(lines)


def _row_line(row: dict[str, Any], ours: dict[str, Any] | None, limit: dict[str, Any] | None) -> str:
    label = row["label"] + (" [ours]" if row["role"] == "ours" else "")
    if row.get("error"):
        return f"  {label:<52} FAILED (see below)"
    if row["skipped"]:
        return f"  {label:<52} skipped: {row['skipped']}"
    measured = limit and not limit["skipped"] and limit["gbps"] and limit["extra"].get("device_limit") is not False
    versus_device = row["gbps"] / limit["gbps"] if measured and limit else None
    ours_ratio = None
    if ours and not ours["skipped"] and row["gbps"] and row["role"] != "ours":
        ours_ratio = ours["gbps"] / row["gbps"]
    cpu = row["extra"].get("cpu_seconds_per_gb")
    bounce = row["extra"].get("bounce_share") if row["op"] == "read" else None  # a load's copies
    return (f"  {label:<52} {row['gbps']:>7.2f} {row['median_seconds']:>8.3f} {_x(versus_device):>9} "
            f"{_x(ours_ratio):>16}" + (f"  CPU {cpu:.3f} s/GB" if cpu is not None else "")
            + (f"  {bounce:.0%} bounced" if bounce is not None else ""))


def _internals(extra: dict[str, Any], io: dict[str, Any]) -> str:
    parts = [f"{extra['requests']} requests, depth reached {extra['max_inflight']} of {io['queue_depth']}",
             f"latency p50 {extra['latency_p50_ms']:.1f} ms p99 {extra['latency_p99_ms']:.1f} ms",
             f"O_DIRECT {'on' if extra.get('direct_io') else 'off'}"]
    if extra.get("io_bytes"):
        parts.append(f"{extra.get('copied_bytes', 0) / extra['io_bytes']:.0%} through bounce buffers")
    if extra.get("fsync_seconds"):
        parts.append(f"fsync {extra['fsync_seconds']:.3f} s")
    if "outside_read_data_seconds" in extra:
        parts.append(f"read_data {extra['io_seconds']:.3f} s, outside it (manifest, DCP planning) "
                     f"{extra['outside_read_data_seconds']:.3f} s")
    if extra.get("phases"):
        parts.append("phases " + ", ".join(f"{k} {v:.3f} s" for k, v in extra["phases"].items())
                     + f", outside them (DCP planning etc.) {extra.get('outside_phases_seconds', 0):.3f} s")
    return "; ".join(parts)
