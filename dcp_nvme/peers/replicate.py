"""A second copy of each node's files on a peer's NVMe, sent in the background after the commit.

After a node-local save commits on each node (``save.node_commit``), the ranks that committed a
node's copy (the coordinator and the node writers) replicate over a gloo group of their own
(``replication_group``, made by every rank in ``write_data``), on a background thread each,
one replication at a time per process. Every one computes the same plan from the manifest:
node i's files go to the nodes ``placement`` names, unless every chunk in them is already on
more than ``replicas`` nodes (data-parallel replicas, kept once per node: ``held_enough``).
Then each (owner, holder) pair in one order: the owner sends its rank files in pieces of whole
checksum blocks, each checked before it goes; the holder checks each again, writes the files
under temp names, fsyncs and renames them into ``<checkpoint>/.replicas/<node>/``, adds its own
copy of the tables and manifest (the same bytes on every node) and writes the marker
``replica.json`` last. A replica without its marker is never used and is emptied by the next.
Then every rank hears which replicas were made and records its own in
``<checkpoint>/.replication.json`` (``replication_state``; ``dcp-nvme status``).

No server, no socket of ours: the group's own connections carry it, apart from training's
collectives. The thread never raises into the save: every failure ends as a line in the record
and a warning; ``NVMeWriter.replication_future`` resolves to a ``ReplicationResult`` either way.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcp_nvme.compat import new_gloo_group
from dcp_nvme.errors import ChecksumMismatchError, InvalidInputError, ManifestError
from dcp_nvme.format.container import (
    MANIFEST,
    REPLICA_MARKER,
    REPLICAS_DIR,
    REPLICATION_RECORD,
    check_node_name,
    rank_of,
    tables_of,
)
from dcp_nvme.format.manifest import MAX_MANIFEST, read_files, read_manifest
from dcp_nvme.format.pieces import plan_pieces, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import (
    create_no_follow,
    list_below,
    make_private_dir,
    open_regular,
    pwrite_all,
    read_regular,
    remove_below,
    unlink_below,
)
from dcp_nvme.host.threads import in_background
from dcp_nvme.peers.fetching import Limiter, replica_files, write_metadata, write_small
from dcp_nvme.storage.local_dir import LocalStore

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------- placement (pure)


def placement(nodes: list[str], node: str, copies: int, stride: int = 1) -> tuple[list[str], list[str], str | None]:
    """(the nodes that hold ``node``'s replicas, the nodes whose replicas ``node`` holds, a
    warning when fewer than ``copies`` other nodes exist).

    Node i's k-th replica goes to node (i + k * stride) mod N, never to i itself: stride 1 is the
    next node; a rack-aware user sets the stride to the nodes per rack, so that with nodes
    numbered rack by rack each copy lands in another rack."""
    if node not in nodes:
        raise InvalidInputError(f"node {node} is not one of the save's nodes {nodes}")
    count = len(nodes)

    def targets_of(i: int) -> list[int]:
        out: list[int] = []
        for k in range(1, count):
            j = (i + k * stride) % count
            if j != i and j not in out:
                out.append(j)
            if len(out) == copies:
                break
        return out

    mine = nodes.index(node)
    targets = targets_of(mine)
    sources = [nodes[j] for j in range(count) if mine in targets_of(j)]
    warning = None
    if len(targets) < copies:
        warning = (f"replicas={copies} asked, but only {len(targets)} other node(s) can hold a copy of node "
                   f"{node}'s files (the save has {count} node(s), replica stride {stride}): "
                   f"{len(targets)} replica(s) made")
    return [nodes[j] for j in targets], sources, warning


# --------------------------------------------------------------------------- the record


def _record_path(directory: str) -> str:
    return os.path.join(directory, REPLICATION_RECORD)


def _write_record(directory: str, doc: dict[str, Any]) -> None:
    try:
        write_small(directory, REPLICATION_RECORD, json.dumps(doc, indent=1).encode())
    except OSError as exc:
        log.warning("dcp_nvme: %s: the replication record was not written: %s", directory, exc)


def replication_state(directory: str) -> dict[str, Any]:
    """Where this node's copy of the committed save stands with its replicas:
    ``{"state": none|replicating|replicated|failed, "replicated_on": [...], "failed": {node: why},
    "holds": [nodes whose complete replica of this save is here]}``."""
    out: dict[str, Any] = {"state": "none", "replicated_on": [], "failed": {}, "holds": []}
    try:
        key = read_manifest(LocalStore(directory), directory).save_key
    except Exception:  # noqa: BLE001  an uncommitted or broken directory has no replicas to show
        return out
    try:
        doc = json.loads(read_regular(_record_path(directory), MAX_MANIFEST))
        if isinstance(doc, dict) and doc.get("save_key") == key:
            on = [n for n in doc.get("replicated_on", []) if isinstance(n, str)]
            failed = {str(n): str(w)[:300] for n, w in (doc.get("failed") or {}).items()}
            out.update(replicated_on=on, failed=failed,
                       state="replicated" if on else ("failed" if failed else str(doc.get("state", "none"))))
    except (OSError, ValueError, AttributeError, ManifestError):
        pass
    root = os.path.join(directory, REPLICAS_DIR)
    try:
        held = sorted(os.listdir(root))
    except OSError:
        held = []
    for name in held:
        marker = _marker(directory, name)
        if marker is not None and marker.get("save_key") == key:
            out["holds"].append(name)
    return out


def _holders(manifest: Any) -> tuple[dict[tuple, set[str]], dict[str, set[tuple]]]:
    """Per chunk, the nodes whose files hold it (its index place and its copies); per node, the
    chunks in its files."""
    holders: dict[tuple, set[str]] = {}
    by_node: dict[str, set[tuple]] = {}
    for chunk in [*manifest.chunks, *manifest.copies]:
        node = manifest.node_of(rank_of(chunk.file)) or "?"
        key = (chunk.fqn, chunk.offsets if chunk.kind == "tensor" else None)
        holders.setdefault(key, set()).add(node)
        by_node.setdefault(node, set()).add(key)
    return holders, by_node


def held_enough(manifest: Any, copies: int) -> set[str]:
    """The nodes each of whose chunks some ``copies`` other nodes already hold (data-parallel
    replicas, kept once a node by ``save.copies``): replicating their files adds nothing."""
    holders, by_node = _holders(manifest)
    return {node for node, keys in by_node.items() if all(len(holders[k]) > copies for k in keys)}


def protection(directory: str) -> dict[str, Any] | None:
    """How many nodes' disks hold each chunk of the committed node-local save in ``directory``:
    the node of its index place and the nodes of its copies (``save.copies``), before any
    replica. ``{"items", "min_nodes", "on_one_node"}``; None for a shared-directory or
    unreadable checkpoint."""
    try:
        manifest = read_manifest(LocalStore(directory), directory)
    except Exception:  # noqa: BLE001  nothing to say of what does not read back
        return None
    if not manifest.node_local:
        return None
    counts = [len(nodes) for nodes in _holders(manifest)[0].values()]
    return {"items": len(counts), "min_nodes": min(counts, default=0), "on_one_node": sum(c == 1 for c in counts)}


def _marker(directory: str, node: str) -> dict[str, Any] | None:
    try:
        check_node_name(node, directory)
        if replica_files(directory, node) is None:
            return None
        doc = json.loads(read_regular(os.path.join(directory, REPLICAS_DIR, node, REPLICA_MARKER), 1 << 20))
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, ManifestError):
        return None


# --------------------------------------------------------------------------- a replica's directory


def clear_replica(replica_dir: str) -> None:
    """Uncommit (marker first), then remove everything a replica directory holds (no link
    inside is followed: a link goes, never what it points to)."""
    unlink_below(replica_dir, REPLICA_MARKER)
    for name in list_below(replica_dir):
        remove_below(replica_dir, name)


# --------------------------------------------------------------------------- the background thread


@dataclass
class ReplicationResult:
    node: str
    save_key: str
    pulled: dict[str, str] = field(default_factory=dict)
    """Node whose files this node pulled -> ``ok`` or why not."""
    replicated_on: list[str] = field(default_factory=list)
    """Nodes that confirmed a complete replica of this node's files."""
    failed: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    warning: str | None = None
    already_held: bool = False
    """Every item of this node's files was on ``replicas`` other nodes already: none was made."""


