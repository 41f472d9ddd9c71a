"""A save that fails on a full disk leaves none of its files once its ranks have exited, even when
they exit right after the failure.

DCP skips ``finish`` when a rank's write fails and tells no writer: the files the other ranks
wrote stay (the coordinator's directory; on each other node, its node writer's commit thread
waits for a round that never comes). They go at interpreter exit at the latest. The saves here
run as a user runs them: one process per rank (torchrun, or its variables set by hand), a
script that catches the failure, prints it and ends.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dcp_nvme_harness.multinode import SCRIPTS
from dcp_nvme_harness.ports import reserve_port
from dcp_nvme_harness.warm import warm_python

from dcp_nvme.format.container import save_key_of, temp_of

REPO = Path(__file__).resolve().parents[2]
SCRIPT = SCRIPTS / "save_and_end.py"
ENOSPC = "No space left on device"


def _leftovers(directory: Path) -> list[str]:
    """Files of a save (data, tables, commit temps) still in ``directory``."""
    if not directory.exists():
        return []
    return sorted(n for n in os.listdir(directory) if save_key_of(n) or temp_of(n))


def _records(stdout: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def test_a_failed_save_leaves_no_files_of_the_ranks_that_wrote_theirs(tmp_path):
    """Two ranks in one directory; rank 1's disk is full. Rank 0 wrote its file; both ranks end
    right after the failure: rank 0's file is gone (it used to stay until the next commit)."""
    path = tmp_path / "step_1"
    port = reserve_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1", "FAIL_RANK": "1"}
    with ThreadPoolExecutor(2) as pool:  # each rank as `python SCRIPT PATH`, both at once
        ranks = list(pool.map(lambda r: warm_python().run([SCRIPT, path], env={**env, "RANK": str(r)}, timeout=120),
                              range(2)))
    records = sorted((rec for proc in ranks for rec in _records(proc.stdout)), key=lambda r: r["rank"])
    said = "\n".join(proc.stderr[-3000:] for proc in ranks)
    assert [r["rank"] for r in records] == [0, 1], said
    assert all(r["error"] and ENOSPC in r["error"] for r in records), records
    assert [p.returncode for p in ranks] == [0, 0], said
    assert not (path / "manifest.json").exists()
    assert _leftovers(path) == [], said


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["a rank's write", "a node's metadata"])
def test_a_failed_node_local_save_leaves_no_files_on_any_node(cluster, failure):
    """Two simulated nodes of two ranks, each with its own disk. Either rank 3 (node 1, not its
    node writer) cannot write its data file, or node 1 cannot write its copy of the metadata
    (its vote says so, the coordinator aborts). Every rank ends right after the failure."""
    path = f"{cluster.mount}/run1/step_1"
    env_per_node = {1: {"FAIL_RANK": "3"} if failure == "a rank's write" else {"FAIL_PREPARE": "1"}}
    results = cluster.run(SCRIPT, path, env_per_node=env_per_node, timeout=150, check=False)
    records = [rec for r in results for rec in r.records()]
    described = "\n".join(r.describe(tail=3000) for r in results)
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], described
    assert all(r["error"] for r in records), records
    assert any(ENOSPC in r["error"] for r in records), records
    for node in (0, 1):
        step = cluster.node_disk(node) / "run1" / "step_1"
        assert not (step / "manifest.json").exists()
        assert _leftovers(step) == [], (node, described)


def test_a_forked_child_leaves_the_files_of_its_parents_save(tmp_path):
    """The clean-up at exit is the process's own: a child forked while its parent coordinates a
    save (one DCP has not finished yet) must not remove that save's files when it exits."""
    code = """
import os, sys
from dcp_nvme.storage import local_dir
directory, key = sys.argv[1], "0123abcd"
os.makedirs(directory)
data = os.path.join(directory, f"rank_00000.{key}.safetensors")
open(data, "wb").close()
local_dir.save_begins(directory, key)  # as the coordinator's prepare_global_plan does
pid = os.fork()
if pid == 0:
    sys.exit(0)
os.waitpid(pid, 0)
print("kept" if os.path.exists(data) else "removed by the child", flush=True)
local_dir.finish_begins(directory, key)  # as its finish does
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = warm_python().run(["-c", code, tmp_path / "ck"], env=env, timeout=120)  # as `python -c CODE DIR`
    assert proc.returncode == 0 and "kept" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert _leftovers(tmp_path / "ck") == ["rank_00000.0123abcd.safetensors"]
