"""Ratios between rows and the project's performance targets, checked on every run (pure: rows in, figures out)."""

from __future__ import annotations

from typing import Any

TARGETS = (
    # (name, ratio key, threshold, comparison) -- the performance targets, checked on every run
    ("sync save >= 0.85 x device write limit", "save_vs_device", 0.85, ">="),
    ("sync save >= 3 x FileSystemWriter(thread_count=1)", "save_vs_fs_t1", 3.0, ">="),
    ("sync save >= 1.5 x best FileSystemWriter thread_count", "save_vs_fs_best", 1.5, ">="),
    ("cold load >= 0.85 x device read limit", "load_vs_device", 0.85, ">="),
    ("cold load >= 1.3 x FileSystemReader", "load_vs_fs", 1.3, ">="),
    ("resharded load reads <= 1.15 x the bytes it needs", "reshard_read_amplification", 1.15, "<="),
)


RATIO_LABELS = {
    "save_vs_device": "sync save / device write limit",
    "save_vs_fs_t1": "sync save / FileSystemWriter(thread_count=1)",
    "save_vs_fs_best": "sync save / best FileSystemWriter thread_count",
    "save_vs_torch_save": "sync save / torch.save",
    "save_vs_safetensors": "sync save / safetensors save",
    "load_vs_device": "cold load / device read limit",
    "load_vs_fs": "cold load / FileSystemReader",
    "load_vs_torch_load": "cold load / torch.load",
    "load_vs_safetensors": "cold load / safetensors load",
    "reshard_read_amplification": "resharded load: bytes read / bytes needed",
    "reshard_fs_read_amplification": "resharded load, FileSystemReader: bytes read / bytes needed",
    "reshard_vs_fs_time": "resharded load / FileSystemReader's",
}
"""What the bench prints for each ratio: the figures, never a verdict (the targets are in
docs/benchmarks.md; the JSON keeps ``targets`` for scripts)."""


def compute_ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    by_key = {r["key"]: r for r in rows}

    def gbps(key: str) -> float | None:
        row = by_key.get(key)
        if row and row["extra"].get("device_limit") is False:
            return None  # without fio the "limit" is our own engine: a ratio to it would mislead
        return row["gbps"] if row and not row["skipped"] and row["gbps"] > 0 else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    save, load = gbps("dcp_nvme.save"), gbps("dcp_nvme.load")
    reshard = by_key.get("reshard.dcp_nvme", {}).get("extra", {})
    amplification = None
    if reshard.get("bytes_read") and reshard.get("bytes_needed"):
        amplification = round(reshard["bytes_read"] / reshard["bytes_needed"], 3)
    fs_reshard = by_key.get("reshard.fs", {}).get("extra", {})
    return {
        "save_vs_device": ratio(save, gbps("device.write")),
        "save_vs_fs_t1": ratio(save, gbps("fs.save.t1")),
        "save_vs_fs_best": ratio(save, gbps("fs.save.best")),
        "save_vs_torch_save": ratio(save, gbps("torch.save")),
        "save_vs_safetensors": ratio(save, gbps("safetensors.save")),
        "load_vs_device": ratio(load, gbps("device.read")),
        "load_vs_fs": ratio(load, gbps("fs.load")),
        "load_vs_torch_load": ratio(load, gbps("torch.load")),
        "load_vs_safetensors": ratio(load, gbps("safetensors.load")),
        "reshard_read_amplification": amplification,
        "reshard_fs_read_amplification": (
            round(fs_reshard["bytes_read"] / fs_reshard["bytes_needed"], 3)
            if fs_reshard.get("bytes_read") and fs_reshard.get("bytes_needed") else None),
        "reshard_vs_fs_time": ratio(gbps("reshard.dcp_nvme"), gbps("reshard.fs")),
    }


def check_targets(ratios: dict[str, float | None]) -> list[dict[str, Any]]:
    out = []
    for name, key, threshold, comparison in TARGETS:
        value = ratios.get(key)
        met = None if value is None else (value >= threshold if comparison == ">=" else value <= threshold)
        out.append({"target": name, "ratio": key, "value": value, "threshold": threshold, "met": met})
    return out
