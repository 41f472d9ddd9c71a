"""Save, check and move PyTorch distributed checkpoints written by dcp_nvme.

``dcp-nvme COMMAND``: each command lives in a module with a ``register(subparsers)`` that adds
its sub-parser, whose ``func`` takes the parsed arguments and returns an exit status. The
commands are listed in ``COMMANDS`` so that ``--help`` and ``--version`` import nothing heavy:
a command's module (and torch) is imported only when that command runs. Any error ends in one
line on stderr and a non-zero status; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from dcp_nvme import __version__
from dcp_nvme.errors import DCPNVMeError

DESCRIPTION = "Save, check and move PyTorch distributed checkpoints written by dcp_nvme."

COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("dcp_nvme.tools.commands", "checkpoints under a run directory, newest first"),
    "inspect": ("dcp_nvme.tools.commands", "tensors, shapes, dtypes and sizes of a checkpoint (no data read)"),
    "verify": ("dcp_nvme.tools.commands", "read every byte and check every checksum; exit 0 only if intact"),
    "export": ("dcp_nvme.tools.commands", "consolidate into a Hugging Face safetensors model"),
    "convert": ("dcp_nvme.tools.commands", "to and from DCP's stock layout and torch.save files"),
    "drain": ("dcp_nvme.tiers", "copy a committed checkpoint to its mirror (resumes an interrupted drain)"),
    "status": ("dcp_nvme.tools.commands", "drain state of a checkpoint, or of every checkpoint in a run directory"),
    "tune": ("dcp_nvme.tune.command", "sweep queue depth x block size on a directory; save the best for the plugin"),
    "bench": ("dcp_nvme.bench", "measure dcp_nvme against the device limit, DCP FileSystemWriter, "
                                "torch.save, safetensors"),
    "unlock": ("dcp_nvme.tools.commands", "remove a checkpoint directory's save lock left by a dead save"),
}
"""Command name -> (module defining it, one-line help shown by ``dcp-nvme --help``)."""

BROKEN_PIPE_STATUS = 141
"""128 + SIGPIPE: what a shell reports for a tool whose reader went away (``... | head``)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other failure (``--help`` has the rest)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


GLOBAL_FLAGS = ("--debug", "-v", "--verbose")
"""Options of ``dcp-nvme`` itself, accepted before or after the command."""


def _global_flags_first(argv: list[str]) -> list[str]:
    """``dcp-nvme verify X --debug`` as ``dcp-nvme --debug verify X`` (nothing after ``--`` moves)."""
    end = argv.index("--") if "--" in argv else len(argv)
    flags = [a for a in argv[:end] if a in GLOBAL_FLAGS]
    return flags + [a for a in argv[:end] if a not in GLOBAL_FLAGS] + argv[end:]


def build_parser(modules: set[str] | None = None) -> argparse.ArgumentParser:
    """The full parser, with the commands of ``modules`` (default: all) really registered and
    the others as placeholders that only show in the command list."""
    parser = _Parser(prog="dcp-nvme", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dcp-nvme {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    parser.add_argument("--debug", action="store_true", help="log at DEBUG and show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = {module for module, _ in COMMANDS.values()} if modules is None else modules
    for name in dict.fromkeys(module for module, _ in COMMANDS.values()):
        if name in wanted:
            importlib.import_module(name).register(sub)
    for command, (_, text) in COMMANDS.items():
        if command not in sub.choices:
            sub.add_parser(command, help=text, add_help=False)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command word: the first argument that is not an option (global options take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def one_line(exc: BaseException) -> str:
    """An error as one line: its first non-empty line, with the type where the text alone is unclear."""
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: (error, trace)}
    if isinstance(failures, dict) and failures:
        rank, (cause, _) = min(failures.items())
        return f"rank {rank}: {one_line(cause)}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if isinstance(exc, (OSError, ValueError, DCPNVMeError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _silence_stdout() -> None:
    """After the reader of our stdout went away: point stdout at /dev/null so that the
    interpreter's final flush does not report the broken pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = _global_flags_first(list(sys.argv[1:] if argv is None else argv))
    debug, command = "--debug" in argv, _command_in(argv)
    try:
        modules = {COMMANDS[command][0]} if command in COMMANDS else set()
        parser = build_parser(modules)
        args = parser.parse_args(argv)
        level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt:
        print("dcp-nvme: interrupted", file=sys.stderr)
        return 130
    except BaseException as exc:  # noqa: BLE001 - every error ends in one line (DCP's are BaseException)
        if isinstance(exc, SystemExit):
            raise
        if debug:
            raise
        where = f"dcp-nvme {command}" if command in COMMANDS else "dcp-nvme"
        print(f"{where}: {one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
