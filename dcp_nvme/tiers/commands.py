"""``dcp-nvme drain PATH --to URL`` and ``dcp-nvme status PATH``."""

from __future__ import annotations

import argparse
import os

from dcp_nvme.config import check_option, parse_size, parse_storage_options
from dcp_nvme.errors import InvalidInputError
from dcp_nvme.format.manifest import describe_topology, read_manifest
from dcp_nvme.humanize import format_size, print_json, progress_bar
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.storage.run_dir import checkpoints
from dcp_nvme.tiers.compress import MODES as COMPRESS_MODES
from dcp_nvme.tiers.delta import delta_line, status_line
from dcp_nvme.tiers.drainer import drain
from dcp_nvme.tiers.journal import drain_state, journal_options, load_journal
from dcp_nvme.tiers.options import DrainOptions
from dcp_nvme.tiers.retention import apply_retention
from dcp_nvme.tiers.verify import verify_mirror


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "drain", help="copy a committed checkpoint to its mirror (resumes an interrupted drain)",
        description="Copy a committed local checkpoint to an fsspec target, verified, manifest "
                    "last. Without --to, resumes the drain its journal names.")
    parser.add_argument("path", help="local checkpoint directory")
    parser.add_argument("--to", dest="target", help="target URL or directory (default: the journal's)")
    parser.add_argument("--storage-options", default=None,
                        help="JSON object of fsspec storage options, e.g. '{\"endpoint_url\": ...}'")
    parser.add_argument("--max-transfers", type=int, default=DrainOptions.max_transfers,
                        help=f"pieces in flight at once (default {DrainOptions.max_transfers})")
    parser.add_argument("--part-size", default="64MiB", help="bytes per piece (default 64MiB); a file an interrupted drain began keeps the part "
                             "size it was planned with")
    parser.add_argument("--bandwidth", default=None, help="cap, bytes per second, e.g. 200MiB")
    parser.add_argument("--verify", choices=("sent", "readback"), default="sent",
                        help="sent: check each piece as it is sent (default); readback: also read the "
                             "mirror back and check every byte")
    parser.add_argument("--compress", choices=COMPRESS_MODES, default="off",
                        help="send byte-grouped .dcz files (bytegroup), only when it finishes sooner "
                             "over the link (auto: needs --bandwidth or --link-rate), or plain (off)")
    parser.add_argument("--delta-every", type=int, default=DrainOptions.delta_every,
                        help="--compress delta: a full checkpoint at least every this many "
                             f"(default {DrainOptions.delta_every})")
    parser.add_argument("--link-rate", default=None, help="the link's bytes/s for --compress auto, e.g. 1GB")
    parser.add_argument("--codec-threads", type=int, default=None,
                        help="threads coding for the drain (default: half the cores, at most 2)")
    parser.add_argument("--verify-only", action="store_true",
                        help="do not send: read the mirror back and check every byte")
    parser.add_argument("--retries", type=int, default=DrainOptions.retries,
                        help=f"attempts after the first before giving up (default {DrainOptions.retries})")
    parser.add_argument("--backoff", type=float, default=DrainOptions.backoff,
                        help=f"seconds before the first retry, doubling after (default {DrainOptions.backoff:g})")
    parser.add_argument("--keep-last", type=int, default=None,
                        help="then prune the parent run directory to the K newest checkpoints")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=_drain)


def _drain(args: argparse.Namespace) -> int:
    target = args.target or (load_journal(args.path) or {}).get("target")
    if not isinstance(target, str) or not target:
        raise InvalidInputError(f"{args.path}: no --to given and no drain journal names a target")
    target = check_option("mirror", target, "--to")  # an unknown protocol fails now, not after retries
    storage_options = parse_storage_options(args.storage_options)
    if not args.target:  # the journal's target: its options too (never credentials: give those again)
        kept = journal_options(args.path)
        storage_options = {**kept, **(storage_options or {})} if kept or storage_options else None
    options = DrainOptions(
        max_transfers=args.max_transfers, part_size=parse_size(args.part_size),
        bandwidth=parse_size(args.bandwidth) if args.bandwidth else None, verify=args.verify,
        retries=args.retries, backoff=args.backoff, compress=args.compress, delta_every=args.delta_every,
        link_rate=parse_size(args.link_rate) if args.link_rate else None, codec_threads=args.codec_threads,
    )
    if args.verify_only:
        result = verify_mirror(args.path, target, storage_options=storage_options, options=options)
    else:
        bar = progress_bar(_local_bytes(args.path), not args.no_progress and not args.json, "drain")
        try:
            result = drain(args.path, target, storage_options=storage_options, options=options,
                           progress=lambda _name, piece: bar.update(piece.length))
        finally:
            bar.close()
    removed = apply_retention(os.path.dirname(os.path.abspath(args.path)), args.keep_last,
                              storage_options=storage_options) if args.keep_last else []
    if args.json:
        print_json({**result.to_dict(), "removed": removed}, args.path)
    else:
        print(f"{args.path}: mirrored to {target}: {format_size(result.bytes_sent)} sent, "
              f"{format_size(result.bytes_skipped)} already there, {result.seconds:.2f} s")
        if result.compression.get("codec"):
            c = result.compression
            print(f"compressed ({c['codec']}): {format_size(c['bytes'])} -> {format_size(c['stored_bytes'])} "
                  f"({c['ratio']:.3f}x), "
                  f"{c['encode_seconds']:.2f} s, {c['cpu_seconds']:.2f} CPU s on {c['threads']} thread(s)")
        elif result.compression.get("decision"):
            print(f"compress={args.compress}: {result.compression['decision']}")
        if isinstance(result.compression.get("delta"), dict):
            print(f"delta: {delta_line(result.compression['delta'])}")
        for path in removed:
            print(f"removed {path} (retention)")
    return 0


