"""torchrun with forked workers: ``python -m dcp_nvme_harness.launch [torchrun options] SCRIPT ARGS``.

The same argument parser, elastic agent and static rendezvous as ``torchrun`` (its
``config_from_args`` and ``elastic_launch``), but each worker is forked from this process, which
imported torch, DCP and dcp_nvme once, instead of a fresh interpreter importing them again (some
seconds of CPU per rank; on 2 cores most of a simulated cluster's time). The worker runs SCRIPT
as ``python SCRIPT`` would: as ``__main__`` with its directory first on ``sys.path``, its
uncaught exception printed, then ``threading`` and ``atexit`` shut down, and its exit status
that of the script. ``Cluster(launcher="torchrun")`` runs the real ``torchrun`` instead.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import sys
import threading
import traceback

from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args

# what the workers of the multinode scripts import, once: torch._dynamo comes with the first
# DTensor (about a second each), the rest with a save, a load, a restore or a drain
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "dcp_nvme", "dcp_nvme.save.writer",
           "dcp_nvme.load.reader", "dcp_nvme.peers.exchange", "dcp_nvme.tiers", "s3fs")


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


def run_script(script: str, *args: str) -> None:
    """The worker: SCRIPT as ``__main__``; returns only when it exited 0 (else ``os._exit``)."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException:
        traceback.print_exc()
        status = 1
    # what the interpreter does at exit: multiprocessing's children skip both
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if status:
        os._exit(status)


def main(argv: list[str]) -> None:
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:  # an optional one (s3fs) that is not installed: the script says so
            pass
    args = parse_args(argv)
    config, _cmd, _cmd_args = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config, run_script)(args.training_script, *args.training_script_args)


if __name__ == "__main__":
    main(sys.argv[1:])
