"""One save at a time per checkpoint directory (docs/design.md, "One save at a time"): real processes racing,
a save of the same process, a SIGKILLed holder, a holder on another host. Deterministic: the
holder is paused inside its write by an injected hook until the test lets it go."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from dcp_nvme_harness.warm import warm_python
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import CheckpointLockedError, NVMeReader, NVMeWriter
from dcp_nvme.cli import main as cli_main
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.save.dropin import POINTER
from dcp_nvme.storage import save_lock as savelock
from dcp_nvme.storage.save_lock import LOCK_NAME, STALE_AFTER_S, LockHolder

WORDS = 9 << 18


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # 9 MiB: more than a request, so the engine writes it (its header write is where the tests
    # pause or fail a save; engines.small writes a container of one request in one call)
    return {"w": torch.randn(WORDS, generator=g), "b": torch.arange(100) + seed}


def load(path) -> dict:
    out = {"w": torch.zeros(WORDS), "b": torch.zeros(100, dtype=torch.int64)}
    dcp.load(out, storage_reader=NVMeReader(path), no_dist=True)
    return out


def assert_bitwise(a: dict, b: dict) -> None:
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


def causes(exc: BaseException) -> list[BaseException]:
    if not isinstance(exc, CheckpointException):
        return [exc]
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    """Wait for a condition another process makes true (a handshake, not a timed guess)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# A saver that announces (file `ready`) when it reaches a point of its save, holding the lock,
# and waits there for the file `go`; `go` never appearing keeps it there until it is killed.
# Points: "data" (writing its rank file), "manifest" (tables written, manifest not yet),
# "cleanup" (committed, files of other saves not yet removed).
PAUSED_SAVER = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed.checkpoint as dcp
    import importlib.util
    spec = importlib.util.spec_from_file_location("save_lock_test", sys.argv[4])
    test_module = importlib.util.module_from_spec(spec); spec.loader.exec_module(test_module); state = test_module.state
    from dcp_nvme import NVMeWriter
    from dcp_nvme.save import after_commit, writer
    from dcp_nvme.engines import host_io as files
    from dcp_nvme.format.container import MANIFEST
    path, handshake, seed, point = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]
    def pause():
        if not os.path.exists(os.path.join(handshake, "ready")):
            open(os.path.join(handshake, "ready"), "w").close()
            while not os.path.exists(os.path.join(handshake, "go")):
                time.sleep(0.01)
    def paused_at(real, when):
        def hooked(*args):
            if when(*args):
                pause()
            return real(*args)
        return hooked
    if point == "data":
        files.pwrite_all = paused_at(files.pwrite_all, lambda *a: True)
    elif point == "manifest":
        writer.write_commit_files = paused_at(writer.write_commit_files, lambda d, files, *a: files[-1][0] == MANIFEST)
    elif point == "cleanup":
        after_commit.remove_other_saves = paused_at(after_commit.remove_other_saves, lambda *a: True)
    dcp.save(state(seed), storage_writer=NVMeWriter(path, overwrite=True), no_dist=True)
    print("saved", flush=True)
""")

PLAIN_SAVER = textwrap.dedent("""
    import os, sys, torch.distributed.checkpoint as dcp
    import importlib.util
    spec = importlib.util.spec_from_file_location("save_lock_test", sys.argv[3])
    test_module = importlib.util.module_from_spec(spec); spec.loader.exec_module(test_module); state = test_module.state
    from dcp_nvme import NVMeWriter
    dcp.save(state(int(sys.argv[2])), storage_writer=NVMeWriter(sys.argv[1], overwrite=True), no_dist=True)
    print("saved", flush=True)
