"""Drive health: SMART log parsing, a fake nvme-cli, fake hwmon trees, virtual drives."""

from __future__ import annotations

import json
import logging
import stat

import pytest
from dcp_nvme_harness.fake_sysfs import add_disk, add_hwmon, link_dev, majmin

from dcp_nvme.observe import drive_health as health
from dcp_nvme.observe.drive_health import DriveWatch, parse_smart_log, read_health, throttle_reasons

SMART = {"critical_warning": 0, "temperature": 318, "avail_spare": 100, "warning_temp_time": 0,
         "critical_comp_time": 0, "thm_temp1_trans_count": 2, "thm_temp2_trans_count": 0,
         "thm_temp1_total_time": 40, "thm_temp2_total_time": 0}


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    monkeypatch.setattr(health, "_ANNOUNCED", set())
    monkeypatch.setattr(health, "_NVME_FAILED", set())
    monkeypatch.setattr(health, "_DEVICES", {})


def fake_nvme(tmp_path, doc_path, exit_status=0):
    """An executable that answers like ``nvme smart-log /dev/X -o json`` from a JSON file."""
    script = tmp_path / "nvme"
    script.write_text(f"#!/bin/sh\ncat {doc_path}\nexit {exit_status}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_smart_log_parsing_converts_kelvin_and_keeps_the_throttle_counters():
    reading = parse_smart_log("nvme0n1", json.dumps(SMART))
    assert reading.temperature_c == pytest.approx(44.9)
    assert reading.counters["thm_temp1_trans_count"] == 2 and not reading.hot
    assert parse_smart_log("nvme0n1", json.dumps({**SMART, "temperature": "51 C"})).temperature_c == 51
    hot = parse_smart_log("nvme0n1", json.dumps({**SMART, "critical_warning": 2}))
    assert hot.hot
    with pytest.raises(ValueError, match="not JSON"):
        parse_smart_log("nvme0n1", "Smart Log for NVME device")
    with pytest.raises(ValueError, match="no temperature"):
        parse_smart_log("nvme0n1", "{}")


def test_throttle_reasons_are_the_counters_that_grew():
    before = parse_smart_log("d", json.dumps(SMART))
    after = parse_smart_log("d", json.dumps({**SMART, "thm_temp1_trans_count": 5, "thm_temp1_total_time": 52}))
    assert throttle_reasons(before, after) == ["thm_temp1_trans_count +3", "thm_temp1_total_time +12"]
    assert throttle_reasons(before, before) == []


def test_watch_over_a_fake_nvme_cli_sees_throttling_during_the_io(tmp_path):
    sysfs = tmp_path / "sys"
    data = tmp_path / "ckpt"
    data.mkdir()
    disk = add_disk(sysfs, "nvme0n1", hw_queues=4)
    add_hwmon(disk, 45000, 70850)
    link_dev(sysfs, majmin(data), disk)
    doc = tmp_path / "smart.json"
    doc.write_text(json.dumps(SMART))
    watch = DriveWatch(data, sysfs, nvme=fake_nvme(tmp_path, doc))
    doc.write_text(json.dumps({**SMART, "temperature": 345, "thm_temp2_trans_count": 1}))
    summary = watch.finish()
    assert summary["available"] and summary["throttled"]
    entry = summary["disks"]["nvme0n1"]
    assert entry["source"] == "nvme smart-log"
    assert (entry["temperature_c_before"], entry["temperature_c_after"]) == (pytest.approx(44.9), pytest.approx(71.9))
    assert entry["throttle"] == ["thm_temp2_trans_count +1"]


def test_failing_nvme_cli_falls_back_to_hwmon_and_is_not_asked_again(tmp_path):
    sysfs = tmp_path / "sys"
    hwmon = add_hwmon(add_disk(sysfs, "nvme0n1"), 50000, 70000)
    nvme = fake_nvme(tmp_path, tmp_path / "missing.json", exit_status=1)
    reading = read_health("nvme0n1", "nvme", sysfs, nvme)
    assert (reading.source, reading.temperature_c, reading.warning_c, reading.hot) == ("hwmon", 50, 70, False)
    assert (nvme, "nvme0n1") in health._NVME_FAILED
    (hwmon / "temp1_input").write_text("72000\n")
    assert read_health("nvme0n1", "nvme", sysfs, nvme).hot


def test_hwmon_over_the_warning_limit_counts_as_throttled(tmp_path):
    sysfs = tmp_path / "sys"
    data = tmp_path / "ckpt"
    data.mkdir()
    disk = add_disk(sysfs, "sda", rotational=1)
    hwmon = add_hwmon(disk, 40000, 60000)
    link_dev(sysfs, majmin(data), disk)
    watch = DriveWatch(data, sysfs, nvme="")
    (hwmon / "temp1_input").write_text("61000\n")
    summary = watch.finish()
    assert summary["throttled"]
    assert summary["disks"]["sda"]["throttle"] == ["temperature condition at 61 C (warning 60 C)"]


def test_virtual_drive_says_unavailable_once_per_process(tmp_path, caplog):
    sysfs = tmp_path / "sys"
    data = tmp_path / "ckpt"
    data.mkdir()
    link_dev(sysfs, majmin(data), add_disk(sysfs, "vda", driver="virtio_blk"))
    caplog.set_level(logging.INFO, logger="dcp_nvme.observe.drive_health")
    for _ in range(3):
        summary = DriveWatch(data, sysfs).finish()
    assert summary == {"available": False, "throttled": False, "disks": {"vda": {
        "source": None, "temperature_c_before": None, "temperature_c_after": None, "throttle": [],
        "unavailable": "virtio drive: no SMART log or hwmon sensor"}}}
    said = [r for r in caplog.records if "not available" in r.getMessage()]
    assert len(said) == 1 and "vda" in said[0].getMessage()


def test_a_save_on_a_throttling_drive_warns_and_records_it(tmp_path, monkeypatch, caplog):
    """A real save through NVMeWriter over a fake sysfs and an nvme-cli whose counter grows per call."""
    import functools

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_nvme import NVMeWriter, observe
    from dcp_nvme.observe import drive_health

    sysfs = tmp_path / "sys"
    data = tmp_path / "ckpt"
    data.mkdir()
    link_dev(sysfs, majmin(data), add_disk(sysfs, "nvme0n1"))
    calls = tmp_path / "calls"
    script = tmp_path / "nvme"
    script.write_text(f"#!/bin/sh\nn=$(($(cat {calls} 2>/dev/null || echo 0) + 1))\necho $n > {calls}\n"
                      'echo "{\\"temperature\\": 350, \\"critical_warning\\": 0, \\"thm_temp1_trans_count\\": $n}"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(drive_health, "DriveWatch", functools.partial(DriveWatch, sysfs=sysfs, nvme=str(script)))
    caplog.set_level(logging.WARNING, logger="dcp_nvme.observe.drive_health")
    saver = NVMeWriter(data, block_size=65536, direct_io=False)
    observe.enable_save_diagnostics()  # asked for: a plain save runs none of it
    try:
        dcp.save({"w": torch.arange(100_000, dtype=torch.float32)}, storage_writer=saver, no_dist=True)
    finally:
        observe.enable_save_diagnostics(False)
    drive = saver.last_stats["drive"]
    assert drive["throttled"] and drive["disks"]["nvme0n1"]["throttle"] == ["thm_temp1_trans_count +1"]
    assert drive["disks"]["nvme0n1"]["temperature_c_after"] == pytest.approx(76.9)
    assert saver.last_manifest["layers"]["throttled_ranks"] == [0]
    assert any("the drive throttled during the save" in r.getMessage() for r in caplog.records)
    on_disk = json.loads((data / "manifest.json").read_text())
    assert on_disk["ranks"][0]["drive"]["throttled"] is True
