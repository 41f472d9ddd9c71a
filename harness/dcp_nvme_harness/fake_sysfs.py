"""Build small sysfs trees in a temporary directory: disks, partitions, dm/md, loop, hwmon."""

from __future__ import annotations

import os
from pathlib import Path


def majmin(path: str | os.PathLike) -> str:
    dev = os.stat(path).st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"


def add_disk(root: Path, name: str, parent: str = "devices/pci0000:00/0000:00:04.0", *,
             nr_requests: int = 1023, scheduler: str = "[none] mq-deadline kyber bfq",
             read_ahead_kb: int = 128, max_sectors_kb: int = 1280, max_hw_sectors_kb: int = 2048,
             logical: int = 512, physical: int = 4096, rotational: int = 0, hw_queues: int = 0,
             model: str | None = None, driver: str | None = None) -> Path:
    """A disk directory with a queue/ (and mq/, device/ where asked); linked from block/<name>."""
    node = root / parent / name
    queue = node / "queue"
    queue.mkdir(parents=True)
    for key, value in (("nr_requests", nr_requests), ("scheduler", scheduler),
                       ("read_ahead_kb", read_ahead_kb), ("max_sectors_kb", max_sectors_kb),
                       ("max_hw_sectors_kb", max_hw_sectors_kb), ("logical_block_size", logical),
                       ("physical_block_size", physical), ("rotational", rotational)):
        (queue / key).write_text(f"{value}\n")
    for index in range(hw_queues):
        (node / "mq" / str(index)).mkdir(parents=True)
    device = node / "device"
    device.mkdir()
    if model:
        (device / "model").write_text(model + "\n")
    if driver:
        target = root / "bus" / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        os.symlink(target, device / "driver")
    (root / "block").mkdir(exist_ok=True)
    os.symlink(node, root / "block" / name)
    return node


def add_partition(disk: Path, name: str) -> Path:
    part = disk / name
    part.mkdir()
    (part / "partition").write_text("1\n")
    return part


def add_virtual(root: Path, name: str, kind: str, members: list[Path], label: str) -> Path:
    """A dm or md device over ``members`` (their slaves/ links), e.g. a RAID-0."""
    node = add_disk(root, name, "devices/virtual/block", scheduler="none", nr_requests=128)
    (node / kind).mkdir()
    (node / kind / ("name" if kind == "dm" else "level")).write_text(label + "\n")
    (node / "slaves").mkdir()
    for member in members:
        os.symlink(member, node / "slaves" / member.name)
    return node


def add_loop(root: Path, name: str, backing_file: str) -> Path:
    node = add_disk(root, name, "devices/virtual/block", scheduler="[none] mq-deadline", nr_requests=128)
    (node / "loop").mkdir()
    (node / "loop" / "backing_file").write_text(backing_file + "\n")
    return node


def add_hwmon(disk: Path, millidegrees: int, max_millidegrees: int | None = None) -> Path:
    hwmon = disk / "device" / "hwmon3"
    hwmon.mkdir(parents=True, exist_ok=True)
    (hwmon / "temp1_input").write_text(f"{millidegrees}\n")
    if max_millidegrees is not None:
        (hwmon / "temp1_max").write_text(f"{max_millidegrees}\n")
    return hwmon


def link_dev(root: Path, dev: str, node: Path) -> None:
    """``dev/block/MAJ:MIN`` -> node, as the kernel links every block device."""
    (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
    os.symlink(node, root / "dev" / "block" / dev)
