"""The Linux block layer under a checkpoint directory: which disks hold it, and how they queue.

A checkpoint's requests pass the block layer before the drive: ``nr_requests`` bounds how many
the kernel holds per hardware queue, the I/O scheduler may reorder them, ``max_sectors_kb`` splits
larger ones. ``device_of(path)`` follows the directory's ``st_dev`` through
``/sys/dev/block/MAJ:MIN`` down to the disks that store it (a partition's disk, the members of a
dm or md device, a loop device's backing file) and reads those settings; ``check_queues`` says
where they disagree with what the writers will send, with the line to write that fixes it.

Reading is separate from judging: ``check_queues`` is pure, and the sysfs root is a parameter,
so both are tested on trees built in a temporary directory.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dcp_nvme.host.job import leads_its_node
from dcp_nvme.humanize import format_size

SYSFS = "/sys"
REORDERING_SCHEDULERS = ("mq-deadline", "bfq", "kyber")
_MAX_DEPTH = 8  # dm over md over loop over ...: deeper chains are not real; stop instead of looping


@dataclass(frozen=True)
class DiskQueue:
    """One disk's request queue as sysfs shows it (None: the file is missing or unreadable)."""

    name: str
    transport: str  # nvme | virtio | scsi | dm | md | loop | other
    nr_requests: int | None = None
    scheduler: str | None = None
    schedulers: tuple[str, ...] = ()
    read_ahead_kb: int | None = None
    max_sectors_kb: int | None = None
    max_hw_sectors_kb: int | None = None
    logical_block_size: int | None = None
    physical_block_size: int | None = None
    rotational: bool | None = None
    hw_queues: int | None = None
    model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "schedulers": list(self.schedulers)}


@dataclass
class BlockDevice:
    """The device a directory lives on and the disks beneath it, top first."""

    name: str
    chain: list[str] = field(default_factory=list)
    """How the top device was resolved, e.g. ``["dm-0 (dm)", "nvme0n1p2 -> nvme0n1"]``."""
    top: DiskQueue | None = None
    disks: list[DiskQueue] = field(default_factory=list)
    """The disks that store the data: every member of a RAID or dm device, each once."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "chain": list(self.chain),
                "top": self.top.to_dict() if self.top else None,
                "disks": [d.to_dict() for d in self.disks]}


@dataclass(frozen=True)
class Advice:
    """A disagreement between the block layer and the writers, and the command that fixes it."""

    disk: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.disk}: {self.problem}; fix: {self.fix}"


# --------------------------------------------------------------------------- reading sysfs


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _transport(node: Path) -> str:
    name = node.name
    if (node / "dm").is_dir():
        return "dm"
    if (node / "md").is_dir():
        return "md"
    if (node / "loop").is_dir() or name.startswith("loop"):
        return "loop"
    if name.startswith("nvme"):
        return "nvme"
    driver = os.path.basename(os.path.realpath(node / "device" / "driver")) if (node / "device").exists() else ""
    if driver == "virtio_blk" or name.startswith("vd"):
        return "virtio"
    if name.startswith("sd"):
        return "scsi"
    return "other"


def read_queue(node: Path) -> DiskQueue:
    """The queue settings of the disk whose sysfs directory is ``node``."""
    queue = node / "queue"
    scheduler_line = _read(queue / "scheduler") or ""
    names = tuple(word.strip("[]") for word in scheduler_line.split())
    active = next((word.strip("[]") for word in scheduler_line.split() if word.startswith("[")), None)
    if active is None and names == ("none",):
        active = "none"
    mq = node / "mq"
    hw_queues = None
    if mq.is_dir():
        hw_queues = sum(1 for entry in mq.iterdir() if entry.name.isdigit()) or None
    rotational = _read_int(queue / "rotational")
    model = _read(node / "device" / "model")
    return DiskQueue(
        name=node.name, transport=_transport(node), nr_requests=_read_int(queue / "nr_requests"),
        scheduler=active, schedulers=names, read_ahead_kb=_read_int(queue / "read_ahead_kb"),
        max_sectors_kb=_read_int(queue / "max_sectors_kb"),
        max_hw_sectors_kb=_read_int(queue / "max_hw_sectors_kb"),
        logical_block_size=_read_int(queue / "logical_block_size"),
        physical_block_size=_read_int(queue / "physical_block_size"),
        rotational=None if rotational is None else rotational == 1, hw_queues=hw_queues, model=model)


def _disk_of(node: Path) -> tuple[Path, str]:
    """A partition's disk (its parent directory), or the node itself."""
    if (node / "partition").is_file():
        return node.parent, f"{node.name} -> {node.parent.name}"
    return node, node.name


