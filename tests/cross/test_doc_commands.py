"""Commands the docs give a user to run outside Python (not executed by test_docs_snippets.py)
carry the options the suite found they need."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_seaweedfs_command_in_docs_tiers_has_the_suites_volume_options():
    """weed's default volume count fills after about 0.5 GB, and every later drain fails with
    ``No writable volumes``: the doc's server gets the suite's ``-volume.max=0``."""
    harness = (ROOT / "harness" / "dcp_nvme_harness" / "seaweed.py").read_text()
    needed = set(re.findall(r'"(-(?:master\.volumeSizeLimitMB|volume\.max)=[0-9]+)"', harness))
    assert needed == {"-master.volumeSizeLimitMB=64", "-volume.max=0"}
    commands = [line.split() for line in (ROOT / "docs" / "tiers.md").read_text().splitlines()
                if line.startswith("weed server")]
    assert commands and all(needed <= set(command) for command in commands), commands
