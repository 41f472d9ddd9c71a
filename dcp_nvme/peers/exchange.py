"""Bytes between nodes over the job's own distributed engine: no server of ours, no socket.

A restore runs inside ``dcp.load`` on every rank, so the ranks agree, with collectives on a gloo
group of their own, on what each node's disk holds and who sends what to whom:

- ``agree_metadata`` (in ``read_metadata``): every rank says its node, the save its node's
  manifest commits and the data files there (``NodeView``). The ranks agree on one save: nodes
  that hold different saves at one path are refused (a restart never loads one model from two
  steps). A node without a valid manifest gets it and its tables from the lowest rank that has
  one, checks them like any other, and keeps them.
- ``move_ranges`` (in ``read_data``): every rank names the chunks its items need that its node lacks,
  each with its places -- the index's, then its copies' -- as spans of whole checksum blocks.
  Each is asked of a rank of another node that holds the first place any node holds, the least
  loaded first. Every pair of ranks streams its transfers on a thread of each (``peers.streams``),
  in pieces of whole checksum blocks: the holder reads and checks the next piece against the
  blocks table while others are on the wire; the receiver checks each again and keeps it while
  the next comes. A range that fails either check goes to the next holder, then to the next
  place, and a warning names the node that had it damaged. What no node holds comes from the
  mirror, if the load has one, else the load fails naming the file, the range and the node
  that wrote it. A chunk that several ranks of one node need comes once, to the first of them. Received ranges land at their own offsets
  in a sparse file in the checkpoint's ``.ranges/``, which the node keeps, with a record of
  them written once they are on disk (``peers.kept.KeptRanges``): the next restart on
  this node reads them there. The load that asked copies what came to its rank from memory
  (``ReceivedBytes``, within a budget) instead of reading back what it just wrote.

The group is its own (made once per process, by every rank at the same point of its first
restore): the transfers never interleave with the training group's collectives, and a peer that
dies fails the collective, as it would fail the training group, and the job restarts.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from dcp_nvme.compat import new_gloo_group
from dcp_nvme.errors import CheckpointNotFoundError, DCPNVMeError, ManifestError
from dcp_nvme.format.container import MANIFEST, RANGES_DIR, REPLICAS_DIR, save_key_of, tables_of
from dcp_nvme.format.manifest import Manifest, read_files, read_manifest
from dcp_nvme.format.pieces import Span
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import fsync_dir, open_regular, pwrite_all
from dcp_nvme.host.job import node_identity
from dcp_nvme.host.threads import in_background
from dcp_nvme.peers import mirror_reads, streams
from dcp_nvme.peers.fetching import (
    MemoryStore,
    MirrorSource,
    check_this_checkpoint,
    fetch_metadata,
    journal_restored,
    replica_files,
    write_metadata,
)
from dcp_nvme.peers.kept import ReceivedBytes, keep_spans, kept_file
from dcp_nvme.peers.sources import mirror_source, node_turn
from dcp_nvme.storage.local_dir import LocalStore, drop_kept

log = logging.getLogger(__name__)

SYNC_EVERY = 64 << 20
"""What came is flushed to disk after every this many bytes kept, while the rest still comes."""

_group: Any = None


def active() -> bool:
    """Whether this load runs on several ranks of an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _exchange_group() -> Any:
    global _group
    if _group is None:
        _group = new_gloo_group()  # the job's timeout: a peer that stops answering fails the restore
    return _group


@dataclass(frozen=True)
class NodeView:
    """What one rank tells the others of its node's disk."""

    node: str
    save_key: str | None
    files: frozenset[str]
    problem: str | None = None


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=_exchange_group())
    return out


def _held_here(path: str) -> dict[str, str]:
    """The data files this node holds, name -> where: its own directory's, then those of the
    complete replicas it keeps of other nodes (``.replicas/<node>/``, marker written)."""
    found: dict[str, str] = {}
    try:
        names = LocalStore(path).names()
    except FileNotFoundError:
        return found
    for name in names:
        if name.startswith("rank_") and save_key_of(name):
            found[name] = os.path.join(path, name)
    try:
        holders = sorted(os.listdir(os.path.join(path, REPLICAS_DIR)))
    except OSError:
        holders = []
    for holder in holders:
        for name in replica_files(path, holder) or {}:
            if name.startswith("rank_"):
                found.setdefault(name, os.path.join(path, REPLICAS_DIR, holder, name))
    return found


