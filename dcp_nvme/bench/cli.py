"""``dcp-nvme bench``'s arguments and command."""

from __future__ import annotations

import argparse
import importlib.util
import json

from dcp_nvme.bench.plot import plot
from dcp_nvme.bench.records import BenchOptions
from dcp_nvme.bench.report import format_report
from dcp_nvme.bench.runner import run_bench
from dcp_nvme.config import parse_size
from dcp_nvme.errors import BenchError

BENCH_DESCRIPTION = """\
Measure dcp_nvme beside the device limit and the usual ways to save, in one run.

One synthetic Llama-shaped state, one directory, one process per rank:
- the device limit: fio sequential O_DIRECT write and read at the plugin's queue depth and block
  size (the plugin's own engine when fio is not installed), and a memory-copy floor;
- dcp_nvme: sync save, cold load, async save (blocking and total), a resharded load;
- peers: DCP's FileSystemWriter (thread_count 1, 2, 4, 8) and FileSystemReader, torch.save and
  torch.load, safetensors save_file and load_file.

Every save goes to a fresh directory and includes fsync. Before each load the checkpoint's files
are dropped from the page cache (fsync + posix_fadvise, only those files); the report says what
share of pages a sampled read still found cached."""


def register(subparsers: argparse._SubParsersAction) -> None:
    description = BENCH_DESCRIPTION
    parser = subparsers.add_parser(
        "bench", help="measure dcp_nvme against the device limit, DCP FileSystemWriter, torch.save, "
                      "safetensors", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=parse_size("512MiB"),
                        help="total state size, e.g. 512MiB or 2GiB (default 512MiB)")
    parser.add_argument("--ranks", type=int, default=1, help="processes over gloo sharing the disk (default 1)")
    parser.add_argument("--dir", default=".", help="directory on the drive to measure (default: .); "
                        "a temporary sub-directory is created and removed")
    parser.add_argument("--optim", action="store_true", help="add fp32 Adam moments and master weights")
    parser.add_argument("--queue-depth", type=int, default=None, help="dcp_nvme requests in flight per rank")
    parser.add_argument("--block-size", type=parse_size, default=None, help="dcp_nvme bytes per request")
    parser.add_argument("--direct-io", choices=("on", "off"), default=None, help="dcp_nvme O_DIRECT")
    parser.add_argument("--node-queue-depth", type=int, default=None,
                        help="dcp_nvme requests in flight shared by the ranks (each keeps this // ranks); "
                             "fio then runs numjobs=ranks at the same total depth, and a save at the per-rank "
                             "depth it replaces is measured too")
    parser.add_argument("--node-write-order", choices=("together", "staggered"), default=None,
                        help="with --node-queue-depth: the ranks write at once, sharing it, or take turns, "
                             "each with all of it; the other order is measured too")
    parser.add_argument("--repeat", type=int, default=1, help="runs per row; the median is reported")
    parser.add_argument("--quick", action="store_true", help="FileSystemWriter at thread_count=1 only")
    parser.add_argument("--json", default=None, help="write every figure and the configuration here")
    parser.add_argument("--plot", default=None, help="write a bar chart (PNG) here; needs matplotlib")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    group = parser.add_argument_group("--compress: the drain's codec on a state trained here")
    group.add_argument("--compress", action="store_true",
                       help="instead of the table above: train a small transformer on CPU on the stdlib's "
                            "sources, then report codec ratios and MB/s beside plain zstd (and zipnn)")
    group.add_argument("--train-steps", type=int, default=300, help="training steps before the first checkpoint")
    group.add_argument("--gap", type=int, default=20, help="steps between the two checkpoints (delta)")
    group.add_argument("--model-dim", type=int, default=256, help="width of the trained transformer")
    group.add_argument("--layers", type=int, default=4, help="layers of the trained transformer")
    group.add_argument("--seq", type=int, default=128, help="training sequence length (bytes)")
    group.add_argument("--batch", type=int, default=16, help="training batch size")
    levels = group.add_mutually_exclusive_group()
    levels.add_argument("--level", type=_level, default=None,
                        help="zstd level for the codec, plain zstd and the drains (default: the codec's default level)")
    levels.add_argument("--levels", type=_levels, default=None,
                        help="zstd levels to compare, e.g. 1,3: each group measured at each, back to back "
                             "(the drains use the first)")
    group.add_argument("--codec-threads", type=int, default=2, help="threads that code and decode chunks")
    group.add_argument("--drain-to", default=None,
                       help="also drain the later checkpoint there (URL, directory, or s3-loopback) off/bytegroup/auto "
                             "and as a delta against the earlier one; load the coded mirrors back")
    group.add_argument("--drain-storage-options", default=None, help="JSON fsspec options for --drain-to")
    group.add_argument("--bandwidth", type=parse_size, default=parse_size("200MB"),
                       help="the drain's cap (default 200MB = 200e6 bytes/s)")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    if args.compress:
        return _compress(args)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib: pip install 'dcp_nvme[bench]'")
    options = BenchOptions(
        size=args.size, ranks=args.ranks, directory=args.dir, optim=args.optim,
        queue_depth=args.queue_depth, block_size=args.block_size,
        direct_io=None if args.direct_io is None else args.direct_io == "on",
        node_queue_depth=args.node_queue_depth, node_write_order=args.node_write_order,
        repeat=args.repeat, quick=args.quick, keep=args.keep, progress=not args.no_progress,
    )
    doc = run_bench(options)
    print(format_report(doc))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(doc, handle, indent=1)
        print(f"\nresults: {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"plot: {args.plot}")
    return 0


MAX_LEVEL = 22
"""zstd's highest level (zstandard.MAX_COMPRESSION_LEVEL; not imported here: the CLI starts fast)."""


def _levels(text: str) -> tuple[int, ...]:
    """``--levels 1,3`` (or ``--level 3``): zstd levels 1..22, none twice."""
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,3, got {text!r}") from None
    if any(not 1 <= level <= MAX_LEVEL for level in levels) or len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"{text!r}: zstd levels from 1 to {MAX_LEVEL}, none twice")
    return levels


def _level(text: str) -> int:
    """``--level 3``: one zstd level."""
    levels = _levels(text)
    if len(levels) != 1:
        raise argparse.ArgumentTypeError(f"one zstd level, got {text!r} (for several: --levels)")
    return levels[0]


def _compress(args: argparse.Namespace) -> int:
    from dcp_nvme.bench.compression import CompressOptions, dump, format_compress_report, run_compress_bench
    from dcp_nvme.tiers.codec import DEFAULT_LEVEL

    options = CompressOptions(
        steps=args.train_steps, gap=args.gap, dim=args.model_dim, layers=args.layers,
        levels=args.levels or (args.level if args.level is not None else DEFAULT_LEVEL,),
        seq=args.seq, batch=args.batch,
        codec_threads=args.codec_threads, drain_to=args.drain_to, bandwidth=args.bandwidth,
        storage_options=json.loads(args.drain_storage_options) if args.drain_storage_options else None,
        directory=None if args.dir == "." else args.dir,
    )
    doc = run_compress_bench(options)
    print(format_compress_report(doc))
    if args.json:
        dump(doc, args.json)
        print(f"\nresults: {args.json}")
    return 0
