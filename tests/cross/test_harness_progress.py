"""The suite's progress plugin (harness/dcp_nvme_harness/progress.py) in a pytest run of its own:
the time of each phase and the slowest files, slowest first, at the end."""

from __future__ import annotations

import re
import subprocess
import sys


def test_the_summary_names_each_phase_and_the_slowest_files_first(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the suite's addopts
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_a():\n    time.sleep(0.6)\n")
    (tmp_path / "test_quick.py").write_text("def test_b():\n    pass\n\ndef test_c():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "dcp_nvme_harness.progress", "-p", "no:randomly",
                           "-p", "no:cacheprovider", "-q", "test_quick.py", "test_slow.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "unit tests: 3/3 tests (3 passed)" in out, out
    listed = out.split("the 2 slowest files (their tests' seconds)", 1)[1].splitlines()[1:3]
    assert [line.split()[-1] for line in listed] == ["test_slow.py", "test_quick.py"], out
    assert re.fullmatch(r"\s*0:0[0-9] test_slow.py", listed[0]), listed
