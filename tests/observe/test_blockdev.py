"""Block-layer awareness: device resolution on fake sysfs trees, the warnings, and this machine."""

from __future__ import annotations

import os

import pytest
from dcp_nvme_harness.fake_sysfs import add_disk, add_loop, add_partition, add_virtual, link_dev, majmin

from dcp_nvme.observe.blockdev import check_queues, device_of, format_device


@pytest.fixture
def data(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    return directory


def test_nvme_partition_resolves_to_its_disk_with_hw_queues(tmp_path, data):
    sysfs = tmp_path / "sys"
    disk = add_disk(sysfs, "nvme0n1", hw_queues=8, model="Fast NVMe 4TB", nr_requests=1023)
    link_dev(sysfs, majmin(data), add_partition(disk, "nvme0n1p2"))
    device = device_of(data / "step_1", sysfs)  # not created yet: its parent's device counts
    assert device.name == "nvme0n1p2"
    assert device.chain == ["nvme0n1p2 -> nvme0n1"]
    [queue] = device.disks
    assert (queue.name, queue.transport, queue.hw_queues, queue.nr_requests) == ("nvme0n1", "nvme", 8, 1023)
    assert (queue.scheduler, queue.max_sectors_kb, queue.logical_block_size, queue.physical_block_size) == (
        "none", 1280, 512, 4096)
    assert queue.rotational is False and queue.model == "Fast NVMe 4TB"
    assert check_queues(device, per_rank_depth=8, local_ranks=8, request_bytes=1 << 20) == []
    assert "hw queues 8" in "\n".join(format_device(device))


def test_raid0_over_two_nvme_lists_both_members_and_warns_for_each(tmp_path, data):
    sysfs = tmp_path / "sys"
    first = add_disk(sysfs, "nvme0n1", nr_requests=32, hw_queues=4)
    second = add_disk(sysfs, "nvme1n1", "devices/pci0000:00/0000:00:05.0", nr_requests=32, hw_queues=4)
    md = add_virtual(sysfs, "md0", "md", [add_partition(first, "nvme0n1p1"), second], "raid0")
    link_dev(sysfs, majmin(data), md)
    device = device_of(data, sysfs)
    assert [d.name for d in device.disks] == ["nvme0n1", "nvme1n1"]
    assert device.chain[0] == "md0 (md raid0: nvme0n1p1, nvme1n1)"
    advice = check_queues(device, per_rank_depth=16, local_ranks=8, request_bytes=1 << 20)
    assert [a.fix.split(" (")[0] for a in advice] == [
        "echo 128 > /sys/block/nvme0n1/queue/nr_requests", "echo 128 > /sys/block/nvme1n1/queue/nr_requests"]
    assert "8 rank(s) x queue_depth 16 = 128" in advice[0].problem
    assert "DCP_NVME_NODE_QUEUE_DEPTH=32" in advice[0].fix
    # 64 tags of 1 MiB hold 64 MiB: enough for any drive, so more would not help
    assert check_queues(device, per_rank_depth=16, local_ranks=8, request_bytes=1 << 20) != []
    for disk in (first, second):
        (disk / "queue" / "nr_requests").write_text("64\n")
    assert check_queues(device_of(data, sysfs), per_rank_depth=16, local_ranks=8, request_bytes=1 << 20) == []


def test_dm_device_resolves_through_its_slave_and_flags_its_scheduler(tmp_path, data):
    sysfs = tmp_path / "sys"
    disk = add_disk(sysfs, "sdb", scheduler="none [mq-deadline] kyber bfq", nr_requests=256, rotational=0)
    dm = add_virtual(sysfs, "dm-0", "dm", [add_partition(disk, "sdb1")], "vg-checkpoints")
    link_dev(sysfs, majmin(data), dm)
    device = device_of(data, sysfs)
    assert device.top.transport == "dm"
    assert [(d.name, d.transport, d.scheduler) for d in device.disks] == [("sdb", "scsi", "mq-deadline")]
    assert device.chain == ["dm-0 (dm vg-checkpoints: sdb1)", "sdb1 -> sdb"]
    [advice] = check_queues(device, per_rank_depth=8, local_ranks=2, request_bytes=1 << 20)
    assert advice.fix == "echo none > /sys/block/sdb/queue/scheduler"


def test_a_split_that_fits_the_queue_is_normal_and_not_advised(tmp_path, data):
    """A typical NVMe (max_hw_sectors_kb 128-512) splits every 8 MiB request; the pieces fit its
    queue, so nothing would help: no advice, above all never a smaller block_size."""
    sysfs = tmp_path / "sys"
    nvme = add_disk(sysfs, "nvme0n1", max_sectors_kb=128, max_hw_sectors_kb=128, nr_requests=1023, hw_queues=8)
    link_dev(sysfs, majmin(data), nvme)
    assert check_queues(device_of(data, sysfs), per_rank_depth=8, local_ranks=8, request_bytes=8 << 20) == []
    # this development VM's disk: mq-deadline, 8 MiB requests in 2 pieces, 16 of 256 tags
    vda = add_disk(sysfs, "vda", driver="virtio_blk", scheduler="none [mq-deadline] kyber bfq", nr_requests=256,
                   max_sectors_kb=4096, max_hw_sectors_kb=2147483647, rotational=1)
    os.unlink(sysfs / "dev" / "block" / majmin(data))
    link_dev(sysfs, majmin(data), vda)
    assert check_queues(device_of(data, sysfs), per_rank_depth=8, local_ranks=1, request_bytes=8 << 20) == []


def test_a_split_that_overflows_the_queue_names_the_raise_that_fits_it(tmp_path, data):
    sysfs = tmp_path / "sys"
    vda = add_disk(sysfs, "vda", driver="virtio_blk", scheduler="[none] mq-deadline", max_sectors_kb=1280,
                   max_hw_sectors_kb=2147483647, hw_queues=1, rotational=1, nr_requests=16)
    link_dev(sysfs, majmin(data), vda)
    device = device_of(data, sysfs)
    assert device.disks[0].transport == "virtio"
    [advice] = check_queues(device, per_rank_depth=8, local_ranks=4, request_bytes=8 << 20)
    assert "each 8192 KiB split into 7 above max_sectors_kb 1280: its nr_requests 16 hold only 20 MiB" in advice.problem
    assert advice.fix == "echo 8192 > /sys/block/vda/queue/max_sectors_kb"
    capped = add_disk(sysfs, "vdb", driver="virtio_blk", max_sectors_kb=512, max_hw_sectors_kb=512, nr_requests=8)
    os.unlink(sysfs / "dev" / "block" / majmin(data))
    link_dev(sysfs, majmin(data), capped)
    assert check_queues(device_of(data, sysfs), 4, 1, 1 << 20) == []  # 8 pieces fit 8 tags
    [advice] = check_queues(device_of(data, sysfs), 8, 1, 1 << 20)  # at the hardware cap only the queue helps
    assert "(16 after the kernel splits them), above nr_requests 8" in advice.problem
    assert advice.fix == ("echo 16 > /sys/block/vdb/queue/nr_requests "
                          "(or set node_queue_depth / DCP_NVME_NODE_QUEUE_DEPTH=4)")


def test_loop_device_follows_its_backing_file_to_the_disk_beneath(tmp_path, data):
    sysfs = tmp_path / "sys"
    backing = tmp_path / "disk.img"
    backing.write_bytes(b"\0" * 4096)
    vda = add_disk(sysfs, "vda", driver="virtio_blk", scheduler="none [mq-deadline]", nr_requests=32)
    link_dev(sysfs, majmin(backing), vda)
    loop = add_loop(sysfs, "loop3", str(backing))
    # the checkpoint must sit on another filesystem than the image: /proc stands in for the loop's
    link_dev(sysfs, majmin("/proc"), loop)
    device = device_of("/proc", sysfs)
    assert device.chain == [f"loop3 (loop: {backing})"]
    assert [d.name for d in device.disks] == ["vda"]
    fixes = [a.fix for a in check_queues(device, 32, 16, 1 << 20)]
    assert fixes[0].startswith("echo 512 > /sys/block/vda/queue/nr_requests")
    assert fixes[1] == "echo none > /sys/block/vda/queue/scheduler"


def test_loop_with_a_vanished_backing_file_reports_the_loop_itself(tmp_path, data):
    sysfs = tmp_path / "sys"
    link_dev(sysfs, majmin(data), add_loop(sysfs, "loop0", str(tmp_path / "gone.img")))
    assert [d.name for d in device_of(data, sysfs).disks] == ["loop0"]


def test_no_sysfs_entry_means_no_device(tmp_path, data):
    assert device_of(data, tmp_path / "empty-sys") is None
    assert "not a local block device" in format_device(None)[0]


def test_this_machine(tmp_path):
    """A real run on whatever disk holds tmp_path (/dev/vda on the development machine)."""
    if not os.access("/sys/dev/block", os.R_OK):
        pytest.skip("/sys is not readable here")
    device = device_of(tmp_path)
    if device is None:
        pytest.skip("tmp_path is not on a local block device (tmpfs/overlay)")
    assert device.disks, device.to_dict()
    for disk in device.disks:
        assert os.path.isdir(f"/sys/block/{disk.name}/queue")
        if disk.nr_requests is not None:
            assert disk.nr_requests == int(open(f"/sys/block/{disk.name}/queue/nr_requests").read())
    huge = check_queues(device, per_rank_depth=256, local_ranks=1024, request_bytes=4096)
    assert any("nr_requests" in a.fix or "nr_requests" in a.problem for a in huge if a.disk in
               {d.name for d in device.disks if d.nr_requests})
    print("\n".join(format_device(device) + [str(a) for a in check_queues(device, 8, 2, 8 << 20)]))


def test_warn_once_logs_once_per_process_and_disk_and_only_on_local_rank_zero(tmp_path, data, monkeypatch, caplog):
    import logging

    from dcp_nvme.observe import blockdev

    monkeypatch.setattr(blockdev, "_WARNED", set())
    sysfs = tmp_path / "sys"
    link_dev(sysfs, majmin(data), add_disk(sysfs, "nvme0n1", nr_requests=32))
    device = device_of(data, sysfs)
    logger = logging.getLogger("test.blockdev")
    caplog.set_level(logging.WARNING, logger="test.blockdev")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert len(blockdev.warn_once(device, 8, 8, 1 << 20, logger)) == 1
    assert not caplog.records  # another rank of the node says it
    monkeypatch.setenv("LOCAL_RANK", "0")
    for _ in range(2):
        [advice] = blockdev.warn_once(device, 8, 8, 1 << 20, logger)
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"dcp_nvme: block layer: {advice} (as root;")
    assert "echo 64 > /sys/block/nvme0n1/queue/nr_requests" in message and "docs/" not in message
    [_] = blockdev.warn_once(device, 16, 8, 1 << 20, logger)  # other settings, same disk: said already
    assert len(caplog.records) == 1
    assert blockdev.warn_once(device, 4, 8, 1 << 20, logger) == []  # 32 fit: nothing to say
    assert blockdev.warn_once(None, 8, 8, 1 << 20, logger) == []
