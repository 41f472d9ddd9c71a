"""A drain fails at once where a retry cannot help: a missing or cut local file, a backend
package that is not installed. The backoff here is 60 s: a retried failure would show."""

from __future__ import annotations

import sys
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeWriter
from dcp_nvme.errors import DrainError, MissingDependencyError
from dcp_nvme.tiers import DrainOptions, drain, drain_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
SLOW_RETRIES = DrainOptions(retries=3, backoff=60.0)


def _checkpoint(path):
    dcp.save({"w": torch.arange(50_000, dtype=torch.float32), "step": 3}, storage_writer=NVMeWriter(path))
    (data,) = path.glob("rank_*.safetensors")
    return data


@pytest.mark.parametrize("damage", ["missing", "cut"])
def test_damaged_local_file_fails_the_drain_at_once(tmp_path, damage):
    data = _checkpoint(tmp_path / "c")
    if damage == "missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:-4096])
    started = time.monotonic()
    with pytest.raises(DrainError) as info:
        drain(tmp_path / "c", str(tmp_path / "mirror"), options=SLOW_RETRIES)
    assert time.monotonic() - started < 60  # not retried: the first backoff alone is 60 s
    said = "is missing: the local checkpoint is damaged" if damage == "missing" else "its manifest says"
    assert said in str(info.value) and data.name in str(info.value)
    state = drain_state(tmp_path / "c")
    assert state.state == "failed" and state.attempts == 1 and said in state.cause
    assert not (tmp_path / "mirror" / "manifest.json").exists()


def test_missing_s3fs_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    fix = "pip install 'dcp_nvme[s3]'"
    with pytest.raises(MissingDependencyError, match=r"s3:// URLs need a package that is not installed: "
                                                     r"pip install 'dcp_nvme\[s3\]'"):
        NVMeWriter(tmp_path / "c", mirror="s3://bucket/run/step_1")
    _checkpoint(tmp_path / "c")
    started = time.monotonic()
    with pytest.raises(DrainError, match=fix.replace("[", r"\[").replace("]", r"\]")):
        drain(tmp_path / "c", "s3://bucket/run/step_1", options=SLOW_RETRIES)
    assert time.monotonic() - started < 60