def _local_bytes(path: str) -> int:
    """The committed checkpoint's bytes (the progress bar's total); 0 when unreadable, which the
    drain itself then reports."""
    try:
        return int(read_manifest(LocalStore(path), path).doc.get("total_bytes") or 0)
    except Exception:  # noqa: BLE001 - the drain names the problem; the bar only stays hidden
        return 0


def status_local(args: argparse.Namespace) -> int:
    """``dcp-nvme status`` of a local checkpoint or run directory (``tools.commands`` registers it)."""
    from dcp_nvme.peers.replicate import protection, replication_state

    path = args.path
    if os.path.isfile(os.path.join(path, "manifest.json")) or not os.path.isdir(path):
        paths = [path]
    else:
        paths = [str(c.path) for c in checkpoints(path, kinds=("nvme",))] or [path]
    rows = []
    for p in paths:
        state = drain_state(p)
        coded = (load_journal(p) or {}).get("compression") if state.state == "mirrored" else None
        replication = replication_state(p)
        held = protection(p)
        rows.append({"checkpoint": p, "path": p, **state.to_dict(),
                     "compression": coded if isinstance(coded, dict) else None,
                     "topology": _topology(p), "replication": replication, "held": held,
                     "protected": state.state == "mirrored" or bool(replication["replicated_on"])
                     or bool(held and held["min_nodes"] >= 2)})
    if args.json:  # one checkpoint: its object; a run directory: a list, one per checkpoint
        print_json(rows[0] if paths == [path] else rows)
        return 0
    for row in rows:
        extra = f" -> {row['target']}" if row["target"] else ""
        if row.get("restored_from") and row["state"] == "mirrored":
            extra += " (restored from it)"
        progress = (f" ({format_size(row['bytes_sent'])} of {format_size(row['bytes_total'])})"
                    if row["state"] == "draining" else "")
        note = " [interrupted: run `dcp-nvme drain` to resume]" if row["interrupted"] else ""
        why = f" ({row['cause']})" if row["cause"] and row["state"] != "failed" else ""
        coded = row["compression"] or {}
        ratio = coded.get("ratio")
        zipped = (f" [compressed {coded.get('codec')}, {ratio:.3f}x{status_line(coded.get('delta'))}]"
                  if isinstance(ratio, (int, float)) else "")
        nodes = describe_topology(row["topology"], []) if row["topology"] else None
        where = f" [{nodes}]" if nodes and row["topology"]["mode"] == "node-local" else ""
        print(f"{row['path']}: {row['text']}{why}{extra}{zipped}{progress}{note}{where}{_replicas(row)}")
    return 0


def _replicas(row: dict) -> str:
    """`` [replicated on node(s) 1; holds replicas of node(s) 2; every item on 2 nodes; protected]``
    for a node-local step."""
    rep = row["replication"]
    parts = []
    if rep["replicated_on"]:
        parts.append(f"replicated on node(s) {', '.join(rep['replicated_on'])}")
    elif rep["state"] == "replicating":
        parts.append("replicating")
    for node, why in rep["failed"].items():
        parts.append(f"replica on node {node} failed: {why}")
    if rep["holds"]:
        parts.append(f"holds replicas of node(s) {', '.join(rep['holds'])}")
    held = row.get("held")  # data-parallel replicas: the manifest's copies, before any replica
    if held and held["items"] and not held["on_one_node"]:
        parts.append(f"every item on {held['min_nodes']} nodes")
    elif held and held["items"] and not parts:
        parts.append(f"{held['on_one_node']} of {held['items']} items on one node only")
    if not parts:  # not node-local: the drain state says it all
        return ""
    parts.append("protected" if row["protected"] else "unprotected: a node loss before the drain loses it")
    return f" [{'; '.join(parts)}]"


def _topology(path: str) -> dict | None:
    """Where the checkpoint's ranks wrote (the manifest's ``topology``), if it is committed."""
    try:
        manifest = read_manifest(LocalStore(path), path)
    except Exception:  # noqa: BLE001  status reports any checkpoint, committed or not
        return None
    return manifest.doc.get("topology")