_groups: dict[tuple[int, ...], Any] = {}
_current: Any = None
_one_at_a_time = threading.Lock()
PIECE = 64 << 20
"""A replica moves in pieces of about this many bytes (whole checksum blocks)."""


def replication_group(ranks: tuple[int, ...]) -> None:
    """Every rank of a node-local save with ``replicas`` calls this at the same point of
    ``write_data``: the gloo group of the ranks that commit a node's copy, made once per set."""
    global _current

    if ranks not in _groups:
        _groups[ranks] = new_gloo_group(list(ranks))  # the job's timeout, not torch's 30 min
    _current = _groups[ranks]


def start_replication(directory: str, node: str, copies: int, *, queue_depth: int = 8,
                      block_size: int = 8 << 20, bandwidth: float | None = None, stride: int = 1,
                      group: Any = None) -> Future[ReplicationResult]:
    """Start this node's replication on a background thread; returns its Future. Replications
    run one at a time per process, in commit order (the group's operations must match)."""
    group = group if group is not None else _current

    def run() -> ReplicationResult:
        try:
            with _one_at_a_time:
                return _replicate(group, directory, node, copies, bandwidth, stride)
        except BaseException as exc:  # never into the save: logged, and in the Future
            log.warning("dcp_nvme: node %s: replication of %s failed: %s", node, directory, exc)
            raise

    return in_background(run, f"dcp-nvme-replicate-{node}")