def no_mirror() -> MirrorSource | None:
    """The mirror of a load that has none."""
    return None


def agree_metadata(path: str, mirror: Callable[[], MirrorSource | None] = no_mirror) -> list[NodeView]:
    """Collective: every rank calls it once per load. Returns each rank's view (its files those
    of the agreed save); this node's directory then holds that save's manifest and tables --
    from a node that has them, else from the mirror (``mirror()``: asked only then)."""
    local = LocalStore(path)
    key, problem = None, None
    try:
        manifest = read_manifest(local, path)
        read_files(local, manifest, path)
        key = manifest.save_key
    except (DCPNVMeError, OSError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    views: list[NodeView] = _gather(NodeView(node_identity(), key, frozenset(_held_here(path)), problem))
    keys = sorted({v.save_key for v in views if v.save_key})
    if len(keys) > 1:
        where = "; ".join(f"save {k} on node(s) {', '.join(sorted({v.node for v in views if v.save_key == k}))}"
                          for k in keys)
        raise ManifestError(f"{path}: the nodes hold different saves ({where}); a restart loads one step on "
                            "every rank: load a step every node committed, or remove the newer one")
    if not keys:
        why, source = None, mirror()
        if source is None:
            why = f"no node holds a committed manifest of it and the load has no mirror ({views[0].problem})"
        else:
            try:
                manifest_bytes, tables, manifest = fetch_metadata(source, source.describe())
                held_keys = {k for v in views for name in v.files if (k := save_key_of(name))}
                check_this_checkpoint(manifest, path, held_keys, source.describe(MANIFEST))
                _keep_metadata(path, (manifest_bytes, tables), manifest.save_key, source.describe(), problem)
                journal_restored(path, source, manifest.save_key)
                key = manifest.save_key
            except (DCPNVMeError, OSError) as exc:
                why = f"no node holds a committed manifest of it, nor does the mirror ({exc})"
        agreed = _gather((key, why))
        _raise_first(path, [w for _, w in agreed])
        keys = sorted({k for k, _ in agreed if k})
        if len(keys) != 1:
            raise ManifestError(f"{path}: the ranks read different saves from the mirror: {keys}")
        return [replace(v, save_key=keys[0], files=frozenset(f for f in v.files if save_key_of(f) == keys[0]))
                for v in views]
    if any(v.save_key is None for v in views):
        sender = min(rank for rank, v in enumerate(views) if v.save_key)
        payload: list[Any] = [_metadata_payload(local) if dist.get_rank() == sender else None]
        dist.broadcast_object_list(payload, src=sender, group=_exchange_group())
        why = None
        if key is None:
            try:
                _keep_metadata(path, payload[0], keys[0], views[sender].node, problem)
            except (DCPNVMeError, OSError) as exc:
                why = f"{type(exc).__name__}: {exc}"
        _raise_first(path, _gather(why))  # every rank hears it: none waits in read_data for this one
    return [replace(v, files=frozenset(f for f in v.files if save_key_of(f) == keys[0])) for v in views]


def _metadata_payload(store: LocalStore) -> tuple[bytes, list[tuple[str, bytes]]]:
    manifest_bytes = store.read(MANIFEST)
    doc = json.loads(manifest_bytes)
    return manifest_bytes, [(entry["name"], store.read(entry["name"])) for _, entry in tables_of(doc)]


def _keep_metadata(path: str, payload: Any, key: str, node: str, problem: str | None) -> None:
    """Check what ``node`` (a node, or the mirror) sent as a whole, then write it here (once a node)."""
    try:
        manifest_bytes, tables = payload
        files = {MANIFEST: bytes(manifest_bytes), **{str(n): bytes(d) for n, d in tables}}
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"{path}: the metadata node {node} sent is malformed: {exc}") from None
    store = MemoryStore(files, f"{path} (from node {node})")
    manifest = read_manifest(store, store.location)
    read_files(store, manifest, store.location)
    if manifest.save_key != key:
        raise ManifestError(f"{path}: node {node} sent save {manifest.save_key}, the nodes agreed on {key}")
    os.makedirs(path, exist_ok=True)
    with node_turn(path, MANIFEST):
        local = LocalStore(path)
        try:
            if read_manifest(local, path).save_key == key:
                return  # another rank of this node kept it meanwhile
        except (DCPNVMeError, OSError):
            pass
        write_metadata(path, manifest_bytes, [(n, files[n]) for n in files if n != MANIFEST])
    source = node if "/" in node else f"node {node}"
    if problem is None or problem.startswith(f"{CheckpointNotFoundError.__name__}:"):
        log.warning("dcp_nvme: %s: this node held no manifest of the step, so the one from %s was written "
                    "in its place", path, source)
    else:
        log.warning("dcp_nvme: %s: this node's manifest could not be used (%s), so the one from %s was written "
                    "in its place", path, problem, source)


