"""A script that ends right after a save still gets its checkpoint mirrored.

Python stops its thread pools at exit (``concurrent.futures`` refuses new work from then on:
"cannot schedule new futures after interpreter shutdown"), and the drain needs them. The drains
queued or running when the main thread ends are waited for before that; a drain that meets the
refusal anyway fails at once (never retried), says why, and keeps what it sent for a resume;
``wait_for_drains`` is the explicit wait.
"""

from __future__ import annotations

import concurrent.futures.thread
import os
import subprocess
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.warm import warm_python

from dcp_nvme import NVMeWriter
from dcp_nvme.errors import DrainError
from dcp_nvme.tiers import Drainer, DrainOptions, drain, drain_state, wait_for_drains
from dcp_nvme.tiers.drainer import set_drain_hook

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[2]
SLOW_RETRIES = DrainOptions(retries=3, backoff=60.0)  # a retried failure would show

# each ends right after its save returns (the async ones: once it is committed locally)
ENDINGS = {
    "dcp.save": """
        dcp.save(state, storage_writer=NVMeWriter(path, mirror=mirror), no_dist=True)
    """,
    "dcp.async_save+NVMeStager": """
        from dcp_nvme import NVMeStager
        stager = NVMeStager()
        response = dcp.async_save(state, storage_writer=NVMeWriter(path, mirror=mirror), async_stager=stager,
                                  no_dist=True)
        response.upload_completion.result()
    """,
    "NVMeAsyncSaver": """
        from dcp_nvme import NVMeAsyncSaver
        with NVMeAsyncSaver() as saver:
            saver.save(state, storage_writer=NVMeWriter(path, mirror=mirror), no_dist=True)
    """,
    "NVMeAsyncSaver never closed": """
        from dcp_nvme import NVMeAsyncSaver
        saver = NVMeAsyncSaver()  # its queued save runs at exit, and then its drain
        saver.save(state, storage_writer=NVMeWriter(path, mirror=mirror), no_dist=True)
    """,
}


def _run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return warm_python().run(["-c", code, *args], env=env, timeout=timeout)  # as `python -c CODE ARGS`


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_script_that_ends_right_after_its_save_leaves_it_mirrored(tmp_path, ending):
    path, mirror = tmp_path / "step_1", tmp_path / "pfs" / "step_1"
    code = textwrap.dedent("""
        import sys, warnings
        import torch, torch.distributed.checkpoint as dcp
        from dcp_nvme import NVMeWriter
        warnings.filterwarnings("ignore")
        path, mirror = sys.argv[1], sys.argv[2]
        state = {"w": torch.arange(1_000_000, dtype=torch.float32)}
    """) + textwrap.dedent(ENDINGS[ending])
    started = time.monotonic()
    proc = _run(code, str(path), str(mirror))
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cannot schedule new futures" not in proc.stderr and "retrying" not in proc.stderr, proc.stderr[-4000:]
    state = drain_state(path)
    assert state.state == "mirrored", (str(state), proc.stderr[-4000:])
    names = sorted(os.listdir(mirror))
    assert "manifest.json" in names and not [n for n in names if "drain-partial" in n], names
    out = {"w": torch.zeros(1_000_000)}
    from dcp_nvme import NVMeReader

    dcp.load(out, storage_reader=NVMeReader(str(mirror)), no_dist=True)
    assert torch.equal(out["w"], torch.arange(1_000_000, dtype=torch.float32))
    print(f"{ending}: the script ran {took:.1f} s")


def test_the_refusal_of_an_exiting_interpreter_fails_the_drain_at_once(tmp_path, monkeypatch):
    """What a drain still running when the pools stop meets: never retried (the first backoff
    alone is 60 s), the cause says what happened and how to resume, nothing looks committed on
    the mirror, and what reached it stays for the resume."""
    local, mirror = tmp_path / "c", tmp_path / "mirror"
    dcp.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, storage_writer=NVMeWriter(local), no_dist=True)
    sent = []

    def exit_after_the_first_piece(point, info):
        if point == "piece-journaled":
            sent.append(info["piece"])
            monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)  # as Python's exit does

    previous = set_drain_hook(exit_after_the_first_piece)
    started = time.monotonic()
    try:
        with pytest.raises(DrainError) as info:
            drain(local, str(mirror), options=DrainOptions(retries=3, backoff=60.0, part_size=1 << 20,
                                                           max_transfers=1))
    finally:
        set_drain_hook(previous)
        monkeypatch.undo()
    assert time.monotonic() - started < 60
    assert "the process exited before the drain finished" in str(info.value)
    assert "dcp-nvme drain" in str(info.value)
    state = drain_state(local)
    assert state.state == "failed" and state.attempts == 1, str(state)
    assert "interpreter shutdown" in state.cause
    names = os.listdir(mirror)
    assert "manifest.json" not in names and any("drain-partial" in n for n in names), names
    resumed = drain(local, str(mirror))  # the resume confirms what was sent and sends the rest
    assert resumed.bytes_skipped == sum(p.length for p in sent) > 0
    assert drain_state(local).state == "mirrored"