def _replicate(group: Any, directory: str, node: str, copies: int, bandwidth: float | None,
               stride: int) -> ReplicationResult:
    """Every replicating rank, on its own thread and the replication group: the same plan from
    the manifest, then each (owner, holder) pair in one order: the owner sends its files'
    pieces, each checked before it goes; the holder checks each again and commits the replica
    (marker last); then every rank hears which replicas were made."""
    import torch.distributed as dist

    began = time.perf_counter()
    manifest = read_manifest(LocalStore(directory), directory)
    key = manifest.save_key
    result = ReplicationResult(node, key)
    if not manifest.node_local:
        result.warning = "the checkpoint is in one shared directory: there is no node's disk to replicate"
        log.info("dcp_nvme: %s: %s", directory, result.warning)
        return result
    if group is None:
        raise InvalidInputError("replicas: no replication group (the save did not plan through NVMeWriter)")
    members: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(members, (node, dist.get_rank()), group=group)
    rank_of = dict(members)
    nodes = list((manifest.doc.get("topology") or {}).get("nodes") or [])
    enough = held_enough(manifest, copies)  # the same on every node: the manifest's
    pairs = [(owner, holder) for owner in nodes if owner not in enough
             for holder in placement(nodes, owner, copies, stride)[0]]
    targets = [holder for owner, holder in pairs if owner == node]
    result.warning = placement(nodes, node, copies, stride)[2] if node not in enough else None
    result.already_held = node in enough
    if result.warning:
        log.warning("dcp_nvme: %s", result.warning)
    record = {"save_key": key, "state": "replicating", "targets": targets, "replicated_on": [], "failed": {}}
    _write_record(directory, record)
    files = read_files(LocalStore(directory), manifest, directory)
    limiter = Limiter(bandwidth)
    by_node = manifest.files_by_node()
    # Every node sends its files and receives the others' at once: its sends on a thread of
    # their own, its receives here, each in round order (a holder's k-th replica of an owner
    # is round k). One after another, only one link of the job was busy at a time. Each pair
    # of ranks has one transfer, so the two directions never mix up their messages.
    rounds = {(owner, holder): k for owner, holder in pairs
              for k, h in enumerate(placement(nodes, owner, copies, stride)[0]) if h == holder}
    sends = [holder for owner, holder in pairs if owner == node]
    receives = sorted((owner for owner, holder in pairs if holder == node),
                      key=lambda owner: (rounds[(owner, node)], nodes.index(owner)))
    send_error: list[BaseException] = []

    def send_all() -> None:
        try:
            for holder in sends:
                _send(group, rank_of[holder], directory, [files[n] for n in by_node.get(node, [])], limiter)
        except BaseException as exc:  # noqa: BLE001  raised by the replicating thread below
            send_error.append(exc)

    sender = threading.Thread(target=send_all, name=f"dcp-nvme-replicate-send-{node}", daemon=True)
    sender.start()
    for owner in receives:
        names = by_node.get(owner, [])
        try:
            result.bytes += _receive(group, rank_of[owner], directory, manifest, [files[n] for n in names],
                                     owner, key)
            result.pulled[owner] = "ok"
            log.info("dcp_nvme: node %s holds a verified replica of node %s's files of %s", node, owner,
                     directory)
        except Exception as exc:  # noqa: BLE001  recorded, and told to the owner
            result.pulled[owner] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("dcp_nvme: node %s: replica of node %s's files of %s not made: %s", node, owner,
                        directory, result.pulled[owner])
    sender.join()
    if send_error:
        raise send_error[0]
    said: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, (node, result.pulled), group=group)
    for holder, pulled in said:
        if holder in targets:
            why = pulled.get(node, "no answer")
            if why == "ok":
                result.replicated_on.append(holder)
            else:
                result.failed[holder] = why
    record.update(replicated_on=result.replicated_on, failed=result.failed,
                  state="replicated" if result.replicated_on else ("failed" if targets else "held"))
    _write_record(directory, record)
    result.seconds = time.perf_counter() - began
    return result


