"""A load's restore from the other copies of its checkpoint (``seams.restore``: the reader holds
one and calls it in a few places; ``seams.Restore`` is what it uses).

``OneProcessRestore``: a load in one process takes the metadata and each file this node lacks or
holds damaged from the nearest copy that verifies (``peers.sources``: a replica here, the mirror).

``ManyRankRestore``: a load on several ranks (``NVMeReader(peers=True)`` in a process group), over
the exchange of ``peers.exchange``. The ranks agree on the save in ``read_metadata``; then it
starts the restore of a replacement node's own files on a thread at once (they need no load plan,
so they come while DCP plans), holds what comes to this rank in memory (``ReceivedBytes``, up to
``RECEIVED_HOLD``) for the load to copy into its tensors instead of reading back what it just
wrote (even while the rest still comes), and counts what came per source. In ``read_data``
(``bring_in``) this node's own files are read on a thread while the exchange runs, and the chunks
this node's disk lacks (``lacking_asks``) come from the nodes that hold them.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy
import torch

from dcp_nvme.config import IOConfig
from dcp_nvme.engines.requests import SCRATCH, IOStats, PhaseTimer, ReadRequest
from dcp_nvme.errors import ChecksumMismatchError
from dcp_nvme.format.copies import places_of
from dcp_nvme.format.manifest import Manifest, read_files
from dcp_nvme.format.pieces import Span, plan_pieces, span_of
from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.host.job import node_identity
from dcp_nvme.host.threads import in_background
from dcp_nvme.peers import exchange
from dcp_nvme.peers.kept import KeptRanges, ReceivedBytes
from dcp_nvme.peers.sources import RestoreSources
from dcp_nvme.seams import Brought, Wanted
from dcp_nvme.storage.local_dir import Store

RESTORE_PIECE = 64 << 20
"""A replacement node asks for its own ranks' files in pieces of about this many bytes."""

RECEIVED_HOLD = 1 << 30
"""A restore holds at most this many of the bytes that came to a rank in memory, for its load
to copy into the tensors; beyond, it reads them back from the copy it kept on disk."""


def open_restore(path: str, node: str, mirror: str | None, mirror_options: dict[str, Any] | None,
                 config: IOConfig) -> OneProcessRestore | ManyRankRestore:
    """The restore of a load given a mirror or peers (``seams.restore``): over the exchange on
    several ranks, from the nearest copy in one process."""
    if exchange.active():
        return ManyRankRestore(path, mirror, mirror_options)
    return OneProcessRestore(path, node, mirror, mirror_options, config)


