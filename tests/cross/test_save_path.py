"""What a plain save and load run of ours: few modules, none of the optional systems, no
diagnostics. Traced with ``sys.setprofile`` in a process that has saved once already (a training
run saves again and again; the first save also imports modules on first use)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import dcp_nvme
from dcp_nvme import NVMeReader, NVMeWriter

PACKAGE = os.path.dirname(dcp_nvme.__file__)
MAX_SAVE_MODULES = 18  # save/ by part: items and results, the stager's hand-off, the after-commit work
MAX_LOAD_MODULES = 22  # load/dropin: FileSystemReader's arguments apart from the reader, as the save's
OPTIONAL = ("tiers/", "peers/", "observe/", "bench/", "tune/", "tools/", "integrations/")


def _traced(call) -> dict[str, set[str]]:
    """Our modules (relative paths) whose functions ``call`` runs, with the functions' names."""
    ran: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE) and code.co_name != "<module>":
            ran.setdefault(os.path.relpath(code.co_filename, PACKAGE), set()).add(code.co_name)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return ran


def test_a_plain_save_and_load_run_few_modules_and_none_of_the_optional_systems(tmp_path: Path):
    state = {"w": torch.arange(64.0), "step": torch.tensor(3)}
    dcp.save(state, storage_writer=NVMeWriter(tmp_path / "warm"), no_dist=True)  # first use imports
    saved = _traced(lambda: dcp.save(state, storage_writer=NVMeWriter(tmp_path / "a"), no_dist=True))
    out = {"w": torch.zeros(64), "step": torch.tensor(0)}
    loaded = _traced(lambda: dcp.load(out, storage_reader=NVMeReader(tmp_path / "a"), no_dist=True))
    assert torch.equal(out["w"], state["w"]) and out["step"].item() == 3
    for ran, limit in ((saved, MAX_SAVE_MODULES), (loaded, MAX_LOAD_MODULES)):
        optional = sorted(m for m in ran if m.startswith(OPTIONAL))
        assert not optional, f"a plain save or load ran optional systems: {optional}"
        assert len(ran) <= limit, f"{len(ran)} modules run, more than {limit}: {sorted(ran)}"
    assert "seams.py" not in saved  # no mirror, no replicas, no diagnostics: not even a lookup