class Arrivals:
    """One load's received ranges, kept in this node's ``.ranges/`` (``peers.kept``)."""

    def __init__(self, directory: str, hold: ReceivedBytes | None = None) -> None:
        self.checkpoint = directory
        self.hold = hold
        """Where the load that asked holds what came, to copy it into its tensors."""
        self._unsynced = 0
        self._flushing: Future[None] | None = None
        self._kept: dict[str, str] = {}
        """File name -> its kept-ranges file, made at the first range that came of it."""
        self.taken: dict[str, dict[str, float]] = {}
        self.chosen: list[int] = []
        """For each of this rank's asks, which of its places came (0: the index's)."""
        self.arrived: list[list[Span]] = []
        """For every rank, the spans that came to it (the same on every rank); an ask another
        rank of its node made too came once, to the first of them."""
        self.damaged: list[str] = []
        """The ranges a holder could not send intact to this rank, and which node held them."""

    def keep(self, record: FileRecord, start: int, data: memoryview, kind: str) -> None:
        if record.name not in self._kept:
            self._kept[record.name] = kept_file(self.checkpoint, record)
        fd = open_regular(self._kept[record.name], os.O_WRONLY)
        try:
            pwrite_all(fd, data, start)
        finally:
            os.close(fd)
        self._unsynced += len(data)
        if self._unsynced >= SYNC_EVERY and (self._flushing is None or self._flushing.done()):
            # on disk as it comes, so that the fsync before the record is short; on a thread, so
            # that a slow flush never stalls what comes meanwhile
            self._flushing = in_background(functools.partial(_flush, self._kept[record.name]), "dcp-nvme-flush")
            self._unsynced = 0
        if self.hold is not None:
            self.hold.add(record.name, start, data)
        entry = self.taken.setdefault(kind, {"files": 0, "bytes": 0, "seconds": 0.0})
        entry["bytes"] += len(data)

    def adopt(self, name: str) -> None:
        """Move a received file into the checkpoint directory: the caller asked for all of it,
        so every byte arrived and was checked (this node keeps its own ranks' files)."""
        kept = os.path.join(self.checkpoint, RANGES_DIR, name)
        fd = open_regular(kept, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(kept, os.path.join(self.checkpoint, name))
        fsync_dir(self.checkpoint)
        drop_kept(self.checkpoint, lambda kept_name: kept_name != name)


def _flush(path: str) -> None:
    """What was written to ``path`` so far, to disk (a failure shows in the fsync before the record)."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def move_ranges(path: str, views: list[NodeView], manifest: Manifest, asks: Sequence[tuple[Span, ...]],
          mirror: Callable[[], MirrorSource | None] = no_mirror, problem: str | None = None,
          optional: bool = False, hold: ReceivedBytes | None = None) -> Arrivals:
    """Collective: every rank calls it in ``read_data``, with what its node lacks ([] when
    none) and any error it hit before (then every rank raises, none waits for it).

    An ask is one chunk's places, the index's first, then its copies: each a span of whole
    checksum blocks. The first place some other node holds is asked of its least-loaded
    holder; a transfer that fails its check goes to the next holder, then to the next place;
    what no node holds comes from the mirror (``mirror()``: asked only then). ``Arrivals.chosen``
    says, for each of this rank's asks, which place came; ``Arrivals.arrived``, for every rank, the
    spans that came to it. With ``optional``, an ask nothing can serve is left out instead of
    failing the load; ``hold`` keeps in memory what came to this rank (within its budget)."""
    me, world = dist.get_rank(), dist.get_world_size()
    out = Arrivals(path, hold)
    asked: list[tuple[list[tuple[Span, ...]], str | None]] = _gather((list(asks) if problem is None else [],
                                                                      problem))
    _raise_first(path, [why for _, why in asked])
    out.chosen = [0] * len(asks)
    out.arrived = [[] for _ in range(world)]
    if not any(own for own, _ in asked):  # no rank lacks anything: nothing moves, nothing to record
        if me == min(_node_ranks(views, me)):
            drop_kept(path, lambda name: save_key_of(name) == manifest.save_key)
        return out
    records = read_files(LocalStore(path), manifest, path)
    pending, follows = _first_asks(asked, views)
    placed: dict[tuple[int, int], int] = {}
    refused: set[tuple[int, Span, int]] = set()
    here = _held_here(path)
    while pending:
        assigned: list[streams.Transfer] = []
        nowhere, load = [], [0] * world
        for needer, index in pending:
            picked = _holder(asked[needer][0][index], needer, views, refused, load)
            if picked is None:
                nowhere.append((needer, index))
                placed[(needer, index)] = 0  # the mirror holds every file: the index's place
                continue
            place, holder = picked
            span = asked[needer][0][index][place]
            load[holder] += span.length
            assigned.append(streams.Transfer(needer, index, span, holder))
            placed[(needer, index)] = place
        if nowhere:
            _nowhere(path, manifest, records, asked, nowhere, mirror, optional, out)
        bad = _transfer(path, assigned, records, views, here, out) if assigned else []
        failed = {(f.transfer.needer, f.transfer.index) for f in bad}
        for transfer in assigned:
            if (transfer.needer, transfer.index) not in failed:
                out.arrived[transfer.needer].append(transfer.span)
        refused.update((f.transfer.needer, f.transfer.span, f.transfer.holder) for f in bad)
        for f in bad:
            span, node = f.transfer.span, views[f.transfer.holder].node
            if f.transfer.needer == me:
                out.damaged.append(f"{span.file} [{span.start}, {span.end}) from node {node}: {f.why}")
                log.warning("dcp_nvme: %s: node %s could not send %s [%d, %d) intact (%s); asking the "
                            "next holder", path, node, span.file, span.start, span.end, f.why)
        pending = [(f.transfer.needer, f.transfer.index) for f in bad]
    for (needer, index), first in list(placed.items()) + [(ask, placed.get(lead, 0))
                                                          for ask, lead in follows.items()]:
        if needer == me:
            out.chosen[index] = first
    _keep_record(path, views, records, out, manifest.save_key)
    return out


def _node_ranks(views: list[NodeView], rank: int) -> list[int]:
    """The ranks on ``rank``'s node (by the views: one node name each)."""
    return [other for other, view in enumerate(views) if view.node == views[rank].node]


def _first_asks(asked: list, views: list[NodeView]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], tuple[int, int]]]:
    """The asks to serve -- each chunk once per node, for the first of its ranks that asks it
    (the others read what came to their node's disk) -- and, for each other ask, that first one."""
    first: dict[tuple[str, tuple[Span, ...]], tuple[int, int]] = {}
    pending, follows = [], {}
    for needer, (own, _) in enumerate(asked):
        for index, places in enumerate(own):
            lead = first.setdefault((views[needer].node, tuple(places)), (needer, index))
            if lead == (needer, index):
                pending.append(lead)
            else:
                follows[(needer, index)] = lead
    return pending, follows