def sources_stats(sources: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``last_stats`` of a restore: the bytes that came from elsewhere, per source."""
    remote = sum(v["bytes"] for k, v in sources.items() if k not in ("read", "local", "damaged"))
    return {"remote_bytes": int(remote), **({"sources": sources} if sources else {})}


class OneProcessRestore:
    """A load's restore in one process: this disk, its replicas, the mirror (``peers.sources``)."""

    def __init__(self, path: str, node: str, mirror: str | None, mirror_options: dict[str, Any] | None,
                 config: IOConfig) -> None:
        self.sources = RestoreSources(path, node, mirror, mirror_options, config)
        self.manifest: Manifest | None = None

    def ensure_metadata(self) -> None:
        self.sources.ensure_metadata()

    def begin(self, store: Store, manifest: Manifest) -> None:
        self.manifest = manifest

    def held_anywhere(self) -> set[str] | None:
        return None  # no other node: only the copies this node holds

    def refuse(self, exc: BaseException) -> None:
        pass  # no other rank waits for this one

    def bring_in(self, wanted: Wanted, stats: IOStats, timer: PhaseTimer) -> Brought:
        """Each file this rank needs, here or from the nearest copy."""
        assert self.manifest is not None  # begin() came first
        with timer.span("fetch"):
            self.sources.ensure_files(self.manifest, {chunk.file for chunk in wanted.chunks})
        return Brought(wanted.items)

    def take_held(self, requests: list[ReadRequest], dests: list[torch.Tensor]) -> list[ReadRequest]:
        return requests

    def replace_damaged(self, exc: ChecksumMismatchError) -> bool:
        assert self.manifest is not None
        return self.sources.replace_damaged(self.manifest, exc)

    def kept_path(self, name: str) -> str | None:
        return None  # whole files are fetched, no ranges kept

    def finish(self) -> None:
        pass

    def stats(self, read: IOStats, read_seconds: float) -> dict[str, Any]:
        return sources_stats(self.sources.stats(read, read_seconds))


class ManyRankRestore:
    """A load's restore on several ranks, on this rank: over ``peers.exchange.PeerRestore``."""

    def __init__(self, path: str, mirror: str | None, mirror_options: dict[str, Any] | None) -> None:
        self.path = path
        self.exchange = exchange.PeerRestore(path, mirror, mirror_options)
        self.received: ReceivedBytes | None = ReceivedBytes(RECEIVED_HOLD)
        self.from_received = 0
        """Bytes the load copied from ``received`` instead of reading them."""
        self.came: dict[str, Any] = {}
        """Bytes received per source kind, and the damaged ranges this rank was offered."""
        self.kept: KeptRanges | None = None
        """The ranges of other nodes' files this node keeps: earlier restores', this one's."""
        self.here: set[str] = set()
        """The data files on this node's disk (the reader's, given to ``bring_in``)."""
        self.manifest: Manifest | None = None
        self.files: Mapping[str, FileRecord] = {}
        self._own: concurrent.futures.Future[set[str]] | None = None

    def ensure_metadata(self) -> None:
        self.exchange.agree_metadata()  # a replacement node's empty disk gets it from a peer

    def begin(self, store: Store, manifest: Manifest) -> None:
        """Once the ranks agreed on the save: a replacement node's own files come while DCP plans."""
        files = read_files(store, manifest, self.path)
        here = set(store.names())
        received = self.received
        assert received is not None
        self.manifest, self.files = manifest, files
        self._own = in_background(lambda: self._restore_own_files(files, manifest, here),
                                  "dcp-nvme-restore-own-files")
        self._own.add_done_callback(lambda _: received.wake())  # the load stops waiting for more at once

    def held_anywhere(self) -> set[str] | None:
        """The data files some node of this job holds (its own, or a replica)."""
        return self.exchange.held_anywhere()

    def own_files_came(self) -> set[str]:
        """Wait for the restore of this node's own files: its error is every rank's (every rank
        waits here before its next collective on the group). Returns the files that came whole."""
        own, self._own = self._own, None
        return own.result() if own is not None else set()

    def more_came(self, held: int) -> int | None:
        """While this node's own files come: wait briefly for more than ``held`` bytes to be held
        here, and return the bytes held; None once they came (or nothing is held)."""
        own = self._own
        if own is None or own.done() or self.received is None:
            return None
        return self.received.wait_beyond(held, timeout=0.05)

    def holds(self, record: FileRecord, chunk: ChunkRecord) -> bool:
        """Whether the whole checksum blocks of ``chunk`` came to this rank and are held."""
        span = span_of(record, chunk.byte_offset, chunk.byte_offset + chunk.length)
        return self.received is not None and self.received.take(span.file, span.start, span.length) is not None

    def finish(self) -> None:
        """Wait for a restore a failed load left running (without its error), so that the
        group's collectives keep one order on every rank; drop what is held."""
        if self._own is not None:
            concurrent.futures.wait([self._own])
        self.received = None

    def _restore_own_files(self, files: Mapping[str, FileRecord], manifest: Manifest, here: set[str]) -> set[str]:
        """Collective: a node that lacks its own ranks' files (a replacement node) gets them whole
        from a node that holds them (a replica) or the mirror, and keeps them: asked by the node's
        first rank, in pieces of whole checksum blocks; a file no one holds is left out (its
        chunks are then asked one by one, from their copies). Returns the files that came whole."""
        ranks = self.exchange.node_ranks()
        first = torch.distributed.get_rank() == min(ranks)
        lacking = [record for record in files.values()
                   if record.name not in here and manifest.node_of(record.rank) == node_identity()]
        asks = [(Span(record.name, piece.offset, piece.offset + piece.length),) for record in lacking
                for piece in plan_pieces(record.size, record.data_start, record.checksum_block, RESTORE_PIECE)
                ] if first else []
        arrivals = self.exchange.move_ranges(manifest, asks, optional=True, hold=self.received)
        came: dict[str, int] = {}
        for rank in ranks:
            for span in arrivals.arrived[rank]:
                came[span.file] = came.get(span.file, 0) + span.length
        whole = {name for name, nbytes in came.items() if nbytes == files[name].size}
        problem = None
        if first:
            try:
                for name in sorted(whole):
                    arrivals.adopt(name)
            except OSError as exc:
                problem = f"cannot keep the files that came to node {node_identity()}: {exc}"
        self.exchange.settle(problem)  # no rank of the node reads them before they are in place
        self.report(arrivals)
        return whole

    def bring_in(self, wanted: Wanted, stats: IOStats, timer: PhaseTimer) -> Brought:
        """Collective, on every rank, even one that needs nothing from elsewhere: what this node's
        disk holds is read on a thread while the exchange runs (a holder sends and loads at once,
        and the load ends with the last transfer); the items whose bytes came whole while this
        node's own files came are copied from memory; the chunks the rest need that this node
        lacks come from elsewhere. ``wanted.here`` grows by the files that came whole."""
        here = self.here = wanted.here
        pending = [(item, chunk) for item, chunk in zip(wanted.items, wanted.chunks) if chunk.file not in here]
        beside = [item for item, chunk in zip(wanted.items, wanted.chunks) if chunk.file in here]
        beside_stats, beside_timer = IOStats("read"), PhaseTimer()
        with ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-load-here") as pool:
            early = pool.submit(wanted.read, beside, beside_stats, beside_timer, False)
            with timer.span("fetch (own files, after DCP planned)"):
                pending = self.take_while_coming(pending, wanted, stats, timer)
                here |= self.own_files_came()  # this node's from now on
            with timer.span("fetch"):
                moved = self.fetch_elsewhere([chunk for _, chunk in pending], wanted)
        needed = early.result()
        stats.merge(beside_stats)
        for name, seconds in beside_timer.phases.items():
            timer.add(f"{name} (beside the exchange)", seconds)
        return Brought([item for item, _ in pending], needed, moved)

    def take_while_coming(self, pending: list[tuple[Any, ChunkRecord]], wanted: Wanted, stats: IOStats,
                          timer: PhaseTimer) -> list[tuple[Any, ChunkRecord]]:
        """While this node's own files come, the items whose bytes came to this rank whole go into
        their tensors from memory (the load ends soon after the last piece, not a copy of all
        later); returns the others."""
        held = 0
        while pending and (now := self.more_came(held)) is not None:
            if now == held:
                continue
            held = now
            ready = [self.holds(self.files[chunk.file], chunk) for _, chunk in pending]
            try:
                wanted.read([p[0] for p, r in zip(pending, ready) if r], stats, timer, True)
            except Exception:  # raised again where they are read after the exchange: no rank leaves it early
                break
            pending = [p for p, r in zip(pending, ready) if not r]
        return pending

    def fetch_elsewhere(self, chunks: list[ChunkRecord], wanted: Wanted) -> dict[tuple, ChunkRecord]:
        """Collective (``peers.exchange``): the chunks this node's disk lacks, from where they are
        held; returns where each is read afterwards (where it came to)."""
        assert self.manifest is not None  # begin() came first
        try:
            self.kept = KeptRanges(self.path, self.files)
            asks, where, kept_here = lacking_asks(chunks, wanted.here, self.manifest, wanted.storage_data,
                                                  self.files, self.kept, self.path)
        except Exception as exc:
            self.refuse(exc)
            raise
        moved = dict(kept_here)
        arrivals = self.exchange.move_ranges(self.manifest, asks, hold=self.received)
        self.report(arrivals)
        for places, chosen in zip(where, arrivals.chosen):  # read each where it came from
            place = places[chosen]
            moved[(place.fqn, place.offsets if place.kind == "tensor" else None)] = place
        self.kept = KeptRanges(self.path, self.files)
        return moved

    def refuse(self, exc: BaseException) -> None:
        """Collective: this rank cannot go on; every rank raises its error (after the own files,
        so that every rank's collectives keep one order)."""
        assert self.manifest is not None
        self.own_files_came()
        self.exchange.move_ranges(self.manifest, [], problem=f"{type(exc).__name__}: {exc}")

    def report(self, arrivals: exchange.Arrivals) -> None:
        """What came from elsewhere, per source kind, and what was damaged there (last_stats)."""
        for kind, entry in arrivals.taken.items():
            mine = self.came.setdefault(kind, {"files": 0, "bytes": 0, "seconds": 0.0})
            mine["bytes"] += entry["bytes"]
            mine["seconds"] += entry["seconds"]
        if arrivals.damaged:
            self.came.setdefault("damaged", []).extend(arrivals.damaged)

    def take_held(self, requests: list[ReadRequest], dests: list[torch.Tensor]) -> list[ReadRequest]:
        """The requests whose bytes came to this rank in this load and are held in memory (checked
        on arrival) are copied from there into their destinations; the others are returned, to read."""
        if self.received is None or not self.received.size:
            return requests
        rest = []
        for request in requests:
            views = self.received.take(os.path.basename(request.file), request.file_offset, request.length)
            if views is None:
                rest.append(request)
                continue
            copy_pieces(views, request.pieces, dests)
            self.from_received += request.length
        return rest

    def replace_damaged(self, exc: ChecksumMismatchError) -> bool:
        return False  # a damaged range of this node's disk fails the load

    def kept_path(self, name: str) -> str | None:
        """Where this node keeps ranges of ``name``, when it lacks the whole file."""
        return None if self.kept is None or name in self.here else self.kept.path(name)

    def stats(self, read: IOStats, read_seconds: float) -> dict[str, Any]:
        return {**sources_stats({"read": {"bytes": int(read.bytes)}, **self.came}),
                "from_received_bytes": self.from_received}


def lacking_asks(chunks: Iterable[ChunkRecord], here: set[str], manifest: Manifest, storage_data: Mapping,
                 files: Mapping[str, FileRecord], kept: KeptRanges, directory: str
                 ) -> tuple[list[tuple[Span, ...]], list[list[ChunkRecord]], dict[tuple, ChunkRecord]]:
    """What ``chunks`` (a rank's, each where it would be read) need that this node's disk lacks:
    (the asks, each its places' spans of whole checksum blocks -- the index's row, then its
    copies; each ask's places; the chunks an earlier restore already kept here, and where)."""
    lacking: dict[tuple, ChunkRecord] = {}
    for chunk in chunks:
        if chunk.file not in here:
            lacking.setdefault((chunk.fqn, chunk.offsets if chunk.kind == "tensor" else None), chunk)
    places = places_of(manifest, storage_data, set(lacking), directory)
    asks, where, kept_here = [], [], {}
    for key, chunk in lacking.items():
        spans = [(p, span_of(files[p.file], p.byte_offset, p.byte_offset + p.length)) for p in places.get(key, [chunk])]
        kept_place = next((p for p, span in spans if kept.covers(span)), None)
        if kept_place is not None:  # an earlier restore fetched it for this node
            kept_here[key] = kept_place
            continue
        asks.append(tuple(span for _, span in spans))
        where.append([p for p, _ in spans])
    return asks, where, kept_here


def copy_pieces(views: list[memoryview], pieces: list[tuple[int, int, int]], dests: list[torch.Tensor]) -> None:
    """A request's bytes, given as consecutive ``views``, into its pieces' destinations
    (``SCRATCH`` pieces are skipped)."""
    index, offset = 0, 0
    for dest, dest_offset, length in pieces:
        while length:
            view = views[index]
            n = min(length, len(view) - offset)
            if dest != SCRATCH:
                source = numpy.frombuffer(view, numpy.uint8, n, offset)
                if dests[dest].device.type == "cpu":
                    dests[dest].numpy()[dest_offset:dest_offset + n] = source
                else:  # a device tensor: one copy from host memory
                    dests[dest][dest_offset:dest_offset + n].copy_(torch.from_numpy(source))
                dest_offset += n
            length -= n
            offset += n
            if offset == len(view):
                index, offset = index + 1, 0