def _members(disk: Path, sysfs: Path, device: BlockDevice, depth: int, seen: set[str]) -> None:
    """Add the disks that store ``disk``'s data to ``device.disks`` (depth first, each once)."""
    if depth > _MAX_DEPTH or disk.name in seen:
        return
    seen.add(disk.name)
    queue = read_queue(disk)
    slaves = disk / "slaves"
    lower = sorted(slaves.iterdir()) if slaves.is_dir() else []
    if queue.transport in ("dm", "md") and lower:
        label = _read(disk / "dm" / "name") or _read(disk / "md" / "level") or ""
        device.chain.append(f"{disk.name} ({queue.transport}{' ' + label if label else ''}: "
                            f"{', '.join(s.name for s in lower)})")
        for member in lower:
            node, how = _disk_of(Path(os.path.realpath(member)))
            if "->" in how:
                device.chain.append(how)
            _members(node, sysfs, device, depth + 1, seen)
        return
    backing = _read(disk / "loop" / "backing_file") if queue.transport == "loop" else None
    if backing:
        device.chain.append(f"{disk.name} (loop: {backing})")
        try:
            st_dev = os.stat(backing).st_dev
        except OSError:
            device.disks.append(queue)  # the backing file is gone or hidden: the loop is all we know
            return
        held_on = _node_of(st_dev, sysfs)
        if held_on is None:
            device.disks.append(queue)
            return
        node, how = _disk_of(held_on)
        if "->" in how:
            device.chain.append(how)
        _members(node, sysfs, device, depth + 1, seen)
        return
    device.disks.append(queue)


def _node_of(st_dev: int, sysfs: Path) -> Path | None:
    link = sysfs / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}"
    if not link.exists():
        return None
    return Path(os.path.realpath(link))


def device_of(path: str | os.PathLike, sysfs: str | os.PathLike = SYSFS) -> BlockDevice | None:
    """The block device holding ``path`` and the disks beneath it; None where sysfs does not say
    (tmpfs, overlay, network filesystems, no /sys, another OS)."""
    root = Path(sysfs)
    target = Path(path)
    while not target.exists() and target != target.parent:
        target = target.parent  # the checkpoint directory may not exist yet
    try:
        st_dev = os.stat(target).st_dev
    except OSError:
        return None
    node = _node_of(st_dev, root)
    if node is None:
        return None
    disk, how = _disk_of(node)
    device = BlockDevice(name=node.name)
    if "->" in how:
        device.chain.append(how)
    device.top = read_queue(disk)
    _members(disk, root, device, 0, set())
    return device


# --------------------------------------------------------------------------- judging


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


SMALL_REQUEST = 1 << 20
"""At or below this request size a scheduler's per-request work shows; above it (the 8 MiB
default is a few hundred requests a second per GB/s) it does not."""

QUEUE_ENOUGH = 64 << 20
"""Bytes queued at a disk that keep any drive busy (14 GB/s x 1 ms is 14 MB): a queue that holds
this much gains nothing from holding more, however the kernel splits the requests."""


