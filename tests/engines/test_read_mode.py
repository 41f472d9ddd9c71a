"""read_mode: O_DIRECT or buffered reads with readahead, checked like every option, honoured by
both host engines, and chosen by ``dcp-nvme tune`` from a measurement."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.config import TUNE_FILE_ENV, IOConfig, resolve_config
from dcp_nvme.engines.uring import uring_unavailable_reason
from dcp_nvme.tune.probe import pick_read_mode

ENGINES = ["posix"] + (["uring"] if uring_unavailable_reason() is None else [])


@pytest.fixture(autouse=True)
def _no_tune_file(tmp_path, monkeypatch):
    monkeypatch.setenv(TUNE_FILE_ENV, str(tmp_path / "absent.json"))
    monkeypatch.delenv("DCP_NVME_DIRECT_IO", raising=False)


def test_read_mode_is_validated_wherever_it_comes_from(tmp_path, monkeypatch, caplog):
    with pytest.raises(ValueError, match=r"read_mode='fast' from the argument .*direct, buffered"):
        resolve_config(read_mode="fast")
    with pytest.raises(ValueError, match="read_mode='bufferd' from the argument"):
        NVMeReader(tmp_path, read_mode="bufferd")
    assert NVMeReader(tmp_path, read_mode="buffered").config.read_mode == "buffered"
    tune_file = tmp_path / "tune.json"  # the other source: a bad tuned value is named and skipped
    tune_file.write_text(json.dumps({"best": {"read_mode": "bufferd"}}))
    monkeypatch.setenv(TUNE_FILE_ENV, str(tune_file))
    with caplog.at_level("WARNING", logger="dcp_nvme.config"):
        assert resolve_config().read_mode == "auto"
    assert f"ignoring read_mode of tune file {tune_file}" in caplog.text
    tune_file.write_text(json.dumps({"best": {"read_mode": "buffered"}}))
    assert resolve_config().read_mode == "buffered"


def test_reads_direct_follows_the_mode_then_direct_io():
    assert IOConfig(direct_io=True).reads_direct
    assert not IOConfig(direct_io=False).reads_direct
    assert not IOConfig(direct_io=True, read_mode="buffered").reads_direct
    assert IOConfig(direct_io=False, read_mode="direct").reads_direct


def test_a_tuned_read_mode_is_used_unless_overridden(tmp_path, monkeypatch, caplog):
    tune_file = tmp_path / "tune.json"
    tune_file.write_text(json.dumps({"best": {"read_mode": "buffered"}}))
    monkeypatch.setenv(TUNE_FILE_ENV, str(tune_file))
    assert resolve_config().read_mode == "buffered"
    assert resolve_config(read_mode="direct").read_mode == "direct"
    tune_file.write_text(json.dumps({"best": {"read_mode": "sideways"}}))
    with caplog.at_level("WARNING", logger="dcp_nvme.config"):
        assert resolve_config().read_mode == resolve_config(read_mode=None).read_mode != "sideways"
    assert "ignoring read_mode of tune file" in caplog.text and "expected one of auto, direct, buffered" in caplog.text


def test_pick_read_mode_needs_a_clear_win_to_leave_o_direct():
    assert pick_read_mode({"direct": 1.0, "buffered": 1.5}) == "buffered"
    assert pick_read_mode({"direct": 1.0, "buffered": 1.02}) == "direct"
    assert pick_read_mode({"direct": 2.0, "buffered": 1.0}) == "direct"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_load_in_each_read_mode_is_exact(tmp_path, engine, mode):
    g = torch.Generator().manual_seed(1)
    sd = {"a": torch.randn(300, 301, generator=g), "b": torch.arange(5, dtype=torch.int8),
          "e": torch.empty(0)}
    dcp.save(sd, storage_writer=NVMeWriter(tmp_path, block_size=65_536), no_dist=True)
    back = {k: torch.full_like(v, 3) for k, v in sd.items()}
    reader = NVMeReader(tmp_path, engine=engine, read_mode=mode, block_size=65_536)
    dcp.load(back, storage_reader=reader, no_dist=True)
    for key in sd:
        assert torch.equal(back[key], sd[key]), key
    # O_DIRECT is what this filesystem takes (the writer used it); buffered mode never asks for it
    assert reader.last_stats["direct_io"] is (mode == "direct")
