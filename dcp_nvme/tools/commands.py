"""``dcp-nvme list | inspect | verify | export | convert | unlock | status``: the command-line face of ``dcp_nvme.tools``.

Each command prints a table (or ``--json``) and returns its exit status; errors raise, and
``dcp_nvme.cli`` prints them as one line. The tools (and torch) are imported when a command
runs, not when its arguments are registered, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from dcp_nvme.humanize import format_size as human_bytes
from dcp_nvme.humanize import print_json


def _table(rows: list[list[str]], out=None) -> None:
    out = out or sys.stdout  # the stdout of this call (bound at import, a replaced one would stay)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), file=out)


def _json(value: Any, checkpoint: Any = None) -> None:
    print_json(value, checkpoint)


def _when(unix: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else "-"


# --------------------------------------------------------------------------- list


def _storage_options(args: argparse.Namespace, location: str) -> dict[str, Any] | None:
    """``--storage-options``, checked; refused for a local path (only a URL has a filesystem to give them to)."""
    from dcp_nvme.config import parse_storage_options
    from dcp_nvme.errors import InvalidInputError
    from dcp_nvme.storage.local_dir import is_remote_url

    options = parse_storage_options(getattr(args, "storage_options", None))
    if options is not None and not is_remote_url(location):
        raise InvalidInputError(f"--storage-options are for a URL (s3://bucket/run); {location} is a local path")
    return options


def cmd_list(args: argparse.Namespace) -> int:
    from dcp_nvme.storage.local_dir import is_remote_url
    from dcp_nvme.tools.listing import list_checkpoints, list_remote

    options = _storage_options(args, args.dir)
    entries = list_remote(args.dir, options) if is_remote_url(args.dir) else list_checkpoints(args.dir)
    if args.json:
        _json([{"checkpoint": e.path, **e.to_dict()} for e in entries])
        return 0
    if not entries:
        print(f"no checkpoints under {args.dir}")
        return 0
    rows = [["STEP", "STATE", "SIZE", "RANKS", "CREATED", "TIER", "PATH"]]
    for e in entries:
        rows.append([
            "-" if e.step is None else str(e.step), e.state, human_bytes(e.bytes),
            "-" if e.ranks is None else str(e.ranks), _when(e.created_unix),
            str(e.tier) if e.tier is not None else "-", e.path,
        ])
    _table(rows)
    for e in entries:
        if not e.ok:
            print(f"  {e.name}: {e.reason}")
    return 0


# --------------------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    from dcp_nvme.format.manifest import describe_topology
    from dcp_nvme.tools.inspection import inspect_checkpoint

    options = _storage_options(args, args.checkpoint)
    info = inspect_checkpoint(args.checkpoint, filter=args.filter, storage_options=options)
    if args.json:
        _json(info.to_dict(), info.location)
        return 0 if info.ok else 1
    print(f"checkpoint {info.location}: {info.state}")
    if info.reason:
        print(f"  problem: {info.reason}")
    if info.world_size is not None:
        print(f"  ranks {info.world_size}, save {info.save_key}, created {_when(info.created_unix)}, "
              f"{len(info.files)} file(s), {human_bytes(sum(f.get('size', 0) for f in info.files))} on disk")
    nodes = describe_topology(info.topology, info.elsewhere)
    if nodes:
        print(f"  written: {nodes}")
    if info.partial:
        print("  data files found (their own safetensors headers; nothing is loadable):")
        for name, desc in info.partial.items():
            if "error" in desc:
                print(f"    {name}: unreadable: {desc['error']}")
            else:
                print(f"    {name}: {desc['items']} item(s), {human_bytes(desc['bytes'])} of data, "
                      f"{human_bytes(desc['size'])} on disk, rank {desc['metadata'].get('rank', '?')}")
    if info.tensors:
        rows = [["FQN", "DTYPE", "SHAPE", "SHARDS", "BYTES", "FILES"]]
        for t in info.tensors:
            rows.append([t.fqn, t.dtype, "x".join(map(str, t.shape)) or "()", str(t.shards),
                         human_bytes(t.nbytes), ",".join(_rank_of(f) for f in t.files)])
        _table(rows)
    if info.objects:
        print("non-tensor items:")
        for o in info.objects:
            print(f"  {o.fqn}  {human_bytes(o.nbytes)}  {','.join(_rank_of(f) for f in o.files)}")
    if info.by_dtype:
        print("by dtype:    " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(info.by_dtype.items())))
        print("by top key:  " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(info.by_top_key.items())))
        print(f"total:       {len(info.tensors)} tensor(s), {len(info.objects)} other item(s), "
              f"{human_bytes(info.total_bytes)}")
        from dcp_nvme.tiers.coded import describe_compression

        coded = describe_compression(info.location, options)
        if coded:
            print(f"compressed:  {coded}")
    return 0 if info.ok else 1


def _rank_of(name: str) -> str:
    """``rank_00003.<key>.safetensors`` -> ``r3`` keeps the FILES column short."""
    head = name.split(".", 1)[0]
    return f"r{int(head[5:])}" if head.startswith("rank_") and head[5:].isdigit() else name


# --------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    from dcp_nvme.tools.verify import verify_checkpoint

    progress = not args.no_progress and not args.json
    report = verify_checkpoint(args.checkpoint, jobs=args.jobs, progress=progress,
                               allow_pickle=args.allow_pickle,
                               storage_options=_storage_options(args, args.checkpoint))
    if args.json:
        _json(report.to_dict(), report.location)
        return 0 if report.ok else 1
    for problem in report.problems:
        print(f"BAD {problem}")
    for item in report.needs_pickle:  # not an integrity problem: the loader's decision
        print(f"PICKLE {item} (NVMeReader loads it only with allow_pickle=True, which runs its code: "
              "trust the author first)")
    figures = (f"{report.files} file(s), {human_bytes(report.bytes_read)} read in {report.seconds:.2f} s "
               f"({report.gbps:.2f} GB/s)")
    if report.ok:
        print(f"OK {report.location}: intact; {figures}")
        return 0
    print(f"FAILED {report.location}: {len(report.problems)} problem(s); {figures}")
    return 1


# --------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    from dcp_nvme.tools.export import export_hf

    progress = not args.no_progress and not args.json
    result = export_hf(args.checkpoint, args.out, keys=args.keys, strip_prefix=args.strip_prefix,
                       dtype=args.dtype, max_shard_size=args.max_shard_size,
                       overwrite=args.overwrite, progress=progress, include_optimizer=args.include_optimizer,
                       config=args.config)
    if args.json:
        _json(result.to_dict(), args.checkpoint)
        return 0
    print(f"exported {result.tensors} tensor(s), {human_bytes(result.total_size)}, into "
          f"{len(result.shards)} shard(s) in {result.out} ({result.seconds:.2f} s)")
    if result.left_out:
        print("left out (not model weights): " + ", ".join(f"{k} ({n} tensor(s))" for k, n in sorted(result.left_out.items()))
              + "; pass --include-optimizer to export every tensor")
    if result.config is None:
        print("no config.json written (a checkpoint holds none; transformers' from_pretrained needs one): pass "
              "--config FILE, the model's config.json, e.g. from the repository the model started from")
    if result.skipped_objects:
        print(f"skipped {len(result.skipped_objects)} non-tensor item(s): "
              + ", ".join(result.skipped_objects[:5]) + (" ..." if len(result.skipped_objects) > 5 else ""))
    return 0


# --------------------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace) -> int:
    from dcp_nvme.tools.convert import convert

    result = convert(args.src, args.dst, args.to, memory_budget=args.memory_budget, overwrite=args.overwrite,
                     progress=not args.no_progress and not args.json)
    if args.json:
        _json(result.to_dict(), args.src)
        return 0
    print(f"converted {result.src_format} {result.src} -> {result.to} {result.dst}: {result.tensors} tensor(s), "
          f"{result.objects} other item(s), {human_bytes(result.tensor_bytes)} in {result.seconds:.2f} s")
    return 0


def register_convert(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("convert", help="to and from DCP's stock layout and torch.save files")
    p.add_argument("src", help="a dcp_nvme checkpoint, a stock DCP checkpoint (.metadata) or a torch.save file")
    p.add_argument("dst", help="output directory (--to nvme, dcp) or file (--to torch); must not exist")
    p.add_argument("--to", required=True, choices=["nvme", "dcp", "torch"],
                   help="nvme: dcp_nvme; dcp: DCP's FileSystemWriter layout; torch: one torch.save file")
    p.add_argument("--memory-budget", default="1GiB", metavar="SIZE",
                   help="tensor bytes held at once between checkpoint layouts (default 1GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_convert)


def cmd_unlock(args: argparse.Namespace) -> int:
    from dcp_nvme.storage.save_lock import unlock

    holder, why = unlock(args.path, force=args.force)
    if args.json:
        from dataclasses import asdict

        _json({"removed": holder is not None, "reason": why,
               "holder": None if holder is None else {k: v for k, v in asdict(holder).items() if k != "token"}},
              args.path)
        return 0
    if holder is None:
        print(f"{args.path}: {why}")
    else:
        print(f"{args.path}: removed the save lock of {holder.describe()} ({why})")
    return 0


def register_unlock(subparsers: argparse._SubParsersAction) -> None:
    from dcp_nvme.storage.save_lock import STALE_AFTER_S

    p = subparsers.add_parser(
        "unlock", help="remove a checkpoint directory's save lock left by a dead save",
        description="Remove <dir>/.save.lock when its holder is dead by the lock rule (same host: "
                    "its pid is gone; another host: no heartbeat for "
                    f"{STALE_AFTER_S:.0f} s). --force removes a lock that still looks live.")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--force", action="store_true",
                   help="remove the lock even if its holder looks alive (you know it is dead)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_unlock)


# --------------------------------------------------------------------------- registration


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help="for a URL: a JSON object of fsspec storage options, e.g. "
                             "'{\"endpoint_url\": \"http://host:8333\"}'")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("list", help="checkpoints under a run directory, newest first")
    p.add_argument("dir", help="a run directory (or one checkpoint directory), or its URL (s3://bucket/run)")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser("inspect", help="tensors, shapes, dtypes and sizes of a checkpoint (no data read)")
    p.add_argument("checkpoint", help="checkpoint directory or fsspec URL")
    p.add_argument("--filter", metavar="GLOB", help="only names matching this glob, e.g. 'model.*'")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = subparsers.add_parser("verify", help="read every byte and check every checksum; exit 0 only if intact")
    p.add_argument("checkpoint", help="checkpoint directory or fsspec URL")
    p.add_argument("--jobs", type=int, default=4, metavar="N", help="parallel readers (default 4)")
    add_storage_options(p)
    p.add_argument("--allow-pickle", action="store_true",
                   help="kept for scripts: items that only full pickle can load are listed (PICKLE) "
                        "and never fail the integrity check")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)

    p = subparsers.add_parser("export", help="consolidate into a Hugging Face safetensors model")
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument("--to", required=True, choices=["hf"], help="output layout (hf: Hugging Face)")
    p.add_argument("out", help="output directory (must not exist, or be empty)")
    p.add_argument("--keys", action="append", metavar="GLOB",
                   help="export only names matching this glob, e.g. 'model.*' (repeatable)")
    p.add_argument("--strip-prefix", metavar="PREFIX", help="remove this prefix from names, e.g. 'model.'")
    p.add_argument("--include-optimizer", action="store_true",
                   help="export every tensor (optimizer state too) as named in the checkpoint; by default only "
                        "the model's weights, with a leading 'model.' removed")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bf16, fp16, fp32")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB (default), 500MB")
    p.add_argument("--config", metavar="FILE",
                   help="the model's config.json, copied beside the weights (transformers' from_pretrained needs it)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_export)

    register_convert(subparsers)
    register_unlock(subparsers)
    register_status(subparsers)


def register_status(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="drain state of a checkpoint, or of every checkpoint in a run directory")
    p.add_argument("path", help="a checkpoint directory, or a run directory holding checkpoints, "
                                "or its URL (s3://bucket/run)")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    """A local path: its drain, replication and node state (``tiers.commands.status_local``); a
    URL: the steps of the run in the object store, each the mirror's own copy (``remote``),
    with whether it can load (``dcp-nvme inspect`` says how it is stored)."""
    from dcp_nvme.storage.local_dir import is_remote_url

    options = _storage_options(args, args.path)
    if not is_remote_url(args.path):
        from dcp_nvme.tiers.commands import status_local

        return status_local(args)
    from dcp_nvme.tools.listing import list_remote

    url = args.path
    rows = []
    for entry in list_remote(url, options):
        rows.append({"checkpoint": entry.path, "path": entry.path, "state": "remote",
                     "checkpoint_state": entry.state, "cause": entry.reason,
                     "text": f"remote ({entry.state}{f': {entry.reason}' if entry.reason else ''})"})
    if args.json:
        _json(rows[0] if len(rows) == 1 and rows[0]["path"].rstrip("/") == url.rstrip("/") else rows)
        return 0
    if not rows:
        print(f"no checkpoints under {url}")
    for row in rows:
        print(f"{row['path']}: {row['text']}")
    return 0
