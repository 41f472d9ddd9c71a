"""Running the ``dcp-nvme`` CLI as a user does: ``python -m dcp_nvme ...`` in subprocesses,
started together so each pays its own interpreter (and torch) start at the same time."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dcp_nvme_harness.warm import warm_python

REPO = Path(__file__).resolve().parents[2]  # the checkout (the harness is installed editable)
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_all(*runs: tuple[list[str], dict], flags: Sequence[str] = (),
            timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Several ``python [flags] -m dcp_nvme ARGV`` at once, each with ``ENV`` plus its own env
    (a value of None removes that variable). Without ``flags`` they are forked from the warm
    server (``warm.py``: torch already imported); interpreter flags (``-X importtime``, for what a
    command imports) need a fresh interpreter each."""
    envs = [{k: v for k, v in {**ENV, **env}.items() if v is not None} for _, env in runs]
    if not flags:
        with ThreadPoolExecutor(len(runs)) as pool:
            done = pool.map(lambda i: warm_python().run(["-m", "dcp_nvme", *runs[i][0]], cwd=REPO, env=envs[i],
                                                        timeout=timeout), range(len(runs)))
            return [subprocess.CompletedProcess(argv, d.returncode, d.stdout, d.stderr) for (argv, _), d in zip(runs, done)]
    procs = [subprocess.Popen([sys.executable, *flags, "-m", "dcp_nvme", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
             for (argv, _), env in zip(runs, envs)]
    out = []
    for (argv, _), proc in zip(runs, procs):
        stdout, stderr = proc.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr))
    return out


def run_many(*argvs: list[str], flags: Sequence[str] = (), timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``run_all`` with the same environment for every run."""
    return run_all(*[(argv, {}) for argv in argvs], flags=flags, timeout=timeout)