def check_queues(device: BlockDevice, per_rank_depth: int, local_ranks: int,
                 request_bytes: int) -> list[Advice]:
    """Where a change to the block layer would let the disk see more of what the writers send,
    with the line that makes it; nothing where the settings already keep it busy.

    ``per_rank_depth x local_ranks`` requests of ``request_bytes`` each reach every disk at once
    at worst (a striped array splits each large request over all its members). The kernel splits
    a request above ``max_sectors_kb`` into pieces, each taking one of ``nr_requests`` tags: that
    is normal and costs nothing while the tags hold ``QUEUE_ENOUGH`` bytes or all that is sent."""
    advice: list[Advice] = []
    aggregate = per_rank_depth * local_ranks
    request_kb = -(-request_bytes // 1024)
    queues = [device.top] if device.top and device.top.transport in ("dm", "md") else []
    for queue in queues + device.disks:
        sysdir = f"/sys/block/{queue.name}/queue"
        limit = min(queue.max_sectors_kb or request_kb, request_kb)
        pieces = -(-request_kb // limit)
        raised = min(max(queue.max_hw_sectors_kb or limit, limit), request_kb)
        tags = queue.nr_requests if queue.transport not in ("dm", "md") else None
        sent = aggregate * request_kb * 1024
        if tags is not None and aggregate * pieces > tags and tags * limit * 1024 < min(sent, QUEUE_ENOUGH):
            held = f"{local_ranks} rank(s) x queue_depth {per_rank_depth} = {aggregate} requests in flight"
            if raised > limit:
                advice.append(Advice(
                    queue.name,
                    f"{held}, each {request_kb} KiB split into {pieces} above max_sectors_kb {limit}: its "
                    f"nr_requests {tags} hold only {format_size(tags * limit * 1024)} of them",
                    f"echo {raised} > {sysdir}/max_sectors_kb"))
            best = -(-request_kb // raised)
            if aggregate * best > tags and tags * raised * 1024 < min(sent, QUEUE_ENOUGH):
                advice.append(Advice(
                    queue.name,
                    f"{held}" + (f" ({aggregate * best} after the kernel splits them)" if best > 1 else "")
                    + f", above nr_requests {tags}: the kernel holds the rest back",
                    f"echo {_next_power_of_two(aggregate * best)} > {sysdir}/nr_requests "
                    f"(or set node_queue_depth / DCP_NVME_NODE_QUEUE_DEPTH={max(1, tags // best)})"))
        if (queue.scheduler in REORDERING_SCHEDULERS and "none" in queue.schedulers
                and request_bytes <= SMALL_REQUEST and not queue.rotational):
            advice.append(Advice(
                queue.name,
                f"the {queue.scheduler} scheduler does work per request, which shows at "
                f"{request_kb} KiB requests on a solid-state disk (none passes them straight to "
                "the drive's queues)",
                f"echo none > {sysdir}/scheduler"))
    return advice


def format_device(device: BlockDevice | None) -> list[str]:
    """Lines a person reads: the chain, then one line per disk."""
    if device is None:
        return ["block layer: not a local block device here (or /sys is not readable)"]
    lines = [f"block layer: {device.name}" + (f" via {'; '.join(device.chain)}" if device.chain else "")]
    for q in device.disks:
        parts = [f"{q.transport}", f"nr_requests {q.nr_requests}", f"scheduler {q.scheduler}",
                 f"read_ahead_kb {q.read_ahead_kb}", f"max_sectors_kb {q.max_sectors_kb}",
                 f"blocks {q.logical_block_size}/{q.physical_block_size}",
                 f"rotational {'yes' if q.rotational else 'no' if q.rotational is not None else '?'}"]
        if q.hw_queues:
            parts.append(f"hw queues {q.hw_queues}")
        lines.append(f"  {q.name}: " + ", ".join(parts) + (f" ({q.model})" if q.model else ""))
    return lines


_WARNED: set[str] = set()


def warn_once(device: BlockDevice | None, per_rank_depth: int, local_ranks: int, request_bytes: int,
              logger) -> list[Advice]:
    """The advice for a save's settings, logged once per process and disk (saves repeat), by
    one rank per node (the node's ranks share the disks), with the fix in the message."""
    if device is None:
        return []
    advice = check_queues(device, per_rank_depth, local_ranks, request_bytes)
    if advice and device.name not in _WARNED and leads_its_node():
        _WARNED.add(device.name)
        for item in advice:
            logger.warning("dcp_nvme: block layer: %s (as root; lasts until reboot, a udev rule keeps it)",
                           item)
    return advice
