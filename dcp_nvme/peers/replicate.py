"""A second copy of each node's files on a peer's NVMe, pulled in the background after the commit.

After a node-local save commits on node i (``save.node_commit``), node i's node writer
serves the checkpoint (``peers.server``, address and token in the job's store), and
its *replication* thread pulls, from each node whose replica it holds (``placement``), that
node's rank files, tables and manifest into ``<checkpoint>/.replicas/<node>/``: every piece
checked against the blocks table as it arrives (a damaged byte is never written), each file
fsynced under a temp name and renamed, and the marker ``replica.json`` written last. A replica
without its marker is never used and is removed by the next pull. Then the thread waits for the
nodes that hold *its* replicas to say they committed, and records them in
``<checkpoint>/.replication.json`` (``replication_state``; ``dcp-nvme status``).

The thread never raises into the save: every failure ends as a line in the record and a
warning; ``NVMeWriter.replication_future`` resolves to a ``ReplicationResult`` either way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dcp_nvme.errors import InvalidInputError, ManifestError
from dcp_nvme.format.container import (
    MANIFEST,
    REPLICA_MARKER,
    REPLICAS_DIR,
    REPLICATION_RECORD,
    check_node_name,
    rank_of,
)
from dcp_nvme.format.manifest import MAX_MANIFEST, read_files, read_manifest
from dcp_nvme.host.files import make_private_dir, read_regular
from dcp_nvme.host.job import job_store
from dcp_nvme.peers.client import (
    Limiter,
    PeerSource,
    fetch_file,
    fetch_metadata,
    server_address,
    write_metadata,
    write_small,
)
from dcp_nvme.peers.server import process_server, replica_files
from dcp_nvme.storage.local_dir import LocalStore

log = logging.getLogger(__name__)

TIMEOUT = 1800.0
"""Seconds a pull waits for its peer to serve, and a node for its replicas to be confirmed."""
_POLL_MAX = 0.2


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


# --------------------------------------------------------------------------- one pull


def clear_replica(replica_dir: str) -> None:
    """Uncommit (marker first), then remove everything a replica directory holds."""
    try:
        os.unlink(os.path.join(replica_dir, REPLICA_MARKER))
    except OSError:
        pass
    try:
        names = os.listdir(replica_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(replica_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            pass


def pull_replica(source: PeerSource, directory: str, owner: str, key: str, *, queue_depth: int = 8,
                 block_size: int = 8 << 20, bandwidth: float | None = None) -> int:
    """Copy node ``owner``'s files of save ``key`` from ``source`` into
    ``directory/.replicas/<owner>/`` and commit them there (marker last). Returns the bytes
    copied; on any failure the directory is left without a marker and emptied, and it raises."""
    owner = check_node_name(owner, directory)
    make_private_dir(os.path.join(directory, REPLICAS_DIR))
    replica_dir = make_private_dir(os.path.join(directory, REPLICAS_DIR, owner))
    clear_replica(replica_dir)
    try:
        manifest_bytes, tables, manifest = fetch_metadata(source, replica_dir)
        if manifest.save_key != key:
            raise ManifestError(f"{source.describe(MANIFEST)} holds save {manifest.save_key}, not {key}")
        names = manifest.files_by_node().get(owner, [])
        if not names:
            raise ManifestError(f"the manifest of save {key} names no files of node {owner}")
        records = read_files(None, manifest, replica_dir)  # already read and checked
        limiter, copied = Limiter(bandwidth), 0
        for name in names:
            copied += fetch_file(source, records[name], replica_dir, queue_depth=queue_depth,
                                 block_size=block_size, limiter=limiter)
        write_metadata(replica_dir, manifest_bytes, tables)
        listed = {name: records[name].size for name in names}
        listed.update({name: len(data) for name, data in tables})
        write_small(replica_dir, REPLICA_MARKER, json.dumps({
            "node": owner, "save_key": key, "files": listed, "from": source.describe(),
            "committed_unix": time.time()}).encode())  # the commit: written last
        return copied
    except BaseException:
        clear_replica(replica_dir)
        raise
    finally:
        source.close()


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


def _serve(store: Any, directory: str, node: str, key: str) -> None:
    try:
        server = process_server(server_address())
        server.register(directory)
        store.set(f"peers/{node}", json.dumps(server.info()).encode())
        store.set(f"{key}/served/{node}", b"ok")
    except Exception as exc:  # noqa: BLE001  its pullers are told at once, not left waiting
        why = f"node {node} cannot serve its files: {type(exc).__name__}: {exc}"[:500]
        log.warning("dcp_nvme: %s", why)
        store.set(f"{key}/served/{node}", why.encode())


def _wait(store: Any, key: str, deadline: float) -> bytes | None:
    pause = 0.005
    while True:
        if store.check([key]):
            return store.get(key)
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)


def start_replication(directory: str, node: str, copies: int, *, queue_depth: int = 8,
                      block_size: int = 8 << 20, bandwidth: float | None = None, stride: int = 1,
                      timeout: float = TIMEOUT, store: Any = None) -> Future:
    """Serve this node's committed copy and start its replication thread; returns its Future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(_replicate(store, directory, node, copies, queue_depth,
                                         block_size, bandwidth, stride, timeout))
        except BaseException as exc:  # noqa: BLE001  never into the save: logged, and in the Future
            log.warning("dcp_nvme: node %s: replication of %s failed: %s", node, directory, exc)
            future.set_exception(exc)

    threading.Thread(target=run, name=f"dcp-nvme-replicate-{node}", daemon=True).start()
    return future


