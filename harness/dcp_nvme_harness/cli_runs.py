"""Running the ``dcp-nvme`` CLI as a user does: ``python -m dcp_nvme ...`` in subprocesses,
started together so each pays its own interpreter (and torch) start at the same time."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout (the harness is installed editable)
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run_all(*runs: tuple[list[str], dict], flags: Sequence[str] = (),
            timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Several ``python [flags] -m dcp_nvme ARGV`` at once, each with ``ENV`` plus its own env
    (a value of None removes that variable)."""
    procs = [subprocess.Popen([sys.executable, *flags, "-m", "dcp_nvme", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={k: v for k, v in {**ENV, **env}.items() if v is not None})
             for argv, env in runs]
    done = []
    for (argv, _), proc in zip(runs, procs):
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return done


def run_many(*argvs: list[str], flags: Sequence[str] = (), timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``run_all`` with the same environment for every run."""
    return run_all(*[(argv, {}) for argv in argvs], flags=flags, timeout=timeout)
