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

    for name in ("drain", "replicate", "restore", "coded_engine", "decoded_store"):
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


def _accepts(target, protocol) -> list[str]:
    """What of the seam's signature (its Protocol's ``__call__``) the target cannot take."""
    import inspect

    wanted = list(inspect.signature(protocol.__call__).parameters.values())[1:]  # less self
    have = inspect.signature(target).parameters
    wrong = []
    for at, p in enumerate(wanted):
        got = have.get(p.name)
        if got is None:
            if not any(q.kind is q.VAR_KEYWORD for q in have.values()):
                wrong.append(f"no parameter {p.name}")
        elif p.kind is p.POSITIONAL_OR_KEYWORD and list(have).index(p.name) != at:
            wrong.append(f"{p.name} is not parameter {at}")
        elif p.kind is p.KEYWORD_ONLY and got.kind not in (got.KEYWORD_ONLY, got.POSITIONAL_OR_KEYWORD):
            wrong.append(f"{p.name} is not a keyword")
        elif p.default is not p.empty and got.default is got.empty:
            wrong.append(f"{p.name} has no default")
    named = {p.name for p in wanted}
    wrong += [f"{q.name} is required but the core never passes it" for q in have.values()
              if q.name not in named and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return wrong


@pytest.mark.slow  # imports every target: peers.exchange's torch.distributed takes seconds
def test_every_seam_has_a_typed_signature_and_every_plugged_target_takes_it():
    import typing

    from dcp_nvme import seams
    from dcp_nvme.observe import enable_save_diagnostics

    declared = typing.get_type_hints(seams)
    found = {name: value for name, value in vars(seams).items() if isinstance(value, Seam)}
    assert set(found) == {"drain", "replicate", "replication_group", "restore", "coded_engine", "decoded_store",
                          "object_store", "mirror_restored", "save_diagnostics"}
    enable_save_diagnostics()
    try:
        for name, seam in found.items():
            (protocol,) = typing.get_args(declared.get(name))  # Seam[ItsProtocol]
            assert typing.get_origin(declared[name]) is Seam and "__call__" in vars(protocol), name
            assert _accepts(seam.function(), protocol) == [], name
    finally:
        enable_save_diagnostics(False)
    # the check itself: a target that lacks a parameter, or wants one the core never passes
    assert _accepts(lambda local, target: None, seams.Drain) == ["no parameter storage_options",
                                                                 "no parameter compress"]
    assert _accepts(lambda ranks, extra: None, seams.ReplicationGroup) == [
        "extra is required but the core never passes it"]
