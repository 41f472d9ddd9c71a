"""``dcp-nvme`` as a user meets it: fast help, a version, one line per error, quiet closed pipes."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.cli_runs import ENV, REPO, run_all

import dcp_nvme
from dcp_nvme import NVMeWriter
from dcp_nvme.cli import BROKEN_PIPE_STATUS, COMMANDS, build_parser


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("WARNING ")]
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dcp-nvme {proc.args[0]}: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


# --------------------------------------------------------------------------- polish


def test_help_and_version_do_not_import_torch():
    for argv in (["--help"], ["--version"], []):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dcp_nvme", *argv], capture_output=True,
                              text=True, env=ENV, cwd=REPO, timeout=60)
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert "dcp_nvme.cli" in imported
        assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, argv
        assert not {"pyarrow", "fsspec", "numpy"} & imported, argv
        if argv == ["--version"]:
            assert proc.returncode == 0 and proc.stdout.strip() == f"dcp-nvme {dcp_nvme.__version__}"
        elif argv == ["--help"]:
            assert proc.returncode == 0
            assert all(name in proc.stdout for name in COMMANDS)
        else:
            assert proc.returncode == 2 and "COMMAND" in proc.stdout  # no command: the help, status 2


def test_tool_commands_help_does_not_import_torch():
    script = textwrap.dedent("""
        import sys
        from dcp_nvme.cli import main
        try:
            main([sys.argv[1], "--help"])
        except SystemExit as done:
            assert done.code == 0
        print("dcp_nvme.tools.commands" in sys.modules, "torch" in sys.modules, file=sys.stderr)
    """)
    for command in ("list", "inspect", "verify", "export"):
        proc = subprocess.run([sys.executable, "-c", script, command], capture_output=True, text=True,
                              env=ENV, cwd=REPO, timeout=60)
        assert proc.stderr.split() == ["True", "False"], (command, proc.stderr)
        assert proc.stdout.startswith(f"usage: dcp-nvme {command}")


def test_python_dash_m_dcp_nvme_runs_a_command(tmp_path: Path):
    dcp.save({"w": torch.ones(3)}, storage_writer=NVMeWriter(tmp_path / "run" / "step_5", direct_io=False),
             no_dist=True)
    listed, = run_all((["list", str(tmp_path / "run")], {}))
    assert listed.returncode == 0 and "step_5" in listed.stdout and listed.stderr == ""


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_every_command_and_option_has_help_and_no_internal_references():
    parser = build_parser()
    sub = _subparsers(parser)
    registered = {action.dest: action.help for action in sub._choices_actions}
    assert set(sub.choices) == set(COMMANDS)
    for name, (_, text) in COMMANDS.items():
        assert registered[name] == text, f"the command list's help of {name} differs from its module's"
    internal = re.compile(r"dcp_nvme\.[a-z]|``|register\(|\.py\b|_[a-z]+\(\)")
    texts = {"dcp-nvme": parser.format_help()}
    for name, command in sub.choices.items():
        texts[name] = command.format_help()
        for action in command._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings or action.dest)
    for name, text in texts.items():
        assert not internal.search(text), (name, internal.search(text).group(0))


# --------------------------------------------------------------------------- errors: one line


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    for step in range(3):
        dcp.save({"w": torch.randn(20_000), "step": step},
                 storage_writer=NVMeWriter(tmp_path / "run" / f"step_{step}", direct_io=False), no_dist=True)
    return tmp_path / "run"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow  # other processes
def test_errors_end_in_one_line_with_a_non_zero_status(run_dir: Path, tmp_path: Path):
    bad_data = run_dir / "step_1"
    data = next(bad_data.glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad_index = run_dir / "step_2"
    index = next(bad_index.glob("index.*.parquet"))
    index.write_bytes(index.read_bytes()[:100])
    no_aws = {k: None for k in os.environ if k.startswith("AWS_")}
    no_credentials = {**no_aws, "AWS_EC2_METADATA_DISABLED": "true", "HOME": str(tmp_path),
                      "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    unreachable = {**no_credentials, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}", "AWS_MAX_ATTEMPTS": "1"}
    cases = [
        (["export", str(bad_data), "--to", "hf", str(tmp_path / "o1"), "--no-progress"], {}, ("checksum mismatch",)),
        (["export", str(bad_index), "--to", "hf", str(tmp_path / "o2"), "--no-progress"], {}, ("index",)),
        (["verify", "s3://no-bucket/ckpt", "--no-progress"], no_credentials, ("credentials",)),
        (["verify", "s3://no-bucket/ckpt", "--no-progress"], unreachable, ("Could not connect",)),
        (["inspect", "s3://no-bucket/ckpt"], no_credentials, ("credentials",)),
        (["drain", str(run_dir / "step_0"), "--to", "nosuchproto://x"], {}, ("nosuchproto",)),
        (["drain", str(run_dir / "step_0"), "--to", str(tmp_path / "m"), "--storage-options", "{no"], {},
         ("--storage-options",)),
        (["list", str(tmp_path / "missing")], {}, ("does not exist",)),
        (["export", str(run_dir / "step_0"), "--to", "hf", str(tmp_path / "o3"), "--dtype", "fp7"], {}, ("fp7",)),
    ]
    runs = run_all(*[(argv, env) for argv, env, _ in cases])
    for proc, (_, _, words) in zip(runs, cases):
        assert_one_line_error(proc, *words)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "m").exists()


def test_debug_shows_the_traceback(tmp_path: Path):
    proc, = run_all((["--debug", "list", str(tmp_path / "missing")], {}))
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "does not exist" in proc.stderr


def test_a_closed_pipe_ends_quietly(run_dir: Path):
    """``dcp-nvme list --json | head``: the reader went away; no BrokenPipe noise, status 141."""
    proc = subprocess.Popen([sys.executable, "-m", "dcp_nvme", "list", "--json", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=REPO)
    proc.stdout.close()  # as `head` exits before reading
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == BROKEN_PIPE_STATUS
    assert err == ""
    shell = subprocess.run(f"'{sys.executable}' -m dcp_nvme list --json '{run_dir}' | head -c 10",
                           shell=True, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert shell.stdout.startswith("[") and shell.stderr == ""


def test_one_line_of_dcp_and_library_errors():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from dcp_nvme.cli import one_line

    try:
        raise ValueError("Invalid checkpoint metadata for step")
    except ValueError as exc:
        cause = _wrap_exception(exc)
    wrapped = CheckpointException("read", {1: cause, 0: _wrap_exception(KeyError("x"))})
    assert one_line(wrapped) == "rank 0: KeyError: 'x'"
    assert one_line(CheckpointException("read", {1: cause})) == \
        "rank 1: Invalid checkpoint metadata for step"
    assert one_line(KeyError("phases")) == "KeyError: 'phases'"
    assert one_line(FileNotFoundError(2, "No such file or directory", "/x")) == \
        "[Errno 2] No such file or directory: '/x'"
    assert one_line(RuntimeError("first\nsecond")) == "RuntimeError: first"