""")

THIS_FILE = os.path.abspath(__file__)  # the savers take ``state`` from this file


def start_paused_saver(path, handshake, seed, point="data") -> subprocess.Popen:
    os.makedirs(handshake, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", PAUSED_SAVER, str(path), str(handshake), str(seed),
                             THIS_FILE, point], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def our_files(path) -> list[str]:
    return sorted(os.listdir(path))


@pytest.mark.slow  # other processes
def test_two_processes_saving_into_one_directory_one_wins(tmp_path):
    path, hs = tmp_path / "ck", tmp_path / "hs"
    first = start_paused_saver(path, hs, 1)
    wait_for(lambda: (hs / "ready").exists() or first.poll() is not None, "the first saver to write")
    assert first.poll() is None, first.stderr.read()
    holder = savelock.read_holder(path)
    assert holder is not None and holder.pid == first.pid
    # a second real process (with overwrite=True, so only the lock can refuse it) fails fast
    second = warm_python().run(["-c", PLAIN_SAVER, path, "2", THIS_FILE], timeout=300)
    assert second.returncode != 0 and "saved" not in second.stdout
    assert "CheckpointLockedError" in second.stderr
    for needed in (str(path), f"pid {first.pid}", f"save key {holder.save_key}", "since ",
                   "another save on this host", "dcp-nvme unlock"):
        assert needed in second.stderr, needed
    (hs / "go").touch()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0 and "saved" in out, err
    assert_bitwise(load(path), state(1))
    names = our_files(path)
    assert LOCK_NAME not in names and not [n for n in names if ".tmp-" in n]
    assert len([n for n in names if n.endswith(".safetensors")]) == 1  # nothing of the loser


def test_same_process_second_save_is_refused(tmp_path, monkeypatch):
    from dcp_nvme.engines import host_io as files

    path = tmp_path / "ck"
    writing, go = threading.Event(), threading.Event()
    real = files.pwrite_all

    def paused(fd, buffer, offset):
        if not writing.is_set():
            writing.set()
            assert go.wait(120)
        real(fd, buffer, offset)

    monkeypatch.setattr(files, "pwrite_all", paused)
    errors = []

    def first_save():
        try:
            dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=first_save)
    thread.start()
    try:
        assert writing.wait(120)
        with pytest.raises(CheckpointException) as info:
            dcp.save(state(2), storage_writer=NVMeWriter(path, overwrite=True), no_dist=True)
        (cause,) = causes(info.value)
        assert isinstance(cause, CheckpointLockedError)
        assert "another save of this same process" in str(cause) and f"pid {os.getpid()}" in str(cause)
        assert str(path) in str(cause)
    finally:
        go.set()
        thread.join(120)
    assert not errors
    assert_bitwise(load(path), state(1))
    dcp.save(state(3), storage_writer=NVMeWriter(path, overwrite=True), no_dist=True)  # released
    assert_bitwise(load(path), state(3))


@pytest.mark.slow  # other processes
@pytest.mark.parametrize("point", ["data", "manifest", "cleanup"])
def test_lock_of_sigkilled_saver_is_stale_and_broken(tmp_path, capsys, point):
    path, hs = tmp_path / "ck", tmp_path / "hs"
    dcp.save(state(0), storage_writer=NVMeWriter(path), no_dist=True)
    earlier = set(os.listdir(path))
    saver = start_paused_saver(path, hs, 1, point)
    wait_for(lambda: (hs / "ready").exists() or saver.poll() is not None, f"the saver to reach {point}")
    assert saver.poll() is None, saver.stderr.read()
    saver.send_signal(signal.SIGKILL)
    saver.wait()
    holder = savelock.read_holder(path)
    assert holder is not None and holder.pid == saver.pid  # the crash left its lock behind
    debris = set(os.listdir(path)) - earlier - {LOCK_NAME, MANIFEST}
    assert any(n.endswith(".safetensors") for n in debris)
    # killed before its commit: the earlier checkpoint is what loads; after: the new one
    assert_bitwise(load(path), state(1 if point == "cleanup" else 0))
    assert savelock.stale_reason(holder) == f"pid {saver.pid} is gone"
    if point == "manifest":  # an operator may remove it by hand: the rule says it is stale
        assert cli_main(["unlock", str(path)]) == 0
        assert f"removed the save lock of host {holder.host}, pid {saver.pid}" in capsys.readouterr().out
        assert not (path / LOCK_NAME).exists()
    dcp.save(state(2), storage_writer=NVMeWriter(path, overwrite=True), no_dist=True)  # breaks it
    assert_bitwise(load(path), state(2))
    names = set(our_files(path))
    assert LOCK_NAME not in names and not debris & names and not (earlier - {MANIFEST, POINTER}) & names


def write_lock(path, holder: LockHolder, age: float = 0.0) -> None:
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, LOCK_NAME)
    with open(lock, "wb") as handle:
        handle.write(holder.to_json())
    stamp = time.time() - age
    os.utime(lock, (stamp, stamp))


def holder_for(pid: int, pid_start, pid_space: str | None = None, host: str | None = None) -> LockHolder:
    return LockHolder(host=host or os.uname().nodename, pid=pid, save_key="cafe0001",
                      since_unix=time.time() - 60, token="t" * 16,
                      pid_space=pid_space or savelock._pid_space(), pid_start=pid_start)


@pytest.mark.slow  # other processes
def test_live_holder_on_this_host_is_respected_and_a_reused_pid_is_not(tmp_path, capsys):
    path = tmp_path / "ck"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        write_lock(path, holder_for(other.pid, savelock._pid_start(other.pid)))
        with pytest.raises(CheckpointException, match=f"pid {other.pid}, save key cafe0001"):
            dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
        assert cli_main(["unlock", str(path)]) == 1  # live: refused without --force
        assert "unlock --force" in capsys.readouterr().err
        assert os.path.exists(path / LOCK_NAME)
        # the same pid with another start time is another process: the holder is gone
        write_lock(path, holder_for(other.pid, savelock._pid_start(other.pid) - 1))
        dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
        assert_bitwise(load(path), state(1))
    finally:
        other.kill()
        other.wait()


def test_lock_of_another_host_is_stale_only_after_its_heartbeat_stops(tmp_path, capsys):
    path = tmp_path / "ck"
    foreign = holder_for(4242, 1, pid_space="node-b|boot|pid:[1]", host="node-b")
    write_lock(path, foreign, age=10)
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
    message = str(causes(info.value)[0])
    assert "a save on another host" in message and "host node-b, pid 4242" in message
    write_lock(path, foreign, age=STALE_AFTER_S + 30)  # no heartbeat for longer than the rule
    dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
    assert_bitwise(load(path), state(1))
    write_lock(path, foreign, age=10)
    assert cli_main(["unlock", "--force", str(path)]) == 0  # the operator knows node-b is dead
    assert "removed the save lock of host node-b, pid 4242" in capsys.readouterr().out
    dcp.save(state(2), storage_writer=NVMeWriter(path, overwrite=True), no_dist=True)
    assert_bitwise(load(path), state(2))


def test_unreadable_lock_is_live_while_young_then_stale(tmp_path):
    path = tmp_path / "ck"
    path.mkdir()
    (path / LOCK_NAME).write_bytes(b"")  # a creator killed between create and write
    with pytest.raises(CheckpointException, match="unreadable"):
        dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
    old = time.time() - STALE_AFTER_S - 30
    os.utime(path / LOCK_NAME, (old, old))
    dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
    assert_bitwise(load(path), state(1))


def test_heartbeat_and_release_by_garbage_collection(tmp_path):
    lock = savelock.acquire(tmp_path, "beef0002")
    lock_file = tmp_path / LOCK_NAME
    old = time.time() - 1000
    os.utime(lock_file, (old, old))
    savelock.beat_all()
    assert time.time() - lock_file.stat().st_mtime < 60
    assert json.loads(lock_file.read_bytes())["save_key"] == "beef0002"
    assert lock.held()
    del lock  # a writer dropped after a save that failed on another rank
    gc.collect()
    assert not lock_file.exists()


# --------------------------------------------------------------------------- two ranks over gloo


def _ranks_lock_and_failure(rank, world, path):
    from dcp_nvme.engines import host_io as files

    sd = {f"r{rank}": torch.full((WORDS,), float(rank + 1))}  # more than a request: the engine writes it
    # 1. a live lock (another host's, fresh) refuses the save on every rank, none hangs
    if rank == 0:
        write_lock(path, holder_for(7, 1, pid_space="node-c|b|n", host="node-c"))
    dist.barrier()
    try:
        dcp.save(sd, storage_writer=NVMeWriter(path))
    except CheckpointException as exc:
        assert "host node-c, pid 7" in str(exc), exc
    else:
        raise AssertionError(f"rank {rank}: the locked save should have failed")
    dist.barrier()
    if rank == 0:
        os.unlink(os.path.join(path, LOCK_NAME))
    # 2. rank 1 fails with ENOSPC: every rank fails; the coordinator never sees finish, so its
    # writer keeps the lock until its next save, which releases it and commits
    real = files.pwrite_all
    if rank == 1:
        def full(fd, buffer, offset):
            raise OSError(28, "No space left on device")
        files.pwrite_all = full
    writer = NVMeWriter(path)
    dist.barrier()
    try:
        dcp.save(sd, storage_writer=writer)
    except CheckpointException as exc:
        assert 1 in exc.failures and "No space left on device" in str(exc)
    else:
        raise AssertionError(f"rank {rank}: the save should have failed")
    files.pwrite_all = real
    dist.barrier()
    if rank == 0:
        assert os.path.exists(os.path.join(path, LOCK_NAME))
    dcp.save(sd, storage_writer=writer)
    dist.barrier()
    if rank == 0:
        out = {"r0": torch.zeros(WORDS), "r1": torch.zeros(WORDS)}
        dcp.load(out, storage_reader=NVMeReader(path), no_dist=True)
        assert torch.equal(out["r0"], torch.full((WORDS,), 1.0))
        assert torch.equal(out["r1"], torch.full((WORDS,), 2.0))
        assert not os.path.exists(os.path.join(path, LOCK_NAME))


@pytest.mark.slow  # other processes
def test_two_ranks_lock_refusal_and_failed_rank_release(tmp_path):
    run_ranks(2, _ranks_lock_and_failure, str(tmp_path / "ck"))


# --------------------------------------------------------------------------- hostile lock files


def _lock_entry(path, kind: str, outside) -> None:
    """Put something that is not a save lock at ``path/.save.lock``: a FIFO, a directory, or a
    link (to a FIFO, /dev/zero, nothing, or a regular file that must survive the unlock)."""
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, LOCK_NAME)
    targets = {"link-to-fifo": os.path.join(outside, "fifo"), "link-to-dev-zero": "/dev/zero",
               "dangling-link": os.path.join(outside, "nothing"), "link-to-file": os.path.join(outside, "file")}
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        os.mkdir(lock)
    else:
        if kind == "link-to-fifo":
            os.mkfifo(targets[kind])
        elif kind == "link-to-file":
            with open(targets[kind], "wb") as handle:
                handle.write(holder_for(1, 1).to_json())
        os.symlink(targets[kind], lock)


HOSTILE_ENTRIES = {"fifo": "a FIFO", "link-to-fifo": "a symbolic link", "link-to-dev-zero": "a symbolic link",
                   "dangling-link": "a symbolic link", "link-to-file": "a symbolic link", "directory": "a directory"}


@pytest.mark.parametrize("kind", list(HOSTILE_ENTRIES))
def test_a_lock_that_is_not_a_regular_file_is_refused_and_unlock_force_removes_only_it(tmp_path, capsys, kind):
    from dcp_nvme_harness.hostile_kit import within

    path, outside = tmp_path / "ck", tmp_path / "outside"
    outside.mkdir()
    _lock_entry(path, kind, outside)
    with pytest.raises(CheckpointException) as info:
        within(30, lambda: dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True))
    (error,) = causes(info.value)
    assert isinstance(error, CheckpointLockedError), repr(error)
    assert HOSTILE_ENTRIES[kind] in str(error) and f"dcp-nvme unlock {path}" in str(error)
    assert "not provably held" in str(error)
    flags = ["--force"] if kind.startswith("link") else []  # no save creates one: a plain unlock will do
    assert within(30, lambda: cli_main(["unlock", *flags, str(path)])) == 0
    assert "removed" in capsys.readouterr().out
    assert not os.path.lexists(path / LOCK_NAME)
    assert sorted(os.listdir(outside)) == {"link-to-fifo": ["fifo"], "link-to-file": ["file"]}.get(kind, [])
    assert os.path.exists("/dev/zero")
    dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True)
    assert_bitwise(load(path), state(1))


MALFORMED_LOCKS = {
    "pid-beyond-pid_t": lambda doc: {**doc, "pid": 2**63},
    "negative-pid": lambda doc: {**doc, "pid": -1},
    "since-beyond-datetime": lambda doc: {**doc, "since_unix": 1e300},
    "infinite-since": lambda doc: {**doc, "since_unix": float("inf")},
    "not-an-object": lambda doc: [doc],
}


@pytest.mark.parametrize("forge", list(MALFORMED_LOCKS))
def test_a_malformed_lock_is_not_provably_held_and_never_crashes(tmp_path, capsys, forge):
    from dcp_nvme_harness.hostile_kit import within

    path = tmp_path / "ck"
    path.mkdir()
    doc = MALFORMED_LOCKS[forge](json.loads(holder_for(os.getpid(), 1).to_json()))
    (path / LOCK_NAME).write_text(json.dumps(doc))
    with pytest.raises(CheckpointException) as info:
        within(30, lambda: dcp.save(state(1), storage_writer=NVMeWriter(path), no_dist=True))
    (error,) = causes(info.value)
    assert isinstance(error, CheckpointLockedError) and "not provably held" in str(error), repr(error)
    assert cli_main(["unlock", str(path)]) == 1  # young: it may be a save creating its lock
    assert "not provably held" in capsys.readouterr().err
    assert cli_main(["unlock", "--force", str(path)]) == 0
    assert not os.path.lexists(path / LOCK_NAME)
    (path / LOCK_NAME).write_text(json.dumps(doc))
    old = time.time() - STALE_AFTER_S - 30
    os.utime(path / LOCK_NAME, (old, old))
    assert cli_main(["unlock", str(path)]) == 0  # old: stale by the rule
    assert not os.path.lexists(path / LOCK_NAME)


@pytest.mark.slow  # other processes
@pytest.mark.parametrize("content", ["deep", "huge"])
def test_an_oversized_or_deep_lock_is_read_bounded(tmp_path, content):
    from dcp_nvme_harness.hostile_kit import peak_rss_mib

    path = tmp_path / "ck"
    path.mkdir()
    with open(path / LOCK_NAME, "wb") as handle:
        if content == "deep":
            handle.write(b"[" * 60_000)  # under the size cap: json's recursion limit stops it
        else:
            handle.truncate(3 << 30)  # a sparse 3 GiB file
    code = ("from dcp_nvme.storage import save_lock\n"
            f"try:\n    save_lock.read_holder({str(path)!r})\nexcept ValueError as exc:\n    print('ERR', exc)\n"
            f"print('UNLOCK', save_lock.unlock({str(path)!r}, force=True))")
    peak, out = peak_rss_mib(code, timeout=60)
    assert "ERR" in out and "does not parse as a save lock" in out and "UNLOCK" in out, out
    assert peak < 1024, peak
    assert not os.path.lexists(path / LOCK_NAME)


@pytest.mark.parametrize("what", ["missing", "a-file"])
def test_unlock_of_a_path_that_is_no_directory_fails_naming_it(tmp_path, capsys, what):
    path = tmp_path / "no-such-dir"
    if what == "a-file":
        path.write_bytes(b"")
    assert cli_main(["unlock", str(path)]) == 1
    assert cli_main(["unlock", "--force", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path} is not a directory" in err and "not locked" not in err
