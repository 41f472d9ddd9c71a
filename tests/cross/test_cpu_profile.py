"""The harness's CPU profile plugin counts the CPU of a test's child processes too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from dcp_nvme_harness import cpu_profile

pytestmark = pytest.mark.slow  # a pytest of its own

_TESTS = textwrap.dedent('''
    import subprocess, sys

    def test_burns_in_a_child():
        # about a second of CPU in another process, none in this one
        subprocess.run([sys.executable, "-c",
                        "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"],
                       check=True)

    def test_idle():
        pass
''')


def test_a_tests_cpu_includes_its_children(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    (tmp_path / "test_probe.py").write_text(_TESTS)
    out = tmp_path / "cpu"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "dcp_nvme_harness.cpu_profile", f"--cpu-profile={out}", "test_probe.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    if "no cgroup to count in" in done.stderr:
        pytest.skip(done.stderr.strip())
    (written,) = out.glob("cpu_*.jsonl")  # named by the xdist worker this suite runs in, else "main"
    records = {r["id"]: r for r in map(json.loads, written.read_text().splitlines())}
    assert records["test_probe.py::test_burns_in_a_child"]["cpu"] >= 0.9, records
    assert records["test_probe.py::test_idle"]["cpu"] < 0.5, records
    assert cpu_profile.per_file(out)["test_probe.py"] >= 0.9
