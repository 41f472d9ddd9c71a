"""The bar chart ``--plot`` writes (needs matplotlib)."""

from __future__ import annotations

from typing import Any

from dcp_nvme.humanize import format_size


def plot(doc: dict[str, Any], path: str) -> None:
    """Two horizontal bar panels (save, load) in GB/s; dcp_nvme highlighted, device limit dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "#1f77b4", "peer": "#9e9e9e", "limit": "#2ca02c", "floor": "#ff7f0e"}
    panels = [("write", "Save"), ("read", "Load (cold)")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, (op, title) in zip(axes, panels):
        rows = [r for r in doc["rows"] if r["op"] == op and not r["skipped"] and r["gbps"] > 0
                and r["role"] != "limit"]
        limit = next((r for r in doc["rows"] if r["key"] == f"device.{op}" and not r["skipped"]), None)
        labels = [r["label"].replace("DCP ", "") for r in rows][::-1]
        values = [r["gbps"] for r in rows][::-1]
        bars = ax.barh(labels, values, color=[colors[r["role"]] for r in rows][::-1])
        for bar, value in zip(bars, values):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f}",
                    va="center", fontsize=8)
        if limit:
            ax.axvline(limit["gbps"], color=colors["limit"], linestyle="--",
                       label=f"device limit {limit['gbps']:.2f} GB/s")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("GB/s (higher is better)")
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlim(0, max(values + [limit["gbps"] if limit else 0.0]) * 1.2 or 1)
    cfg = doc["config"]
    fig.suptitle(f"dcp-nvme bench: {format_size(cfg['state_bytes'])}, {cfg['ranks']} rank(s), "
                 f"{doc['machine'].get('fstype', '?')}, qd {cfg['io']['queue_depth']}, "
                 f"{format_size(cfg['io']['block_size'])} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
