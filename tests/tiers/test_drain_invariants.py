"""The drain's invariants: a mirror is committed (and reported ``mirrored``) only once every file
on the target is confirmed; crashes (real processes, SIGKILL at exact points through the drain
hook), a resume with another part size, a target that lost or mangled what the journal says it
holds, a target that is the source, an overwrite racing the drain, broken siblings. Every
checkpoint reported mirrored here is loaded from the mirror and compared bit for bit."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness import drain_child
from dcp_nvme_harness.s3_fixtures import *  # noqa: F403  (fixtures s3_server, s3_bucket, s3_fs)
from test_tiers import FAST, assert_same, data_size, load, make_state, opts, part_puts, save

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.cli import main as cli_main
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.pieces import Piece, plan_pieces
from dcp_nvme.tiers import (
    FAILED,
    LOCAL,
    MIRRORED,
    UNCOMMITTED,
    Drainer,
    DrainError,
    DrainOptions,
    drain,
    drain_state,
)
from dcp_nvme.tiers.drainer import set_drain_hook
from dcp_nvme.tiers.transfer import (
    STEP,
    IncompleteOnTarget,
    check_coverage,
    classify,
    matching_pieces,
    overlap,
    piece_entry,
)

MiB = 1 << 20
CHILD = drain_child.__file__  # run as a script


def key_of(local: str) -> str:
    return json.loads(Path(local, MANIFEST).read_text())["save_key"]


def journal(local: str) -> dict:
    return json.loads(Path(local, ".drain.json").read_text())


def data_name(local: str) -> str:
    return f"rank_00000.{key_of(local)}.safetensors"


class Fault(Exception):
    """Injected by a drain hook: the drain stops exactly there (retries=0)."""


def fail_at(point: str, nth: int = 1, action=None):
    """A drain hook raising Fault (after ``action``) the nth time ``point`` is reached."""
    seen = [0]

    def hook(at: str, info: dict) -> None:
        if at == point:
            seen[0] += 1
            if seen[0] == nth:
                if action is not None:
                    action(info)
                raise Fault(f"injected at {point} #{nth}")

    return hook


@pytest.fixture
def hook():
    """Install a drain hook for one test; always removed afterwards."""
    installed = []

    def install(h):
        installed.append(set_drain_hook(h))

    yield install
    set_drain_hook(None)


def mirrored_and_equal(local: str, target: str, sd: dict, storage_options=None) -> None:
    """The promise of ``mirrored``: every file complete on the target, loadable bit for bit."""
    state = drain_state(local)
    assert state.state == MIRRORED, str(state)
    reader = NVMeReader(target, storage_options=storage_options) if storage_options else NVMeReader(target)
    assert_same(load(reader, sd), sd)


# --------------------------------------------------------------------------- pure


def test_journal_claims_count_only_for_the_same_byte_ranges():
    old = plan_pieces(size=4096 + 6 * MiB, data_start=4096, checksum_block=256 << 10, part_size=MiB)
    new = plan_pieces(size=4096 + 6 * MiB, data_start=4096, checksum_block=256 << 10, part_size=3 * MiB)
    journaled = {str(p.index): piece_entry(p, f"t{p.index}") for p in old[:2]}
    assert matching_pieces(journaled, old) == {0: "t0", 1: "t1"}
    assert matching_pieces(journaled, new) == {}  # same piece numbers, other bytes: claims nothing
    assert matching_pieces({"0": "etag-from-an-old-journal"}, old) == {}  # no range: claims nothing
    check_coverage(old, 4096 + 6 * MiB, "f")
    with pytest.raises(IncompleteOnTarget, match="cover"):
        check_coverage(old[:-1], 4096 + 6 * MiB, "f")
    with pytest.raises(IncompleteOnTarget, match="uncovered"):
        check_coverage([old[0], Piece(1, old[1].offset + 1, old[1].length)], 4096 + 6 * MiB, "f")


def test_overlap_and_classify_name_the_problem():
    assert "is the checkpoint itself" in overlap("/r/step_1", "/r/step_1/")
    assert "inside the checkpoint" in overlap("/r/step_1", "/r/step_1/mirror")
    assert "inside the target" in overlap("/r/step_1", "/r")
    assert overlap("/r/step_1", "/r/step_10") is None and overlap("/r/step_1", "/m/step_1") is None
    exc = OSError(errno.ENOSPC, "No space left on device")
    setattr(exc, STEP, "writing /m/index.ab.parquet")
    assert classify(exc) == "quota exceeded / no space: writing /m/index.ab.parquet: [Errno 28] No space left on device"


# --------------------------------------------------------------------------- crash + resume, real processes


def run_child(local: str, target: str, part_size: str, point: str, nth: int, storage_options=None) -> None:
    args = [sys.executable, CHILD, local, target, part_size, point, str(nth)]
    if storage_options is not None:
        args.append(json.dumps(storage_options))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == -9, f"the drain was not killed at {point} #{nth}: rc={proc.returncode}\n{proc.stderr}"


@pytest.mark.slow  # one subprocess importing torch per case
@pytest.mark.parametrize("point, nth", [("piece-sent", 3), ("piece-journaled", 3), ("file-finished", 1),
                                        ("before-commit", 1)])
def test_local_drain_killed_then_resumed_with_another_part_size(tmp_path, capsys, point, nth):
    sd = make_state(21)  # 6.4 MB: seven 1 MiB pieces
    local = save(tmp_path / "run" / "step_21", sd)
    mirror = str(tmp_path / "pfs" / "step_21")
    run_child(local, mirror, "1MiB", point, nth)
    state = drain_state(local)
    assert state.state == "draining" and state.interrupted
    assert not os.path.exists(os.path.join(mirror, MANIFEST))  # nothing looks committed
    entry = journal(local)["files"][data_name(local)]
    entry_bytes = sum(p["length"] for p in entry["pieces"].values())  # journaled before the kill
    if point in ("file-finished", "before-commit"):
        entry_bytes = data_size(local)  # complete on the target, confirmed by reading it back
    if point in ("piece-sent", "piece-journaled"):
        assert entry["part_size"] == MiB and all({"offset", "length", "tag"} <= set(p) for p in entry["pieces"].values())
        assert len(entry["pieces"]) == (nth if point == "piece-journaled" else nth - 1)

    # temporaries of older, killed drains: removed by the next commit
    Path(mirror).mkdir(parents=True, exist_ok=True)
    Path(mirror, ".rank_00000.deadbeef.safetensors.drain-partial").write_bytes(b"x")
    Path(mirror, f".{MANIFEST}.drain-tmp-999999").write_bytes(b"x")
    assert drain_state(local).state != MIRRORED  # so retention keeps it
    save(tmp_path / "run" / "step_99", make_state(99, floats=1000))  # a newer checkpoint
    total, size, name = data_size(local), os.path.getsize(os.path.join(local, data_name(local))), data_name(local)
    # the CLI default part size (64 MiB) differs from the 1 MiB the killed run planned with; with
    # --keep-last 1 the local copy goes, but only once the mirror is confirmed
    assert cli_main(["drain", local, "--keep-last", "1", "--json"]) == 0
    assert not os.path.exists(local)
    assert os.path.getsize(os.path.join(mirror, name)) == size
    assert not [n for n in os.listdir(mirror) if n.startswith(".")]  # no partial or temp file left
    assert_same(load(NVMeReader(mirror), sd), sd)
    # the resume sent exactly what the killed run had not journaled (confirmed pieces are not resent)
    assert json.loads(capsys.readouterr().out)["bytes_sent"] == total - entry_bytes


@pytest.mark.slow
@pytest.mark.parametrize("point", ["piece-journaled", "file-finished"])
def test_s3_drain_killed_then_resumed_with_another_part_size(tmp_path, s3_server, s3_bucket, s3_fs, point):
    sd = make_state(22, floats=3_000_000)  # 12 MB: three 5 MiB parts, two 6 MiB parts
    local = save(tmp_path / "step_22", sd)
    url = f"s3://{s3_bucket}/run/step_22"
    run_child(local, url, "5MiB", point, 1, opts(s3_server))
    assert drain_state(local).interrupted
    assert not s3_fs.exists(f"{s3_bucket}/run/step_22/{MANIFEST}")
    start = len(s3_server.proxy.log)
    assert cli_main(["drain", local, "--part-size", "6MiB", "--storage-options", json.dumps(opts(s3_server)),
                     "--json"]) == 0
    resent = part_puts(s3_server, start)
    # the unfinished upload keeps its 5 MiB plan: only the 2 parts never sent go; a completed one none
    assert len(resent) == (2 if point == "piece-journaled" else 0)
    if point == "file-finished":  # confirmed by its multipart ETag = md5 of the local pieces' md5s
        assert not [e for e in s3_server.proxy.log[start:] if e[0] == "GET" and data_name(local) in e[1]]
    assert s3_fs.size(f"{s3_bucket}/run/step_22/{data_name(local)}") == data_size(local)
    mirrored_and_equal(local, url, sd, opts(s3_server))


# --------------------------------------------------------------------------- the target lost what the journal says


@pytest.mark.parametrize("damage", ["emptied", "mangled"])
def test_emptied_or_mangled_partial_file_is_resent_not_already_there(tmp_path, hook, damage):
    sd = make_state(23)
    local = save(tmp_path / "step_23", sd)
    mirror = tmp_path / "pfs" / "step_23"
    options = DrainOptions(**{**FAST, "part_size": MiB, "max_transfers": 1})
    partial = mirror / f".{data_name(local)}.drain-partial"

    hook(fail_at("piece-journaled", 4))
    with pytest.raises(DrainError, match="injected at piece-journaled"):
        drain(local, str(mirror), options=options)
    hook(None)
    assert drain_state(local).state == FAILED and len(journal(local)["files"][data_name(local)]["pieces"]) == 4
    if damage == "emptied":  # the target lost every byte the journal says it has
        partial.write_bytes(b"")
        confirmed = 0
    else:
        data = bytearray(partial.read_bytes())
        data[4096 + MiB + 5] ^= 0xFF  # the second piece is now wrong on the target
        partial.write_bytes(bytes(data[: 4096 + 4 * MiB - 10]))  # and the fourth is cut short
        confirmed = 4096 + MiB + MiB  # pieces 0 and 2 still read back right
    result = drain(local, str(mirror), options=options)
    assert result.bytes_skipped == confirmed
    assert result.bytes_sent == data_size(local) - confirmed
    mirrored_and_equal(local, str(mirror), sd)


def test_s3_object_emptied_after_upload_is_resent(tmp_path, seaweed, seaweed_bucket, seaweed_fs, hook):
    sd = make_state(24)
    local = save(tmp_path / "step_24", sd)
    url = f"s3://{seaweed_bucket}/step_24"
    obj = f"{seaweed_bucket}/step_24/{data_name(local)}"
    hook(fail_at("file-finished"))
    with pytest.raises(DrainError, match="injected"):
        drain(local, url, filesystem=seaweed_fs, options=DrainOptions(**FAST))
    hook(None)
    assert seaweed_fs.size(obj) == data_size(local)
    seaweed_fs.pipe_file(obj, b"")  # emptied behind the drain's back
    result = drain(local, url, filesystem=seaweed_fs, options=DrainOptions(**FAST))
    assert result.bytes_sent == data_size(local) and result.bytes_skipped == 0
    mirrored_and_equal(local, url, sd, opts(seaweed))


def test_s3_upload_aborted_behind_the_journal_is_resent(tmp_path, seaweed, seaweed_bucket, seaweed_fs, hook):
    sd = make_state(25)
    local = save(tmp_path / "step_25", sd)
    url = f"s3://{seaweed_bucket}/step_25"
    options = DrainOptions(**{**FAST, "max_transfers": 1})
    hook(fail_at("piece-journaled", 1))
    with pytest.raises(DrainError):
        drain(local, url, filesystem=seaweed_fs, options=options)
    hook(None)
    upload = journal(local)["files"][data_name(local)]["upload_id"]
    seaweed_fs.call_s3("abort_multipart_upload", Bucket=seaweed_bucket, Key=f"step_25/{data_name(local)}", UploadId=upload)
    result = drain(local, url, filesystem=seaweed_fs, options=options)
    assert result.bytes_sent == data_size(local) and result.bytes_skipped == 0
    mirrored_and_equal(local, url, sd, opts(seaweed))


def test_second_drain_of_the_same_checkpoint_fails_fast(tmp_path, hook):
    sd = make_state(35)
    local = save(tmp_path / "step_35", sd)
    mirror = str(tmp_path / "pfs" / "step_35")
    refused = []

    def second_drain(at: str, info: dict) -> None:
        if at == "piece-journaled" and not refused:
            with pytest.raises(DrainError, match="another drain of .* is running \\(holder: pid") as info:
                drain(local, str(tmp_path / "elsewhere"), options=DrainOptions(**FAST))
            refused.append(info.value)

    hook(second_drain)
    drain(local, mirror, options=DrainOptions(**{**FAST, "part_size": MiB, "max_transfers": 1}))
    hook(None)
    assert refused and f"pid {os.getpid()}" in str(refused[0]) and mirror in str(refused[0])
    assert drain_state(local).target == mirror  # the refused drain did not touch the journal
    mirrored_and_equal(local, mirror, sd)
    drain(local, mirror, options=DrainOptions(**FAST))  # the lock went with the first drain


def test_old_or_garbage_journal_confirms_nothing(tmp_path):
    sd = make_state(36, floats=300_000)
    local = save(tmp_path / "step_36", sd)
    mirror = str(tmp_path / "pfs" / "step_36")
    first = drain(local, mirror, options=DrainOptions(**FAST))
    # a journal of an older dcp_nvme (piece numbers, no ranges) saying mirrored is not believed...
    old = {"target": mirror, "save_key": key_of(local), "state": "mirrored",
           "files": {data_name(local): {"done": True, "pieces": {"0": ""}}}}
    Path(local, ".drain.json").write_text(json.dumps(old))
    state = drain_state(local)
    assert state.state == LOCAL and "older dcp_nvme" in state.cause
    # ...a drain confirms the mirror by reading it back, resending nothing
    again = drain(local, mirror, options=DrainOptions(**FAST))
    assert again.bytes_sent == 0 and again.bytes_skipped == first.bytes_sent
    mirrored_and_equal(local, mirror, sd)
    # a hostile journal: wrong types everywhere, on a fresh target; it claims nothing, breaks nothing
    other = str(tmp_path / "pfs2" / "step_36")
    garbage = {"version": 2, "target": other, "save_key": key_of(local), "state": "draining", "pid": "x",
               "bytes_sent": "lots",
               "files": {data_name(local): {"pieces": {"0": 5, "1": {"offset": "x"}}, "upload_id": [1],
                                            "part_size": "big"}, "x": None}}
    Path(local, ".drain.json").write_text(json.dumps(garbage))
    assert cli_main(["status", local]) == 0
    result = drain(local, other, options=DrainOptions(**FAST))
    assert result.bytes_sent == data_size(local)
    mirrored_and_equal(local, other, sd)


# --------------------------------------------------------------------------- target == source


def test_drain_onto_itself_or_overlapping_is_refused(tmp_path):
    sd = make_state(26, floats=1000)
    local = save(tmp_path / "run" / "step_26", sd)
    os.symlink(local, tmp_path / "alias")
    before = sorted(os.listdir(local))
    for target in (local, local + "/", f"file://{local}", str(tmp_path / "alias"), local + "/mirror",
                   str(tmp_path / "run"), str(tmp_path)):
        with pytest.raises(DrainError, match="refused: .*(itself|inside)"):
            drain(local, target, options=DrainOptions(**FAST))
    assert cli_main(["drain", local, "--to", local, "--keep-last", "1"]) == 1
    assert sorted(os.listdir(local)) == before  # not even a journal or lock written
    assert drain_state(local).state == LOCAL
    assert_same(load(NVMeReader(local), sd), sd)


def test_export_onto_or_into_the_checkpoint_is_refused(tmp_path, capsys):
    sd = make_state(27, floats=1000)
    local = save(tmp_path / "step_27", sd)
    before = sorted(os.listdir(local))
    for out in (local, os.path.join(local, "hf"), str(tmp_path)):
        assert cli_main(["export", local, "--to", "hf", out, "--overwrite", "--no-progress"]) == 1
        assert "refusing to export" in capsys.readouterr().err
    assert sorted(os.listdir(local)) == before
    assert_same(load(NVMeReader(local), sd), sd)


# --------------------------------------------------------------------------- overwrite racing the drain


def overwrite(local: str, sd: dict):
    def act(info: dict) -> None:
        dcp.save(sd, storage_writer=NVMeWriter(local, overwrite=True), no_dist=True)
    return act


@pytest.mark.parametrize("point", ["piece-journaled", "before-commit"])
def test_overwrite_racing_a_local_drain_fails_it_and_commits_nothing(tmp_path, hook, point):
    old, new = make_state(28), make_state(29)
    local = save(tmp_path / "step_28", old)
    old_key = key_of(local)
    mirror = tmp_path / "pfs" / "step_28"
    seen = [0]

    def race(at: str, info: dict) -> None:
        if at == point:
            seen[0] += 1
            if seen[0] == 1:
                overwrite(local, new)(info)

    hook(race)
    with pytest.raises(DrainError, match="source changed: .*overwritten during the drain") as info:
        drain(local, str(mirror), options=DrainOptions(**{**FAST, "part_size": MiB, "max_transfers": 1}))
    hook(None)
    assert old_key in info.value.cause and key_of(local) in info.value.cause
    assert not (mirror / MANIFEST).exists() and os.listdir(mirror) == []  # no data, partial or temp file
    assert drain_state(local).state == LOCAL  # the new save was never drained
    assert_same(load(NVMeReader(local), new), new)
    drain(local, str(mirror), options=DrainOptions(**FAST))
    mirrored_and_equal(local, str(mirror), new)


def test_overwrite_racing_an_s3_drain_aborts_its_upload(tmp_path, seaweed, seaweed_bucket, seaweed_fs, hook):
    old, new = make_state(30), make_state(31)
    local = save(tmp_path / "step_30", old)
    url = f"s3://{seaweed_bucket}/step_30"
    seen = [0]

    def race(at: str, info: dict) -> None:
        if at == "piece-journaled":
            seen[0] += 1
            if seen[0] == 1:
                overwrite(local, new)(info)

    hook(race)
    with pytest.raises(DrainError, match="source changed"):
        drain(local, url, filesystem=seaweed_fs, options=DrainOptions(**{**FAST, "max_transfers": 1}))
    hook(None)
    assert seaweed_fs.call_s3("list_multipart_uploads", Bucket=seaweed_bucket).get("Uploads", []) == []
    seaweed_fs.invalidate_cache()
    assert not seaweed_fs.exists(f"{seaweed_bucket}/step_30/{MANIFEST}")
    drain(local, url, filesystem=seaweed_fs, options=DrainOptions(**FAST))
    mirrored_and_equal(local, url, new, opts(seaweed))


# --------------------------------------------------------------------------- failures name file + operation


def test_s3_part_failure_names_the_piece_and_object(tmp_path, s3_server, s3_bucket, s3_fs):
    local = save(tmp_path / "step_32", make_state(32))
    url = f"s3://{s3_bucket}/step_32"
    with s3_server.proxy.fault("error", status=500, methods=["PUT"], path_regex="partNumber"), \
            pytest.raises(DrainError) as info:
        drain(local, url, filesystem=s3_fs, options=DrainOptions(**{**FAST, "max_transfers": 1}))
    assert f"sending piece 0 (bytes 0-{4096 + 5 * MiB}) of {url}/{data_name(local)}" in info.value.cause
    assert "sending piece 0" in drain_state(local).cause


def test_enospc_writing_a_table_names_it_and_leaves_no_temp(tmp_path, monkeypatch):
    sd = make_state(33, floats=1000)
    local = save(tmp_path / "step_33", sd)
    mirror = tmp_path / "pfs" / "step_33"
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:
        if "drain-tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(DrainError) as info:
        drain(local, str(mirror), options=DrainOptions(**FAST))
    monkeypatch.setattr(os, "fsync", real_fsync)
    index = json.loads(Path(local, MANIFEST).read_text())["index"]["name"]
    assert info.value.cause.startswith(f"quota exceeded / no space: writing {mirror}/{index}")
    assert not [n for n in os.listdir(mirror) if "tmp" in n] and not (mirror / MANIFEST).exists()
    assert drain_state(local).state == FAILED
    drain(local, str(mirror), options=DrainOptions(**FAST))  # space again: resumes, commits
    mirrored_and_equal(local, str(mirror), sd)


# --------------------------------------------------------------------------- broken siblings


def test_broken_sibling_manifest_breaks_neither_status_nor_the_drainer(tmp_path, capsys):
    run = tmp_path / "run"
    for name, text in (("step_1", "null"), ("step_2", "{not json"), ("step_3", '{"save_key": 7}')):
        (run / name).mkdir(parents=True)
        (run / name / MANIFEST).write_text(text)
    sd = make_state(34, floats=1000)
    local = save(run / "step_4", sd)
    drainer = Drainer(DrainOptions(**FAST), keep_last=1)
    try:
        result = drainer.submit(local, str(tmp_path / "pfs" / "step_4")).result(timeout=120)
    finally:
        drainer.close()
    assert result.errors == []
    mirrored_and_equal(local, str(tmp_path / "pfs" / "step_4"), sd)
    assert all((run / n).is_dir() for n in ("step_1", "step_2", "step_3"))  # never removed: not mirrored
    assert drain_state(run / "step_1").state == UNCOMMITTED
    assert cli_main(["status", str(run), "--json"]) == 0
    rows = {os.path.basename(r["path"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows["step_4"]["state"] == MIRRORED
    assert rows["step_1"]["state"] == UNCOMMITTED and "not a dcp_nvme manifest" in rows["step_1"]["cause"]
    assert "unreadable" in rows["step_2"]["cause"]
