"""Drive temperature and thermal throttling, read before and after a save.

A hot drive slows itself down (NVMe thermal management): the same save then takes longer for no
reason the writer can see. Two sources, the first that answers wins:

- the NVMe SMART log through ``nvme smart-log <dev> -o json`` (nvme-cli; usually needs root):
  temperature, the warning/critical temperature minutes and the thermal-management transition
  counters, which only grow; any that grew during the save means the drive throttled;
- sysfs hwmon under the disk (``device/hwmon*/temp1_input``, millidegrees), where the kernel
  driver exposes it (nvme, drivetemp): the temperature, and an alarm at or above ``temp1_max``.

Virtual drives (virtio, most cloud volumes) have neither: that is said once per process and the
save's statistics record ``available: false``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dcp_nvme.observe.blockdev import SYSFS, BlockDevice, device_of

log = logging.getLogger(__name__)

THROTTLE_COUNTERS = ("warning_temp_time", "critical_comp_time", "thm_temp1_trans_count",
                     "thm_temp2_trans_count", "thm_temp1_total_time", "thm_temp2_total_time")
"""SMART log fields that only grow while the drive is hot or throttling."""
_TEMPERATURE_BIT = 0x2  # critical_warning bit 1: a temperature threshold is exceeded
_ANNOUNCED: set[str] = set()
_NVME_FAILED: set[tuple[str, str]] = set()  # disks whose smart log could not be read: not asked again


@dataclass
class DriveHealth:
    """One reading of one disk."""

    disk: str
    source: str | None = None  # "nvme smart-log" | "hwmon" | None (unavailable)
    temperature_c: float | None = None
    warning_c: float | None = None
    hot: bool = False
    """At or above the warning temperature, or the drive reports a temperature condition."""
    counters: dict[str, int] = field(default_factory=dict)
    unavailable: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- parsing (pure)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = re.match(r"\s*(-?\d+(?:\.\d+)?)", value)
        return float(match.group(1)) if match else None
    return None


def _celsius(value: Any) -> float | None:
    """nvme-cli prints Kelvin in its JSON (some versions a string such as ``"41 C"``)."""
    number = _number(value)
    if number is None:
        return None
    kelvin = number > 200 or (isinstance(value, str) and "k" in value.lower() and "c" not in value.lower())
    return round(number - 273.15, 1) if kelvin else number


def parse_smart_log(disk: str, text: str) -> DriveHealth:
    """A DriveHealth from ``nvme smart-log -o json`` output; ValueError when it is not that."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"nvme smart-log for {disk}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or "temperature" not in doc:
        raise ValueError(f"nvme smart-log for {disk}: no temperature field")
    counters = {}
    for name in THROTTLE_COUNTERS:
        number = _number(doc.get(name))
        if number is not None and number >= 0:
            counters[name] = int(number)
    warning = _number(doc.get("critical_warning"))
    hot = warning is not None and int(warning) & _TEMPERATURE_BIT != 0
    return DriveHealth(disk, "nvme smart-log", _celsius(doc.get("temperature")), None, hot, counters)


def throttle_reasons(before: DriveHealth, after: DriveHealth) -> list[str]:
    """Why the drive counts as throttled between two readings (empty: it did not)."""
    reasons = []
    for name, value in after.counters.items():
        grew = value - before.counters.get(name, value)
        if grew > 0:
            reasons.append(f"{name} +{grew}")
    if after.hot:
        at = f" at {after.temperature_c:g} C" if after.temperature_c is not None else ""
        limit = f" (warning {after.warning_c:g} C)" if after.warning_c is not None else ""
        reasons.append(f"temperature condition{at}{limit}")
    return reasons


# --------------------------------------------------------------------------- reading


def _hwmon_dirs(node: Path) -> list[Path]:
    found = []
    for base in (node / "device", node / "device" / "hwmon"):
        if base.is_dir():
            found.extend(sorted(p for p in base.iterdir() if p.name.startswith("hwmon") and p.name != "hwmon"))
    return found


def _milli(path: Path) -> float | None:
    """A hwmon value in millidegrees, as degrees."""
    try:
        return int(path.read_text().strip()) / 1000
    except (OSError, ValueError):
        return None


def read_hwmon(disk: str, sysfs: str | os.PathLike = SYSFS) -> DriveHealth | None:
    """Temperature (and its warning limit) from hwmon under ``/sys/block/<disk>``, or None."""
    node = Path(sysfs) / "block" / disk
    for hwmon in _hwmon_dirs(node):
        inputs = sorted(hwmon.glob("temp*_input"))
        if not inputs:
            continue
        first = inputs[0]
        prefix = first.name[: -len("_input")]
        temperature = _milli(first)
        if temperature is None:
            continue
        warning = _milli(hwmon / f"{prefix}_max")
        alarm = _milli(hwmon / f"{prefix}_alarm")
        hot = bool(alarm) or (warning is not None and warning > 0 and temperature >= warning)
        return DriveHealth(disk, "hwmon", temperature, warning, hot)
    return None


