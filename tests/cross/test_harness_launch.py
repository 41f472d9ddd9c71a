"""The harness's fork launcher (dcp_nvme_harness.launch) runs a script as a fresh ``python
SCRIPT`` would under torchrun: ``__main__``, its argv and directory, its threads joined and its
atexit handlers run, its exit status and uncaught traceback; the rank variables set."""

import subprocess
import sys
import textwrap

import pytest
from dcp_nvme_harness.ports import reserve_port

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    import helper_beside_the_script  # the script's directory is first on sys.path
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    def at_exit():
        with open(os.path.join(out, f"atexit.{rank}"), "w") as f:
            f.write("ran")
    atexit.register(at_exit)
    def late():
        time.sleep(0.3)
        with open(os.path.join(out, f"thread.{rank}"), "w") as f:
            f.write("joined")
    threading.Thread(target=late).start()  # not a daemon: exit waits for it
    print("RECORD", json.dumps({"rank": rank, "world": os.environ["WORLD_SIZE"], "name": __name__,
                                "argv": sys.argv[1:], "local": os.environ["LOCAL_RANK"]}), flush=True)
    if rank == 1:
        sys.exit(3)
    if rank == 2:
        raise ValueError("rank 2 raised this")
    if rank == 3:
        sys.exit("rank 3 exits with this message")
""")


def _launch(tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (tmp_path / "helper_beside_the_script.py").write_text("")
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "dcp_nvme_harness.launch", "--nnodes", "1", "--nproc-per-node", "4",
            "--master-addr", "127.0.0.1", "--master-port", str(reserve_port()), "--max-restarts", "0",
            # ranks 1-3 fail within milliseconds of each other: a poll between their exits would
            # report the first and stop the others (exit -15); one poll after all of them sees all
            "--monitor-interval", "2",
            str(script), str(out), "an argument"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_fork_launcher_runs_a_script_as_python_would(tmp_path):
    proc = _launch(tmp_path)
    records = sorted(line for line in proc.stdout.splitlines() if line.startswith("RECORD"))
    assert len(records) == 4, proc.stdout + proc.stderr
    assert all('"name": "__main__"' in r and f'"argv": ["{tmp_path / "out"}", "an argument"]' in r
               for r in records), records
    for rank in range(4):
        assert (tmp_path / "out" / f"atexit.{rank}").read_text() == "ran", proc.stderr
        assert (tmp_path / "out" / f"thread.{rank}").read_text() == "joined", proc.stderr
    assert proc.returncode != 0  # ranks 1-3 failed, each as the interpreter reports it:
    assert "exitcode  : 3" in proc.stderr  # the agent's report of rank 1
    assert "ValueError: rank 2 raised this" in proc.stderr  # the traceback
    assert "rank 3 exits with this message" in proc.stderr


def test_a_warm_python_runs_code_as_a_fresh_interpreter_would(tmp_path):
    """dcp_nvme_harness.warm: argv, stdin, the working directory and environment, atexit handlers,
    exit statuses and tracebacks as ``python -c``/``-m``/a script give them; a timeout kills it."""
    from dcp_nvme_harness.warm import WarmPython

    python = WarmPython(preload=("json",))
    try:
        code = ("import atexit, os, sys; atexit.register(lambda: print('atexit ran'))\n"
                "print(sys.argv, os.getcwd(), os.environ['ONLY_HERE'], sys.stdin.read(), __name__)\n"
                "sys.exit(int(sys.argv[1]))")
        done = python.run(["-c", code, "7"], cwd=tmp_path, env={"ONLY_HERE": "yes"}, input="fed", timeout=60)
        assert done.returncode == 7, done.stderr
        assert done.stdout == f"['-c', '7'] {tmp_path} yes fed __main__\natexit ran\n"
        (tmp_path / "script.py").write_text("import sibling\nraise ValueError(sibling.WORD)\n")
        (tmp_path / "sibling.py").write_text("WORD = 'from beside the script'\n")
        raised = python.run([tmp_path / "script.py"], timeout=60)
        assert raised.returncode == 1 and "ValueError: from beside the script" in raised.stderr
        module = python.run(["-m", "json.tool"], input='{"a": 1}', timeout=60)
        assert module.returncode == 0 and module.stdout == '{\n    "a": 1\n}\n', module.stderr
        with pytest.raises(subprocess.TimeoutExpired):
            python.run(["-c", "import time; time.sleep(60)"], timeout=1)
        assert python.run(["-c", "print('still serving')"], timeout=60).stdout == "still serving\n"
    finally:
        python.close()
