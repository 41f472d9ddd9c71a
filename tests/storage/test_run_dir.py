"""The run-directory API: committed checkpoints, step names, the newest, symlinks ignored."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_nvme
from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.errors import CheckpointNotFoundError
from dcp_nvme.storage.run_dir import checkpoints, committed_kind, latest, parse_step
from dcp_nvme.tools.listing import list_checkpoints


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


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """A small real checkpoint: ``latest`` returns only one whose manifest and files check out."""
    path = tmp_path_factory.mktemp("whole") / "ckpt"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=NVMeWriter(path), no_dist=True)
    return path


def _commit(run, name, marker="manifest.json", mtime_ns=None, whole=None):
    """A committed directory: a copy of ``whole`` if given, else just the commit marker."""
    d = run / name
    if whole is None:
        d.mkdir()
        (d / marker).write_text("{}")
    else:
        shutil.copytree(whole, d)
    if mtime_ns is not None:
        os.utime(d / marker, ns=(mtime_ns, mtime_ns))
    return d


def test_newest_by_step_not_by_name_order(tmp_path, whole):
    _commit(tmp_path, "step_900")
    newest = _commit(tmp_path, "step_1000", whole=whole)
    _commit(tmp_path, "step_50", marker=".metadata")
    (tmp_path / "step_2000").mkdir()  # uncommitted: no marker
    assert [c.name for c in checkpoints(tmp_path)] == ["step_50", "step_900", "step_1000"]
    assert latest(tmp_path) == newest
    assert dcp_nvme.latest(tmp_path) == newest
    assert [c.kind for c in dcp_nvme.checkpoints(tmp_path)] == ["dcp", "nvme", "nvme"]
    assert [c.name for c in checkpoints(tmp_path, kinds=("nvme",))] == ["step_900", "step_1000"]


def test_lightning_and_megatron_names(tmp_path, whole):
    _commit(tmp_path, "epoch=0-step=10", whole=whole)
    _commit(tmp_path, "epoch=1-step=20", whole=whole)
    assert latest(tmp_path).name == "epoch=1-step=20"
    mega = tmp_path / "mega"
    mega.mkdir()
    a = _commit(mega, "iter_0000100", whole=whole)
    _commit(mega, "iter_0000200", whole=whole)
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
    with pytest.raises(CheckpointNotFoundError, match=f"run directory {tmp_path / 'nope'} does not exist: create it"):
        latest(tmp_path / "nope")  # a typo must not start training from scratch
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointNotFoundError, match="is not a directory: create it .* or fix the path"):
        latest(tmp_path / "file")
    assert latest(tmp_path) is None  # there, and empty: a fresh start
    with pytest.raises(ValueError, match="unknown checkpoint kind"):
        checkpoints(tmp_path, kinds=("zarr",))


def test_latest_is_a_checkpoint_our_reader_loads(tmp_path, whole):
    ours = _commit(tmp_path, "step_10", whole=whole)
    stock = _commit(tmp_path, "step_20", marker=".metadata")  # newer, but DCP's stock layout
    assert latest(tmp_path) == ours
    assert latest(tmp_path, kinds=("nvme", "dcp")) == stock
    assert [(c.name, c.kind) for c in checkpoints(tmp_path)] == [("step_10", "nvme"), ("step_20", "dcp")]
    assert latest(tmp_path / "step_20") is None


def _save_steps(run: Path, steps) -> None:
    for step in steps:
        dcp.save({"w": torch.full((4,), float(step))}, storage_writer=NVMeWriter(run / f"step_{step}"), no_dist=True)


def test_latest_passes_over_what_cannot_load_and_says_why(tmp_path, monkeypatch):
    """A committed checkpoint whose rank file is gone, whose data file is short or whose manifest
    was edited is skipped with one warning naming the step and the reason (what `dcp-nvme list`
    says of it), from stats, the manifests and tables alone; the resume then loads the newest
    whole one."""
    run = tmp_path / "run"
    _save_steps(run, (1, 2, 3, 4))
    for rank_file in (run / "step_4").glob("rank_*"):
        rank_file.unlink()
    (short,) = (run / "step_3").glob("rank_*")
    os.truncate(short, short.stat().st_size - 1)
    edited = run / "step_2" / "manifest.json"
    edited.write_text(edited.read_text().replace('"world_size": 1', '"world_size": 2'))
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.path.basename(path)) or real_open(path, *a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = latest(run)
    monkeypatch.undo()
    assert found == run / "step_1"
    assert {name.split(".")[0] for name in opened} <= {"manifest", "index", "blocks"}  # no data file was read
    said = [str(w.message) for w in caught]
    assert len(said) == 3, said
    assert "step_4 (step 4) is committed but cannot load" in said[0] and "rank_00000." in said[0] \
        and "is missing" in said[0]
    assert "step_3 (step 3)" in said[1] and "bytes, the manifest says" in said[1]
    assert "step_2 (step 2)" in said[2] and "fails its own checksum" in said[2]
    states = {e.name: (e.state, e.reason) for e in list_checkpoints(run)}
    assert states["step_4"][0] == states["step_3"][0] == "damaged" and states["step_4"][1] in said[0]
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=NVMeReader(found), no_dist=True)
    assert torch.equal(loaded["w"], torch.full((4,), 1.0))
    for rank_file in (run / "step_1").glob("rank_*"):
        rank_file.unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest(run) is None  # nothing here loads: a fresh start, and each step said why
    assert len(caught) == 4 and "step_1 (step 1) is committed but cannot load" in str(caught[-1].message)


def test_latest_takes_a_whole_compressed_mirror(tmp_path):
    """A compressed mirror's files are .dcz: their decoded sizes are what is checked."""
    from dcp_nvme.tiers import DrainOptions, drain

    _save_steps(tmp_path / "run", (5,))
    mirror = tmp_path / "mirror"
    drain(str(tmp_path / "run" / "step_5"), str(mirror / "step_5"),
          options=DrainOptions(retries=0, compress="bytegroup"))
    assert [p.suffix for p in (mirror / "step_5").glob("rank_*")] == [".dcz"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest(mirror) == mirror / "step_5"


def _node_disks(root: Path, nodes: int) -> list[Path]:
    """Each node's run directory, as node-local disks hold it: steps 1 and 2 everywhere."""
    shared = root / "saved"
    _save_steps(shared, (1, 2))
    runs = [root / f"node{n}" / "run" for n in range(nodes)]
    for run in runs:
        shutil.copytree(shared, run)
    return runs


def _agree(rank, world, runs, expected, warned):
    os.environ["GROUP_RANK"] = str(rank)  # one node per rank, each with its own disk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = latest(runs[rank], agree=True)
    assert got == (None if expected is None else Path(runs[rank]) / expected), (rank, got)
    said = " ".join(str(w.message) for w in caught)
    assert all(word in said for word in warned[rank]), (rank, said)
    if got is not None:  # every rank loads the same step
        out = {"w": torch.zeros(4)}
        dcp.load(out, storage_reader=NVMeReader(got))
        assert torch.equal(out["w"], torch.full((4,), float(expected.removeprefix("step_"))))


def test_latest_agreed_never_mixes_steps(tmp_path):
    """Node-local disks that disagree on the newest step (a commit killed between the nodes'
    renames, a copy damaged on one node): with ``agree=True`` every rank gets one step."""
    from dcp_nvme_harness.dist_utils import run_ranks

    from dcp_nvme.format.container import temp_name
    from dcp_nvme.format.manifest import read_manifest_doc
    from dcp_nvme.storage.local_dir import LocalStore

    # node 1 voted for step_2 and was killed before its rename: it is rolled forward
    runs = _node_disks(tmp_path / "forward", 2)
    step2 = runs[1] / "step_2"
    key = read_manifest_doc(LocalStore(step2), str(step2)).save_key
    os.rename(step2 / "manifest.json", step2 / temp_name("manifest.json", key))
    assert latest(runs[1]).name == "step_1"  # alone, node 1 would take step 1
    run_ranks(2, _agree, [str(r) for r in runs], "step_2", [[], []])
    assert (step2 / "manifest.json").exists()

    # node 1 never got step_2 (killed before its vote): both take step_1, node 0 says why
    runs = _node_disks(tmp_path / "lacking", 2)
    shutil.rmtree(runs[1] / "step_2")
    run_ranks(2, _agree, [str(r) for r in runs], "step_1", [["step_2", "node(s) 1", "step_1"], []])

    # node 0's copy of step_2 is damaged: both take step_1, named with the reason
    runs = _node_disks(tmp_path / "damaged", 2)
    for rank_file in (runs[0] / "step_2").glob("rank_*"):
        rank_file.unlink()
    run_ranks(2, _agree, [str(r) for r in runs], "step_1", [[], ["node(s) 0", "node 0:"]])


@pytest.mark.parametrize("table", ["index", "blocks"])
def test_latest_passes_over_a_step_whose_table_list_calls_corrupt(tmp_path, table):
    """One byte of a table changed, its size kept: ``dcp-nvme list`` calls the step corrupt, and
    latest() passes over it with the same reason (it used to return it)."""
    import json

    run = tmp_path / "run"
    _save_steps(run, (1, 2))
    name = json.loads((run / "step_2" / "manifest.json").read_text())[table]["name"]
    with open(run / "step_2" / name, "r+b") as handle:
        handle.seek(50)
        byte = handle.read(1)
        handle.seek(50)
        handle.write(bytes([byte[0] ^ 0x40]))
    states = {e.name: (e.state, e.reason) for e in list_checkpoints(run)}
    assert states["step_2"][0] == "corrupt" and "does not match manifest.json" in states["step_2"][1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest(run) == run / "step_1"
    assert len(caught) == 1 and states["step_2"][1] in str(caught[0].message), caught


def _agree_walk(rank, world, runs, missing):
    """``latest(agree=True)`` checks each rank's steps from the newest down only as far as it
    must: one step when the newest is whole everywhere; a run directory missing on every node
    raises on every rank."""
    from dcp_nvme.storage import intact

    os.environ["GROUP_RANK"] = str(rank)
    checked = []
    real = intact.read_manifest_doc  # once per step checked
    intact.read_manifest_doc = lambda store, where: checked.append(Path(where).name) or real(store, where)
    try:
        assert latest(runs[rank], agree=True) == Path(runs[rank]) / "step_40"
        assert checked == ["step_40"], checked
        checked.clear()
        for rank_file in (Path(runs[0]) / "step_40").glob("rank_*"):  # node 0's copy is damaged
            if rank == 0:
                rank_file.unlink()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert latest(runs[rank], agree=True) == Path(runs[rank]) / "step_39"
        assert checked == ["step_40", "step_39"], checked
        assert "step_40 is not loadable on node(s) 0" in " ".join(str(w.message) for w in caught) or rank, caught
    finally:
        intact.read_manifest_doc = real
    with pytest.raises(CheckpointNotFoundError, match=f"run directory {missing} does not exist"):
        latest(missing, agree=True)


@pytest.mark.slow
def test_latest_agreed_checks_from_the_newest_down_and_stops(tmp_path):
    from dcp_nvme_harness.dist_utils import run_ranks

    shared = tmp_path / "saved"
    _save_steps(shared, (1,))
    for step in range(2, 41):  # 40 whole steps (copies: the walk is what is measured)
        shutil.copytree(shared / "step_1", shared / f"step_{step}")
    runs = [tmp_path / f"node{n}" / "run" for n in range(2)]
    for run in runs:
        shutil.copytree(shared, run)
    run_ranks(2, _agree_walk, [str(r) for r in runs], str(tmp_path / "nope"))