def _send(group: Any, holder: int, directory: str, records: list[FileRecord], limiter: Limiter) -> None:
    """The owner's side of one pair: each piece read and checked, then a status (1: it follows,
    0: damaged here, nothing follows) and the piece."""
    import torch
    import torch.distributed as dist

    # the next piece is read and checked while this one is sent (one ahead: two pieces in memory)
    fds: dict[str, int] = {}
    try:
        jobs = []
        for record in records:
            fds[record.name] = open_regular(os.path.join(directory, record.name))
            jobs += [(record, piece) for piece in plan_pieces(record.size, record.data_start, record.checksum_block,
                                                              PIECE)]

        def read(job: tuple[FileRecord, Any]) -> bytearray | None:
            record, piece = job
            return _read_piece(fds[record.name], record, piece, os.path.join(directory, record.name))

        with ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-replica-read") as pool:
            ahead = pool.submit(read, jobs[0]) if jobs else None
            for at, (_, piece) in enumerate(jobs):
                assert ahead is not None  # submitted for this job
                data = ahead.result()
                ahead = pool.submit(read, jobs[at + 1]) if at + 1 < len(jobs) else None
                dist.send(torch.tensor([int(data is not None)]), holder, group=group)
                if data is not None:
                    limiter.take(piece.length)
                    dist.send(torch.frombuffer(data, dtype=torch.uint8), holder, group=group)
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_piece(fd: int, record: FileRecord, piece: Any, path: str) -> bytearray | None:
    """One piece of this node's file, checked against the blocks table; None when damaged."""
    data = bytearray(piece.length)
    try:
        if os.preadv(fd, [data], piece.offset) != piece.length:
            raise OSError(f"{path}: short read at {piece.offset}")
        verify_piece(record, piece.offset, memoryview(data), path)
    except (ChecksumMismatchError, OSError) as exc:
        log.warning("dcp_nvme: %s: not sent to its replica: %s", record.name, exc)
        return None
    return data