def _keep_record(path: str, views: list[NodeView], records: dict[str, FileRecord], out: Arrivals,
                 key: str) -> None:
    """The first rank of each node records the ranges its node's ranks received, once they are
    on disk (a later load reads them there), and drops those another save left; every rank
    hears how it went."""
    me = dist.get_rank()
    mine = _node_ranks(views, me)
    why = None
    if me == min(mine):
        spans: dict[str, list[tuple[int, int]]] = {}
        for rank in mine:
            for span in out.arrived[rank]:
                spans.setdefault(span.file, []).append((span.start, span.end))
        try:
            drop_kept(path, lambda name: save_key_of(name) == key)
            for name, ranges in sorted(spans.items()):
                keep_spans(path, records[name], ranges)
        except (OSError, DCPNVMeError) as exc:
            why = f"cannot keep the ranges that came to node {views[me].node}: {type(exc).__name__}: {exc}"
    _raise_first(path, _gather(why))


def _nowhere(path: str, manifest: Manifest, records: dict[str, FileRecord], asked: list, nowhere: list[tuple[int, int]],
             mirror: Callable[[], MirrorSource | None], optional: bool, out: Arrivals) -> None:
    """The asks no node can serve (every rank knows which): their needers read the mirror,
    then every rank hears how it went (an optional ask that fails is left out)."""
    me = dist.get_rank()
    source = mirror()
    mine = [(index, asked[needer][0][index][0])  # the mirror holds every file: the index's place
            for needer, index in nowhere if needer == me and not (optional and source is None)]
    why, got = mirror_reads.from_mirror(manifest, records, mine, source, optional, out)
    reports = _gather((why, got))
    _raise_first(path, [w for w, _ in reports])
    for rank, (_, spans) in enumerate(reports):
        out.arrived[rank] += spans


