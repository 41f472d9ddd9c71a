"""Links planted where a drain creates or rewrites a file: nothing is ever written through one.

A hostile user who can write to a checkpoint (or a mirror) directory plants a symbolic link to a
victim file under a name the drain will create: the lock, the journal's temp file, the scratch
directory of a compressed drain and the coded files in it, the partial and temp files of a
local-directory target. Every one of them is opened by ``storage.local_dir.create_no_follow``
(or made by ``make_private_dir``): the victim is never touched. A link under a name the drain
owns outright (a temp or scratch file) is removed and the file made fresh, so the drain succeeds;
the lock (shared by drains) and the scratch directory (files are created inside it by name) are
refused with a StorageError naming the link. The clean-up after a commit removes below the
checkpoint directory only, never through a link planted there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.hostile_kit import doc_of, files_of, sample_state, save, within

from dcp_nvme import NVMeWriter
from dcp_nvme.errors import DCPNVMeError, StorageError
from dcp_nvme.format.container import RANGES_DIR, REPLICAS_DIR
from dcp_nvme.tiers import MIRRORED, DrainOptions, drain, drain_state

VICTIM = b"precious, not the drain's\n"
FAST = dict(retries=0, backoff=0.01)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save(tmp_path / "run" / "step_1", sample_state())


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "victim"
    path.parent.mkdir()
    path.write_bytes(VICTIM)
    return path


def untouched(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM
    assert sorted(os.listdir(victim.parent)) == ["victim"]


def test_create_no_follow_refuses_a_link_and_replaces_one_only_when_fresh(tmp_path: Path, victim: Path):
    from dcp_nvme.host.files import create_no_follow, make_private_dir

    link = tmp_path / "link"
    os.symlink(victim, link)
    with pytest.raises(StorageError, match=f"{link} is a symbolic link.*refused"):
        create_no_follow(link, os.O_RDWR)
    untouched(victim)
    fd = create_no_follow(link, os.O_WRONLY, fresh=True)
    os.write(fd, b"mine")
    os.close(fd)
    assert not link.is_symlink() and link.read_bytes() == b"mine"
    untouched(victim)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StorageError, match="FIFO"):
        within(10, lambda: create_no_follow(tmp_path / "fifo"))
    os.symlink(victim.parent, tmp_path / "dirlink")
    with pytest.raises(StorageError, match="dirlink is a symbolic link"):
        make_private_dir(tmp_path / "dirlink")
    assert make_private_dir(tmp_path / "real") == str(tmp_path / "real") and (tmp_path / "real").is_dir()
    make_private_dir(tmp_path / "real")  # an existing directory is fine


def test_a_planted_drain_lock_link_is_refused(ckpt: Path, tmp_path: Path, victim: Path):
    os.symlink(victim, ckpt / ".drain.lock")
    with pytest.raises(DCPNVMeError, match=r"\.drain\.lock is a symbolic link.*remove the link"):
        within(30, lambda: drain(ckpt, str(tmp_path / "mirror"), options=DrainOptions(**FAST)))
    untouched(victim)


def test_a_planted_journal_temp_link_is_replaced_not_followed(ckpt: Path, tmp_path: Path, victim: Path):
    os.symlink(victim, ckpt / f"..drain.json.tmp-{os.getpid()}")
    within(30, lambda: drain(ckpt, str(tmp_path / "mirror"), options=DrainOptions(**FAST)))
    untouched(victim)
    assert drain_state(ckpt).state == MIRRORED


def test_planted_links_in_a_local_target_are_replaced_not_followed(ckpt: Path, tmp_path: Path, victim: Path):
    target = tmp_path / "mirror"
    target.mkdir()
    for f in files_of(ckpt):
        os.symlink(victim, target / f".{f.name}.drain-partial")
    os.symlink(victim, target / f".manifest.json.drain-tmp-{os.getpid()}")
    within(30, lambda: drain(ckpt, str(target), options=DrainOptions(**FAST)))
    untouched(victim)
    assert drain_state(ckpt).state == MIRRORED
    assert not [p for p in target.iterdir() if p.is_symlink()]


def test_a_planted_coded_file_link_is_replaced_not_followed(ckpt: Path, tmp_path: Path, victim: Path):
    scratch = ckpt / f".drain-zip.{doc_of(ckpt)['save_key']}"
    scratch.mkdir()
    for f in files_of(ckpt):
        os.symlink(victim, scratch / f"{f.name}.dcz")
    within(60, lambda: drain(ckpt, str(tmp_path / "mirror"), options=DrainOptions(**FAST, compress="bytegroup")))
    untouched(victim)
    assert drain_state(ckpt).state == MIRRORED
    assert [n for n in os.listdir(tmp_path / "mirror") if n.endswith(".dcz")]


def test_a_planted_scratch_directory_link_is_refused(ckpt: Path, tmp_path: Path, victim: Path):
    os.symlink(victim.parent, ckpt / f".drain-zip.{doc_of(ckpt)['save_key']}")
    with pytest.raises(DCPNVMeError, match=r"\.drain-zip\..* is a symbolic link"):
        within(60, lambda: drain(ckpt, str(tmp_path / "mirror"),
                                 options=DrainOptions(**FAST, compress="bytegroup")))
    untouched(victim)


def test_clean_up_after_a_commit_removes_no_file_through_a_link(tmp_path: Path, victim: Path):
    """The clean-up after a commit (other saves' replicas and kept ranges) lists and removes
    below the checkpoint directory only: links planted there to a folder outside and to the
    run's earlier steps go at most as entries, and what they point to stays."""
    run = tmp_path / "run"
    earlier = save(run / "step_1", sample_state())
    before = sorted(os.listdir(earlier))
    (victim.parent / "empty_holder").mkdir()  # an empty holder is a replica to remove
    step = run / "step_2"
    step.mkdir()
    os.symlink(run, step / REPLICAS_DIR)  # the earlier steps look like other saves' replicas
    os.symlink(victim.parent, step / RANGES_DIR)  # every file outside looks like another save's range
    save(step, sample_state())
    assert sorted(os.listdir(earlier)) == before and doc_of(earlier)
    assert victim.read_bytes() == VICTIM and (victim.parent / "empty_holder").is_dir()
    # the links one level further down: a holder and a kept range pointing outside
    for name in (REPLICAS_DIR, RANGES_DIR):
        os.unlink(step / name)
        (step / name).mkdir()
    os.symlink(victim.parent, step / REPLICAS_DIR / "node_b")
    os.symlink(victim, step / RANGES_DIR / "victim")
    dcp.save(sample_state(), storage_writer=NVMeWriter(step, overwrite=True), no_dist=True)
    assert not os.path.lexists(step / REPLICAS_DIR / "node_b") and not os.path.lexists(step / RANGES_DIR / "victim")
    assert victim.read_bytes() == VICTIM and sorted(os.listdir(victim.parent)) == ["empty_holder", "victim"]
    assert sorted(os.listdir(earlier)) == before


def test_remove_below_never_leaves_the_directory(tmp_path: Path, victim: Path):
    from dcp_nvme.host.files import list_below, remove_below, unlink_below

    root = tmp_path / "ckpt"
    (root / "real" / "sub").mkdir(parents=True)
    (root / "real" / "sub" / "f").write_bytes(b"x")
    os.symlink(victim.parent, root / "link")
    assert list_below(root, "link") == [] and not remove_below(root, "link", "victim")
    assert not unlink_below(root, "link", "victim")
    untouched(victim)
    assert remove_below(root, "link") and not os.path.lexists(root / "link")
    untouched(victim)
    assert list_below(root, "real") == ["sub"] and remove_below(root, "real", "sub")
    assert list_below(root, "real") == []