def test_a_drain_submitted_once_the_pools_stopped_fails_without_raising(tmp_path, monkeypatch):
    """A commit that hands its drain over during the exit (after the pools stopped) gets a failed
    Future: the save that submits it must not fail, nor a node commit turn into an abort."""
    local = tmp_path / "c"
    dcp.save({"w": torch.arange(1000, dtype=torch.float32)}, storage_writer=NVMeWriter(local), no_dist=True)
    drainer = Drainer()
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    future = drainer.submit(local, str(tmp_path / "mirror"))
    monkeypatch.undo()
    with pytest.raises(DrainError, match="the process exited before the drain finished"):
        future.result(timeout=10)
    assert drain_state(local).state == "local"  # never drained: `dcp-nvme drain` does it
    assert wait_for_drains(timeout=10)
    drainer.close()


def test_wait_for_drains_waits_for_every_drainer_and_times_out(tmp_path):
    local = tmp_path / "c"
    dcp.save({"w": torch.arange(1000, dtype=torch.float32)}, storage_writer=NVMeWriter(local), no_dist=True)
    release = threading.Event()
    previous = set_drain_hook(lambda point, info: point == "before-commit" and release.wait(60))
    drainer = Drainer()  # not the default one: every drain of the process counts
    try:
        future = drainer.submit(local, str(tmp_path / "mirror"))
        assert wait_for_drains(timeout=0.3) is False and not future.done()
        release.set()
        assert wait_for_drains(timeout=60) is True and future.done()
        assert future.result().save_key and drain_state(local).state == "mirrored"
    finally:
        release.set()
        set_drain_hook(previous)
        drainer.close()


def test_what_the_exit_hook_ends_first_exists():
    """The exit hook looks the saves that may still submit drains up by name (their modules are
    not imported by the drain): a rename must not silently drop one."""
    import importlib

    from dcp_nvme.tiers import background

    for module, name, _ in background._SAVES_FIRST:
        assert callable(getattr(importlib.import_module(module), name)), (module, name)


@pytest.mark.slow
def test_every_node_of_a_node_local_save_drains_when_the_script_ends_right_after_it(cluster, tmp_path):
    """Two simulated nodes with their own disks: the coordinator's drain and node 1's (submitted
    by its node commit, which may still run when the rank's save has returned) both finish
    before the processes end, and the mirror commits."""
    from dcp_nvme_harness.multinode import SCRIPTS

    mirror = tmp_path / "pfs"
    results = cluster.run(SCRIPTS / "save_and_end.py", f"{cluster.mount}/run1/step_1",
                          env={"MIRROR_ROOT": str(mirror)}, timeout=150, check=False)
    records = [rec for r in results for rec in r.records()]
    described = "\n".join(r.describe(tail=3000) for r in results)
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3] and not any(r["error"] for r in records), described
    for node in (0, 1):
        state = drain_state(cluster.node_disk(node) / "run1" / "step_1")
        assert state.state == "mirrored", (node, str(state), described)
    names = os.listdir(mirror / "step_1")
    assert "manifest.json" in names and sum(n.startswith("rank_") for n in names) == 4, names


def test_a_forked_child_does_not_wait_at_exit_for_the_drains_of_its_parent(tmp_path):
    """A process forked while a drain runs (a data-loader worker, a launcher) ends at once: the
    drain runs on the parent's threads, and the parent's exit is the one that waits for it."""
    code = textwrap.dedent("""
        import os, sys, threading, time, warnings
        import torch, torch.distributed.checkpoint as dcp
        from dcp_nvme import NVMeWriter
        from dcp_nvme.tiers import Drainer, drain_state
        from dcp_nvme.tiers.drainer import set_drain_hook
        warnings.filterwarnings("ignore")
        path, mirror = sys.argv[1], sys.argv[2]
        dcp.save({"w": torch.arange(1000)}, storage_writer=NVMeWriter(path), no_dist=True)
        release = threading.Event()
        set_drain_hook(lambda point, info: point == "before-commit" and release.wait(60))
        Drainer().submit(path, mirror)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: threading's exit hooks run in the child too
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
            time.sleep(0.05)
        child_ended = time.monotonic() < deadline
        if not child_ended:
            os.kill(pid, 9)
        release.set()  # the parent ends now: its exit waits for the drain
        print("child ended" if child_ended else "child still waiting after 30 s", flush=True)
    """)
    path, mirror = tmp_path / "c", tmp_path / "mirror"
    proc = _run(code, str(path), str(mirror))
    assert proc.returncode == 0 and "child ended" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert drain_state(path).state == "mirrored"
