"""The optional systems plug into the core through dcp_nvme.seams: a plain save and load never
import them, a seam left unplugged says so, and a seam plugged by name imports its target at its
first call only."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from dcp_nvme.errors import MissingDependencyError
from dcp_nvme.seams import Seam

PLAIN = textwrap.dedent("""
    import json, sys, tempfile, torch, torch.distributed.checkpoint as dcp
    from dcp_nvme import NVMeReader, NVMeWriter
    path = tempfile.mkdtemp() + "/step_1"
    state = {"w": torch.arange(8.0), "step": 7}
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    out = {"w": torch.zeros(8), "step": 0}
    dcp.load(out, storage_reader=NVMeReader(path), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7
    print(json.dumps(sorted(m for m in sys.modules if m.startswith("dcp_nvme."))))
""")


def test_a_plain_save_and_load_import_none_of_the_optional_systems():
    done = subprocess.run([sys.executable, "-c", PLAIN], capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    optional = [m for m in loaded if m.split(".")[1] in ("tiers", "peers", "observe", "tools", "tune", "bench",
                                                          "integrations", "cli")]
    assert not optional, f"a plain save and load imported {optional}"
    assert "dcp_nvme.save.writer" in loaded and "dcp_nvme.load.reader" in loaded  # it did run them


def test_an_unplugged_seam_names_itself_and_a_plugged_one_imports_its_target_on_first_call():
    seam = Seam("example", "what it is for")
    assert not seam.plugged
    with pytest.raises(MissingDependencyError, match="example seam"):
        seam(1)
    seam.plug("textwrap:dedent")
    assert seam.plugged and seam("  x\n  y") == "x\ny"
    seam.plug(lambda value: value * 2)
    assert seam(4) == 8
    seam.plug(None)
    assert not seam.plugged
    with pytest.raises(ValueError, match="module:function"):
        seam.plug("textwrap.dedent")


def test_the_package_plugs_every_seam_the_core_calls_and_each_target_exists():
    import importlib

    from dcp_nvme import seams

    for name in ("drain", "replicate", "restore_sources", "coded_engine", "decoded_store"):
        seam = getattr(seams, name)
        assert seam.plugged, name
        assert callable(seam.function()), name
    assert not seams.save_diagnostics.plugged  # only when asked
    from dcp_nvme.observe import enable_save_diagnostics

    enable_save_diagnostics()
    try:
        assert seams.save_diagnostics.function() is importlib.import_module("dcp_nvme.observe.drive_health").SaveWatch
    finally:
        enable_save_diagnostics(False)
    assert not seams.save_diagnostics.plugged