def _replicate(store: Any, directory: str, node: str, copies: int, queue_depth: int, block_size: int,
               bandwidth: float | None, stride: int, timeout: float) -> ReplicationResult:
    began = time.perf_counter()
    manifest = read_manifest(LocalStore(directory), directory)
    key = manifest.save_key
    result = ReplicationResult(node, key)
    nodes = (manifest.doc.get("topology") or {}).get("nodes") or []
    if not manifest.node_local:
        result.warning = "the checkpoint is in one shared directory: there is no node's disk to replicate"
        log.info("dcp_nvme: %s: %s", directory, result.warning)
        return result
    store = store if store is not None else job_store()
    targets, sources, result.warning = placement(list(nodes), node, copies, stride)
    if result.warning:
        log.warning("dcp_nvme: %s", result.warning)
    enough = held_enough(manifest, copies)  # the same on every node: the manifest's
    targets = [] if node in enough else targets
    sources = [owner for owner in sources if owner not in enough]
    if node in enough:
        result.already_held = True
        log.info("dcp_nvme: %s: every item of node %s's files is on %d other node(s) already: no replica "
                 "of them is made", directory, node, copies)
    if not sources and not targets:
        _write_record(directory, {"save_key": key, "state": "held", "targets": [], "replicated_on": [],
                                  "failed": {}})
        result.seconds = time.perf_counter() - began
        return result  # nothing to pull, nobody pulls from here: no server started
    if targets:  # this node's copy served to the nodes that pull it (none: no server at all)
        _serve(store, directory, node, key)
    record = {"save_key": key, "state": "replicating", "targets": targets, "replicated_on": [], "failed": {}}
    _write_record(directory, record)
    deadline = time.monotonic() + timeout
    for owner in sources:
        why = "ok"
        try:
            served = _wait(store, f"{key}/served/{owner}", deadline)
            if served is None:
                raise TimeoutError(f"node {owner} did not serve save {key} within {timeout:.0f} s")
            if served != b"ok":
                raise ConnectionError(served.decode(errors="replace"))
            info = json.loads(store.get(f"peers/{owner}"))
            result.bytes += pull_replica(PeerSource(info, directory, "", owner), directory, owner, key,
                                         queue_depth=queue_depth, block_size=block_size, bandwidth=bandwidth)
            log.info("dcp_nvme: node %s holds a verified replica of node %s's files of %s", node, owner, directory)
        except Exception as exc:  # noqa: BLE001  recorded, and told to the owner
            why = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("dcp_nvme: node %s: replica of node %s's files of %s not made: %s", node, owner,
                        directory, why)
        result.pulled[owner] = why
        store.set(f"{key}/replicated/{owner}/{node}", why.encode())
    for holder in targets:
        said = _wait(store, f"{key}/replicated/{node}/{holder}", deadline)
        if said == b"ok":
            result.replicated_on.append(holder)
        else:
            result.failed[holder] = "no answer" if said is None else said.decode(errors="replace")
        record.update(replicated_on=result.replicated_on, failed=result.failed)
        _write_record(directory, record)
    record["state"] = "replicated" if result.replicated_on else ("failed" if targets else "none")
    _write_record(directory, record)
    result.seconds = time.perf_counter() - began
    return result
