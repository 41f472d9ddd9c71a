"""The read-only commands start without torch, and every command speaks one ``--json`` shape,
takes ``--debug`` before or after the command, and fails in one line. The CLI runs as a
subprocess, as a user runs it; the runs overlap, and without torch each takes about a second."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.cli_runs import run_many

from dcp_nvme import NVMeWriter
from dcp_nvme.cli import main as cli_main


def imported(stderr: str) -> set[str]:
    """Module names from ``python -X importtime`` lines (``import time: self | cumulative | name``)."""
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", stderr, re.M)}


def other_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("import time:")]


@pytest.mark.slow  # other processes
def test_read_only_commands_import_no_torch_and_share_one_json_shape(tmp_path):
    run = tmp_path / "run"
    ckpt = run / "step_10"
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 10, "cfg": {"lr": 0.1, "name": "x"}}
    dcp.save(state, storage_writer=NVMeWriter(ckpt), no_dist=True)
    argvs = [["list", str(run), "--json"], ["status", str(ckpt), "--json"], ["status", str(run), "--json"],
             ["inspect", str(ckpt), "--json"], ["verify", str(ckpt), "--json"],
             ["unlock", str(ckpt), "--json"]]
    procs = run_many(*argvs, flags=["-X", "importtime"])
    for proc in procs:
        assert proc.returncode == 0, (proc.args, other_lines(proc.stderr))
        modules = imported(proc.stderr)
        assert "dcp_nvme" in modules, proc.args  # the measurement saw our imports at all
        torch_modules = sorted(m for m in modules if m == "torch" or m.startswith("torch."))
        assert not torch_modules, f"{proc.args[0]} imported {torch_modules[:5]}"
        assert not other_lines(proc.stderr), (proc.args, other_lines(proc.stderr))
    listed, one, many, inspected, verified, unlocked = (json.loads(p.stdout) for p in procs)
    # one checkpoint: one object keyed "checkpoint"; many: a list of such objects
    assert [row["checkpoint"] for row in listed] == [str(ckpt)] and listed[0]["state"] == "committed"
    assert isinstance(one, dict) and one["checkpoint"] == str(ckpt) and one["state"] == "local"
    assert [row["checkpoint"] for row in many] == [str(ckpt)]
    assert inspected["checkpoint"] == str(ckpt) and {t["fqn"] for t in inspected["tensors"]} == {"w"}
    assert {o["fqn"] for o in inspected["objects"]} == {"step", "cfg.lr", "cfg.name"}
    assert verified["checkpoint"] == str(ckpt) and verified["ok"] is True and not verified["problems"]
    assert unlocked == {"checkpoint": str(ckpt), "removed": False, "reason": "not locked", "holder": None}


@pytest.mark.slow  # other processes
def test_debug_goes_before_or_after_the_command_and_failures_are_one_line(tmp_path):
    missing = str(tmp_path / "nothing")
    after, before, plain, usage, unknown = run_many(
        ["verify", missing, "--debug"], ["--debug", "verify", missing], ["verify", missing], ["verify"],
        ["inspect", missing, "--colour"])
    for proc in (after, before):
        assert proc.returncode != 0 and "Traceback" in proc.stderr, proc.stderr
    for proc in (plain, usage, unknown):
        lines = other_lines(proc.stderr)
        assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert plain.stderr.startswith("dcp-nvme verify: ") and missing in plain.stderr
    assert usage.returncode == 2 and "the following arguments are required: checkpoint" in usage.stderr
    assert "unrecognized arguments: --colour" in unknown.stderr and "--help" in unknown.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal_and_for_large_work(monkeypatch):
    from dcp_nvme import humanize

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a SLURM log: never a bar
    assert humanize.progress_bar(1 << 40, True, "verify").disable
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert not humanize.progress_bar(1 << 40, True, "verify").disable
    assert humanize.progress_bar(1 << 20, True, "verify").disable  # done before a bar says anything
    assert humanize.progress_bar(1 << 40, False, "verify").disable  # --no-progress, --json


def test_drain_convert_verify_and_export_draw_bars_on_a_terminal_and_sizes_for_people(tmp_path, monkeypatch, capsys):
    from dcp_nvme import humanize

    ckpt = tmp_path / "step_1"
    dcp.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, storage_writer=NVMeWriter(ckpt), no_dist=True)
    monkeypatch.setattr(humanize, "PROGRESS_MIN_BYTES", 0)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli_main(["drain", str(ckpt), "--to", str(tmp_path / "mirror")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"mirrored to .*: \d+(\.\d)? KiB sent, 0 B already there", out), out
    assert "drain" in terminal.getvalue()  # the bar drew (tqdm ends it with \r on a terminal)
    assert cli_main(["drain", str(ckpt), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"] == str(ckpt) and doc["bytes_skipped"] > 0
    for argv, name in ((["convert", str(ckpt), str(tmp_path / "stock"), "--to", "dcp"], "convert"),
                       (["verify", str(ckpt)], "verify"),
                       (["export", str(ckpt), "--to", "hf", str(tmp_path / "hf")], "export")):
        terminal.seek(0)
        terminal.truncate()
        assert cli_main(argv) == 0
        assert name in terminal.getvalue(), argv
    terminal.seek(0)
    terminal.truncate()
    assert cli_main(["verify", str(ckpt), "--no-progress"]) == 0
    assert terminal.getvalue() == ""
    out = capsys.readouterr().out
    assert re.search(r"converted nvme .* \d+(\.\d)? KiB in", out), out


def test_a_plain_value_item_is_judged_without_torch_only_in_the_shape_torch_writes():
    import pickle
    import zipfile

    from dcp_nvme.load.objects import _plain, safe_load

    for value in (5, {"lr": 0.1}, [1, "x", None], b"", io.BytesIO(b"xy")):
        out = io.BytesIO()
        torch.save(value, out)
        assert _plain(out.getvalue()) and safe_load(out.getvalue()) is not None
    for value in (torch.zeros(2), {"t": torch.ones(1)}, __import__("collections").OrderedDict(a=1)):
        out = io.BytesIO()
        torch.save(value, out)
        assert not _plain(out.getvalue())  # tensors and classes: torch's weights-only unpickler judges
    stripped = io.BytesIO()
    with zipfile.ZipFile(stripped, "w") as archive:  # no version record: torch.load refuses it
        archive.writestr("archive/data.pkl", pickle.dumps(5, protocol=2))
    assert not _plain(stripped.getvalue())


def test_export_writes_a_config_json_when_given_one_and_says_how_otherwise(tmp_path, capsys):
    ckpt = tmp_path / "step_1"
    dcp.save({"model": {"w": torch.arange(16, dtype=torch.float32)}}, storage_writer=NVMeWriter(ckpt), no_dist=True)
    assert cli_main(["export", str(ckpt), "--to", "hf", str(tmp_path / "bare"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no config.json written" in out and "pass --config FILE, the model's config.json" in out, out
    assert not (tmp_path / "bare" / "config.json").exists()
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 16}\n')
    assert cli_main(["export", str(ckpt), "--to", "hf", str(tmp_path / "hf"), "--config", str(config),
                     "--no-progress"]) == 0
    assert "no config.json" not in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").read_bytes() == config.read_bytes()
    config.write_text("[1, 2]")  # refused before anything is written, naming the file
    assert cli_main(["export", str(ckpt), "--to", "hf", str(tmp_path / "o2"), "--config", str(config)]) != 0
    assert f"--config {config} holds list, not a JSON object" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
