"""The run-directory API: committed checkpoints, step names, the newest, symlinks ignored."""

from __future__ import annotations

import os

import pytest

import dcp_nvme
from dcp_nvme.storage.run_dir import checkpoints, committed_kind, latest, parse_step


@pytest.mark.parametrize(
    "name, step",
    [
        ("step_1000", 1000), ("step-20", 20), ("step7", 7), ("global_step42", 42),
        ("epoch=2-step=30", 30), ("epoch=0-step=4.ckpt", 4), ("last.ckpt", None), ("iter_0000500", 500), ("checkpoint-7", 7), ("300", 300),
        ("final", None), ("latest", None), ("step_x", None),
    ],
)
def test_parse_step(name, step):
    assert parse_step(name) == step


def _commit(run, name, marker="manifest.json", mtime_ns=None):
    d = run / name
    d.mkdir()
    (d / marker).write_text("{}")
    if mtime_ns is not None:
        os.utime(d / marker, ns=(mtime_ns, mtime_ns))
    return d


def test_newest_by_step_not_by_name_order(tmp_path):
    _commit(tmp_path, "step_900")
    newest = _commit(tmp_path, "step_1000")
    _commit(tmp_path, "step_50", marker=".metadata")
    (tmp_path / "step_2000").mkdir()  # uncommitted: no marker
    assert [c.name for c in checkpoints(tmp_path)] == ["step_50", "step_900", "step_1000"]
    assert latest(tmp_path) == newest
    assert dcp_nvme.latest(tmp_path) == newest
    assert [c.kind for c in dcp_nvme.checkpoints(tmp_path)] == ["dcp", "nvme", "nvme"]
    assert [c.name for c in checkpoints(tmp_path, kinds=("nvme",))] == ["step_900", "step_1000"]


def test_lightning_and_megatron_names(tmp_path):
    _commit(tmp_path, "epoch=0-step=10")
    _commit(tmp_path, "epoch=1-step=20")
    assert latest(tmp_path).name == "epoch=1-step=20"
    mega = tmp_path / "mega"
    mega.mkdir()
    a = _commit(mega, "iter_0000100")
    _commit(mega, "iter_0000200")
    (a / "metadata.json").write_text("{}")
    assert latest(mega, extra_markers=("metadata.json",)) == a


def test_commit_time_orders_when_a_name_has_no_step(tmp_path):
    _commit(tmp_path, "final", mtime_ns=3_000_000_000)
    _commit(tmp_path, "step_5", mtime_ns=1_000_000_000)
    assert [c.name for c in checkpoints(tmp_path)] == ["step_5", "final"]


def test_symlinks_and_non_regular_markers_are_not_checkpoints(tmp_path):
    real = _commit(tmp_path, "step_1")
    (tmp_path / "latest").symlink_to(real, target_is_directory=True)
    (tmp_path / "step_99").symlink_to(real, target_is_directory=True)
    linked = tmp_path / "step_3"
    linked.mkdir()
    (linked / "manifest.json").symlink_to(real / "manifest.json")
    fifo_dir = tmp_path / "step_4"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "manifest.json")
    assert [c.path for c in checkpoints(tmp_path)] == [real]
    assert committed_kind(tmp_path / "latest") is None


def test_missing_run_dir_and_bad_kind(tmp_path):
    assert checkpoints(tmp_path / "nope") == []
    assert latest(tmp_path / "nope") is None
    with pytest.raises(ValueError, match="unknown checkpoint kind"):
        checkpoints(tmp_path, kinds=("zarr",))


def test_latest_is_a_checkpoint_our_reader_loads(tmp_path):
    ours = _commit(tmp_path, "step_10")
    stock = _commit(tmp_path, "step_20", marker=".metadata")  # newer, but DCP's stock layout
    assert latest(tmp_path) == ours
    assert latest(tmp_path, kinds=("nvme", "dcp")) == stock
    assert [(c.name, c.kind) for c in checkpoints(tmp_path)] == [("step_10", "nvme"), ("step_20", "dcp")]
    assert latest(tmp_path / "step_20") is None