def _holder(places: tuple[Span, ...], needer: int, views: list[NodeView], refused: set[tuple[int, Span, int]],
            load: list[int]) -> tuple[int, int] | None:
    """(place, holder rank) for one ask: the first place a node other than the needer's holds,
    not yet refused, on its least-loaded holder; None when no node holds any."""
    for place, span in enumerate(places):
        holders = [r for r, v in enumerate(views) if span.file in v.files
                   and v.node != views[needer].node and (needer, span, r) not in refused]
        if holders:
            return place, min(holders, key=lambda r: (load[r], r))
    return None


def _raise_first(path: str, problems: Sequence[str | None]) -> None:
    """Every rank raises the first rank's problem, so that none waits in a later collective."""
    for rank, why in enumerate(problems):
        if why:
            raise DCPNVMeError(f"{path}: the restore stopped on rank {rank}: {why}")


@dataclass(frozen=True)
class Failed:
    """A transfer that failed, and why: its holder could not read it intact, or it failed its
    check on arrival."""

    transfer: streams.Transfer
    why: str


def _transfer(path: str, assigned: list[streams.Transfer], records: dict[str, FileRecord],
              views: list[NodeView], here: dict[str, str], out: Arrivals) -> list[Failed]:
    """Every transfer, wave by wave; then every rank hears which failed on each rank, and every
    rank returns them."""
    outcome = streams.WaveOutcome()
    nodes = [view.node for view in views]

    def keep(record: FileRecord, at: int, data: memoryview) -> None:
        out.keep(record, at, data, "peer")

    for tag, wave in enumerate(streams.waves(assigned)):
        outcome.add(streams.run_wave(_exchange_group(), tag, [(slot, assigned[slot]) for slot in wave], records,
                                     nodes, here, keep, halted=outcome.fatal is not None))
    reports: list[streams.WaveOutcome] = _gather(outcome)
    _raise_first(path, [report.fatal for report in reports])
    bad: dict[int, str] = {}
    for report in reports:
        bad.update(report.refused)  # as the holder
        bad.update(report.damaged)  # as the receiver
    return [Failed(assigned[slot], why) for slot, why in sorted(bad.items())]


class PeerRestore:
    """A load's restore over the exchange group: ``agree_metadata`` in ``read_metadata``,
    ``move_ranges`` in ``read_data``, on every rank (``peers.restore.ManyRankRestore``)."""

    def __init__(self, path: str, mirror: str | None, mirror_options: dict[str, Any] | None) -> None:
        self.path = path
        # opened on a thread (importing an object store's client takes a second on a busy node):
        # most restores never ask the mirror, and one that does asks it while DCP plans
        self._mirror = None if mirror is None else in_background(
            lambda: mirror_source(path, mirror, mirror_options), "dcp-nvme-open-mirror")
        self.views: list[NodeView] = []

    def mirror(self) -> MirrorSource | None:
        """The mirror as a source, once it is open (None: the load has none, or it cannot be read)."""
        return None if self._mirror is None else self._mirror.result()

    def agree_metadata(self) -> None:
        self.views = agree_metadata(self.path, self.mirror)

    def held_anywhere(self) -> set[str]:
        """The data files some node of this job holds (its own, or a replica)."""
        return set().union(*(v.files for v in self.views))

    def move_ranges(self, manifest: Manifest, asks: Sequence[tuple[Span, ...]], problem: str | None = None,
                    optional: bool = False, hold: ReceivedBytes | None = None) -> Arrivals:
        return move_ranges(self.path, self.views, manifest, asks, self.mirror, problem, optional, hold)

    def settle(self, problem: str | None) -> None:
        """Collective: every rank raises the first rank's problem, if any (after a step some
        ranks did alone, so that none reads before it is done and all fail alike)."""
        _raise_first(self.path, _gather(problem))

    def node_ranks(self) -> list[int]:
        """The ranks of this node (by the views: one node name each)."""
        return _node_ranks(self.views, dist.get_rank())

