"""``dcp-nvme tune``: the command line, the report and the tune file it writes.

The best point is written as JSON to ``default_tune_file()`` (``$DCP_NVME_TUNE_FILE``, else
``~/.config/dcp_nvme/tune.json``), where ``resolve_config`` picks it up for every NVMeWriter and
NVMeReader that does not say otherwise. ``--ranks N`` runs the node sweep (``tune.ranks``)."""

from __future__ import annotations

import argparse
import json
import os
import uuid
from pathlib import Path
from typing import Any

from dcp_nvme.config import ALIGN, default_tune_file, parse_size
from dcp_nvme.errors import InvalidInputError
from dcp_nvme.humanize import format_size
from dcp_nvme.observe.machine import files_under
from dcp_nvme.tune.probe import CHOSEN_BY, sweep


def format_curve(doc: dict[str, Any]) -> str:
    """The sweep as a table a person can scan, the chosen point marked."""
    best = doc["best"]
    node = "node_queue_depth" in best  # tune --ranks: node depth, then each rank's share
    lines = [(f"{'node qd':>7} {'order':>9} " if node else "") + f"{'direct':>6} {'queue_depth':>11} {'block_size':>10} "
             f"{'write GB/s':>10} {'read GB/s':>9} {'w p99 ms':>8} {'depth':>5}"]
    for p in doc["points"]:
        chosen = all(p.get(k) == best.get(k) for k in (*CHOSEN_BY, "node_write_order"))
        lines.append(
            (f"{p['node_queue_depth']:>7} {p.get('node_write_order', 'together'):>9} " if node else "") +
            f"{('yes' if p['direct_io'] else 'no'):>6} {p['queue_depth']:>11} {format_size(p['block_size']):>10} "
            f"{p['write_gbps']:>10.2f} {p['read_gbps']:>9.2f} {p['write_io']['latency_p99_ms']:>8.1f} "
            f"{p['write_io']['max_inflight']:>5}" + ("   <- best" if chosen else ""))
    return "\n".join(lines)


def _layer_report(doc: dict[str, Any], device, ranks: int) -> list[str]:
    """Block layer and drive health under the tuned directory; also stored in ``doc``."""
    from dcp_nvme.observe.blockdev import check_queues, format_device
    from dcp_nvme.observe.drive_health import format_drive

    best = doc["best"]
    advice = check_queues(device, best["queue_depth"], ranks, best["block_size"]) if device else []
    doc["block_layer"] = {"device": device.to_dict() if device else None, "advice": [str(a) for a in advice]}
    lines = format_device(device) + [f"  warning: {a}" for a in advice]
    return lines + format_drive(doc["drive"])


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _size_list(text: str) -> list[int]:
    try:
        values = [parse_size(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    bad = [v for v in values if v < ALIGN or v % ALIGN]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"block sizes must be multiples of {ALIGN} bytes, got {text!r}")
    return values


def _directs(text: str) -> list[bool]:
    choices = {"both": [True, False], "on": [True], "off": [False], "true": [True], "false": [False]}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError("--direct takes both, on or off")
    return choices[text.lower()]


TUNE_DESCRIPTION = """\
Sweep queue depth x block size (x O_DIRECT) on a directory of the target drive.

Each point writes a fresh file of --size bytes (fsync included), drops it from the page cache,
reads it back and deletes it. The point with the best geometric mean of write and read GB/s
(within 3 %, the one using the least memory) is saved as JSON; every NVMeWriter and NVMeReader
that is not told otherwise then uses it (environment variables and arguments still win)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune", help="sweep queue depth x block size on a directory; save the best for the plugin",
        description=TUNE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=".", help="directory on the target drive (default: .)")
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"),
                        help="bytes written and read per point (default 1GiB)")
    parser.add_argument("--queue-depths", type=_int_list, default=[1, 2, 4, 8, 16],
                        help="requests in flight to try, comma-separated (default 1,2,4,8,16)")
    parser.add_argument("--block-sizes", type=_size_list, default=_size_list("1MiB,4MiB,8MiB,16MiB"),
                        help="bytes per request to try, comma-separated (default 1MiB,4MiB,8MiB,16MiB)")
    parser.add_argument("--direct", type=_directs, default=[True, False],
                        help="O_DIRECT: both (default), on or off")
    parser.add_argument("--repeat", type=int, default=1, help="runs per point; the median counts")
    parser.add_argument("--output", default=None,
                        help=f"where to write the result (default: {default_tune_file()}, "
                             "or $DCP_NVME_TUNE_FILE)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="processes writing at once, as the ranks of one node do: --queue-depths are "
                             "then node depths, split evenly, and the best is saved as node_queue_depth")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise InvalidInputError("--repeat must be at least 1")
    if args.size < ALIGN:
        raise InvalidInputError(f"--size must be at least {ALIGN} bytes")
    if args.ranks < 1:
        raise InvalidInputError("--ranks must be at least 1")
    from dcp_nvme.observe.drive_health import DriveWatch
    from dcp_nvme.tune.ranks import sweep_ranks

    work = os.path.join(args.dir, f".dcp-nvme-tune-{uuid.uuid4().hex[:8]}")
    os.makedirs(work)
    drive = DriveWatch(work)
    try:
        if args.ranks > 1:
            doc = sweep_ranks(work, args.size, args.ranks, args.queue_depths, args.block_sizes, args.direct,
                              repeat=args.repeat, progress=not args.no_progress)
        else:
            doc = sweep(work, args.size, args.queue_depths, args.block_sizes, args.direct,
                        repeat=args.repeat, progress=not args.no_progress)
    finally:
        for leftover in files_under(work):
            os.unlink(leftover)
        os.rmdir(work)
    doc["machine"]["directory"] = os.path.abspath(args.dir)
    doc["drive"] = drive.finish()
    layer_lines = _layer_report(doc, drive.device, args.ranks)
    output = Path(args.output) if args.output else default_tune_file()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, output)
    best = doc["best"]
    print(f"dcp-nvme tune: {args.size / 2**20:.0f} MiB per point on {doc['machine']['directory']} "
          f"({doc['machine'].get('fstype', '?')})")
    print(format_curve(doc))
    node = (f"node_queue_depth={best['node_queue_depth']} over {args.ranks} ranks "
            f"({best.get('node_write_order', 'together')}), " if best.get("node_queue_depth") else "")
    print(f"best: {node}queue_depth={best['queue_depth']} block_size={format_size(best['block_size'])} "
          f"direct_io={best['direct_io']} (write {best['write_gbps']:.2f} GB/s, read {best['read_gbps']:.2f} GB/s)")
    print("\n".join(layer_lines))
    if "read_modes" in doc:  # single-rank sweeps measure them (tune --ranks N does not)
        modes = doc["read_modes"]
        print(f"read_mode={best['read_mode']} (cold read: O_DIRECT {modes['direct']:.2f} GB/s, "
              f"buffered with readahead {modes['buffered']:.2f} GB/s)")
        print(f"host_engine={best['host_engine']} (" + "; ".join(
            f"{name}: {m['write_gbps']:.2f} GB/s write, {m['cpu_seconds_per_gb']:.3f} CPU s/GB"
            if "write_gbps" in m else f"{name}: {m['unavailable']}"
            for name, m in doc["host_engines"].items()) + ")")
    if output.resolve() == default_tune_file().resolve():
        print(f"written to {output}; NVMeWriter/NVMeReader use it unless an argument or DCP_NVME_* "
              "says otherwise")
    else:
        print(f"written to {output}; set DCP_NVME_TUNE_FILE={output} for NVMeWriter/NVMeReader to use it")
    return 0
