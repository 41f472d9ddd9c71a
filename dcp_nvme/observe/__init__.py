"""What a save ran on, when asked: the Linux block layer under a directory (``blockdev``), drive
temperature and throttling (``drive_health``), and the page cache and machine facts a benchmark
reports (``machine``). ``dcp-nvme bench`` and ``dcp-nvme tune`` watch the drive around their own
runs; a plain save runs none of it unless ``enable_save_diagnostics()`` was called."""

from __future__ import annotations


def enable_save_diagnostics(on: bool = True) -> None:
    """Watch the drive's health and the block layer's queues around every save's write in this
    process (``last_stats`` and the manifest then hold ``drive`` and ``block_layer``); off by
    default, since it reads sysfs and may run ``nvme smart-log`` twice per save."""
    from dcp_nvme import seams

    seams.save_diagnostics.plug("dcp_nvme.observe.drive_health:SaveWatch" if on else None)