def _receive(group: Any, owner_rank: int, directory: str, manifest: Any, records: list[FileRecord],
             owner: str, key: str) -> int:
    """The holder's side of one pair: every piece is received (so the pair stays in step),
    checked and written under a temp name; the replica is committed (tables, manifest, marker
    last) only if all of it came intact, else emptied and the reason raised."""
    import torch
    import torch.distributed as dist

    owner = check_node_name(owner, directory)
    problem: str | None = None
    copied, replica_dir = 0, None
    # a failure here (a full disk) still receives every piece: the owner's sends and both ranks'
    # later collectives stay in step, and the failure is told to both, not waited on
    try:
        make_private_dir(os.path.join(directory, REPLICAS_DIR))
        replica_dir = make_private_dir(os.path.join(directory, REPLICAS_DIR, owner))
        clear_replica(replica_dir)
    except OSError as exc:
        problem = f"cannot make the replica directory of node {owner} here: {type(exc).__name__}: {exc}"

    def check_and_write(fd: int, record: FileRecord, piece: Any, buffer: Any) -> int:
        data = memoryview(buffer.numpy()).cast("B")  # numpy's buffer stub before 3.12
        verify_piece(record, piece.offset, data, f"{record.name} from node {owner}")
        pwrite_all(fd, data, piece.offset)
        return piece.length

    # each piece is checked and written on a thread while the next one comes
    with ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-replica-write") as pool:
        pending: Future | None = None

        def settle() -> None:
            nonlocal pending, problem, copied
            if pending is not None:
                try:
                    copied += pending.result()
                except (ChecksumMismatchError, OSError) as exc:
                    problem = problem or f"{type(exc).__name__}: {exc}"
                pending = None

        for record in records:
            fd, temp = -1, ""
            if problem is None and replica_dir is not None:
                temp = os.path.join(replica_dir, f".{record.name}.fetch-{secrets.token_hex(4)}")
                try:
                    fd = create_no_follow(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except OSError as exc:
                    problem = f"cannot write {record.name} from node {owner} here: {type(exc).__name__}: {exc}"
            try:
                for piece in plan_pieces(record.size, record.data_start, record.checksum_block, PIECE):
                    status = torch.zeros(1, dtype=torch.int64)
                    dist.recv(status, owner_rank, group=group)
                    if not status.item():
                        problem = problem or f"node {owner} holds a damaged {record.name} [{piece.offset}, " \
                                             f"{piece.offset + piece.length})"
                        continue
                    buffer = torch.empty(piece.length, dtype=torch.uint8)
                    dist.recv(buffer, owner_rank, group=group)
                    settle()
                    if problem is None:
                        pending = pool.submit(check_and_write, fd, record, piece, buffer)
                settle()
                if problem is None:
                    try:
                        os.fsync(fd)
                    except OSError as exc:
                        problem = f"cannot write {record.name} from node {owner} here: {type(exc).__name__}: {exc}"
            finally:
                settle()
                if fd >= 0:
                    os.close(fd)
            if problem is None and replica_dir is not None:
                try:
                    os.replace(temp, os.path.join(replica_dir, record.name))
                except OSError as exc:
                    problem = f"cannot write {record.name} from node {owner} here: {type(exc).__name__}: {exc}"
    if problem is not None or replica_dir is None:
        if replica_dir is not None:
            clear_replica(replica_dir)
        raise ManifestError(problem or f"no replica directory of node {owner}")
    local = LocalStore(directory)
    manifest_bytes = local.read(MANIFEST, MAX_MANIFEST)
    tables = [(entry["name"], local.read(entry["name"])) for _, entry in tables_of(manifest.doc)]
    write_metadata(replica_dir, manifest_bytes, tables)
    listed = {record.name: record.size for record in records}
    listed.update({name: len(data) for name, data in tables})
    write_small(replica_dir, REPLICA_MARKER, json.dumps({
        "node": owner, "save_key": key, "files": listed, "from": f"node {owner}",
        "committed_unix": time.time()}).encode())  # the commit: written last
    return copied