def read_smart_log(disk: str, nvme: str, runner: Callable[[list[str]], str] | None = None) -> DriveHealth | None:
    """The SMART log through nvme-cli, or None (no permission, old nvme-cli, not NVMe)."""
    command = [nvme, "smart-log", f"/dev/{disk}", "-o", "json"]
    try:
        if runner is not None:
            text = runner(command)
        else:
            done = subprocess.run(command, capture_output=True, text=True, timeout=10)
            if done.returncode:
                raise OSError(done.stderr.strip()[-200:] or f"exit status {done.returncode}")
            text = done.stdout
        return parse_smart_log(disk, text)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        log.debug("dcp_nvme: %s failed: %s", " ".join(command), exc)
        return None


def read_health(disk: str, transport: str, sysfs: str | os.PathLike = SYSFS,
                nvme: str | None = None) -> DriveHealth:
    """The best reading available for one disk; ``unavailable`` says why there is none."""
    if nvme is None:
        nvme = shutil.which("nvme")
    if transport == "nvme" and nvme and (nvme, disk) not in _NVME_FAILED:
        reading = read_smart_log(disk, nvme)
        if reading is not None:
            hwmon = read_hwmon(disk, sysfs)  # the smart log has no warning threshold; hwmon does
            if hwmon is not None and hwmon.warning_c:
                reading.warning_c = hwmon.warning_c
            return reading
        _NVME_FAILED.add((nvme, disk))
    reading = read_hwmon(disk, sysfs)
    if reading is not None:
        return reading
    why = (f"{transport} drive: no SMART log or hwmon sensor" if transport != "nvme"
           else "no hwmon sensor and `nvme smart-log` " + ("failed (needs root?)" if nvme else "is not installed"))
    return DriveHealth(disk, unavailable=why)


def announce_unavailable(reading: DriveHealth) -> None:
    """Say once per process and disk that its health cannot be read."""
    if reading.unavailable and reading.disk not in _ANNOUNCED:
        _ANNOUNCED.add(reading.disk)
        log.info("dcp_nvme: drive temperature/throttling of %s is not available (%s)",
                 reading.disk, reading.unavailable)


class DriveWatch:
    """Readings of the disks under a directory before and after some I/O; ``finish`` judges."""

    def __init__(self, directory: str | os.PathLike, sysfs: str | os.PathLike = SYSFS,
                 nvme: str | None = None, device: BlockDevice | None = None) -> None:
        self.sysfs, self.nvme = sysfs, nvme
        self.device = device if device is not None else _cached_device(directory, sysfs)
        self.before = self._read()

    def _read(self) -> list[DriveHealth]:
        if self.device is None:
            return []
        return [read_health(d.name, d.transport, self.sysfs, self.nvme) for d in self.device.disks]

    def finish(self) -> dict[str, Any]:
        """What the save's statistics record: per disk, temperatures and why it throttled."""
        after = self._read()
        disks, throttled = {}, False
        for first, last in zip(self.before, after):
            announce_unavailable(last)
            reasons = throttle_reasons(first, last) if last.source else []
            throttled = throttled or bool(reasons)
            disks[last.disk] = {"source": last.source, "temperature_c_before": first.temperature_c,
                                "temperature_c_after": last.temperature_c, "throttle": reasons,
                                **({"unavailable": last.unavailable} if last.unavailable else {})}
        available = any(d["source"] for d in disks.values())
        return {"available": available, "throttled": throttled, "disks": disks}


_DEVICES: dict[tuple[int, str], BlockDevice | None] = {}


def _cached_device(directory: str | os.PathLike, sysfs: str | os.PathLike) -> BlockDevice | None:
    """The device under a directory, resolved once per process (saves repeat on the same disk)."""
    target = Path(directory)
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        key = (os.stat(target).st_dev, str(sysfs))
    except OSError:
        return None
    if key not in _DEVICES:
        _DEVICES[key] = device_of(target, sysfs)
    return _DEVICES[key]


def format_drive(summary: dict[str, Any]) -> list[str]:
    """Lines a person reads: each disk's temperature before and after, and any throttling."""
    lines = []
    for disk, entry in summary.get("disks", {}).items():
        if not entry["source"]:
            lines.append(f"drive health: {disk}: not available ({entry.get('unavailable')})")
            continue
        text = (f"drive health: {disk}: {entry['temperature_c_before']} C -> {entry['temperature_c_after']} C "
                f"({entry['source']})")
        if entry["throttle"]:
            text += f"; THROTTLED: {', '.join(entry['throttle'])}"
        lines.append(text)
    return lines or ["drive health: no local block device under this directory"]


class SaveWatch:
    """The diagnostics of one save's write, when asked (``dcp_nvme.observe.enable_save_diagnostics``):
    the drive's health before and after, and advice on the block layer's queues for the save's
    settings (logged once per disk)."""

    def __init__(self, directory: str, queue_depth: int, local_ranks: int, block_size: int) -> None:
        from dcp_nvme.observe.blockdev import warn_once

        self.drive = DriveWatch(directory)
        self.advice = warn_once(self.drive.device, queue_depth, local_ranks, block_size, log)

    def finish(self) -> dict[str, Any]:
        """The fields the save's statistics record: ``drive`` and ``block_layer``."""
        drive = self.drive.finish()
        if drive["throttled"]:
            log.warning("dcp_nvme: the drive throttled during the save (%s); see docs/tuning.md, drive health",
                        {d: v["throttle"] for d, v in drive["disks"].items() if v["throttle"]})
        return {"drive": drive, "block_layer": [str(a) for a in self.advice]}
