"""The reader's side of a restore on many ranks: ``NVMeReader(peers=True)`` in a process group,
over the exchange of ``peers.exchange`` (reached through ``seams.peer_restore``).

``PeerLoad`` is made in ``read_metadata``, once the ranks agreed on the save: it starts the
restore of a replacement node's own files on a thread at once (they need no load plan, so they
come while DCP plans), holds what comes to this rank in memory (``ReceivedBytes``, up to
``RECEIVED_HOLD``) for the load to copy into its tensors instead of reading back what it just
wrote (even while the rest still comes: ``more_came``, ``holds``), and counts what came per
source. ``lacking_asks`` says what a rank's items need that its node's disk lacks, as the
exchange asks for it.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy
import torch

from dcp_nvme.engines.requests import SCRATCH
from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.pieces import Span, plan_pieces, span_of
from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.host.job import node_identity
from dcp_nvme.host.threads import in_background
from dcp_nvme.load.local_copies import KeptRanges, ReceivedBytes, places_of

RESTORE_PIECE = 64 << 20
"""A replacement node asks for its own ranks' files in pieces of about this many bytes."""

RECEIVED_HOLD = 1 << 30
"""A restore holds at most this many of the bytes that came to a rank in memory, for its load
to copy into the tensors; beyond, it reads them back from the copy it kept on disk."""


class PeerLoad:
    """One load's use of the exchange on this rank (``exchange``: ``peers.exchange.PeerRestore``)."""

    def __init__(self, exchange: Any, files: Mapping[str, FileRecord], manifest: Manifest, here: set[str]) -> None:
        self.exchange = exchange
        received = ReceivedBytes(RECEIVED_HOLD)
        self.received: ReceivedBytes | None = received
        self.from_received = 0
        """Bytes the load copied from ``received`` instead of reading them."""
        self.came: dict[str, Any] = {}
        """Bytes received per source kind, and the damaged ranges this rank was offered."""
        self._own: concurrent.futures.Future[set[str]] | None = in_background(
            lambda: self._restore_own_files(files, manifest, here), "dcp-nvme-restore-own-files")
        self._own.add_done_callback(lambda _: received.wake())  # the load stops waiting for more at once

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
        fetched = self.exchange.fetch(manifest, asks, optional=True, hold=self.received)
        came: dict[str, int] = {}
        for rank in ranks:
            for span in fetched.arrived[rank]:
                came[span.file] = came.get(span.file, 0) + span.length
        whole = {name for name, nbytes in came.items() if nbytes == files[name].size}
        problem = None
        if first:
            try:
                for name in sorted(whole):
                    fetched.adopt(name)
            except OSError as exc:
                problem = f"cannot keep the files that came to node {node_identity()}: {exc}"
        self.exchange.settle(problem)  # no rank of the node reads them before they are in place
        self.report(fetched)
        return whole

    def fetch(self, manifest: Manifest, asks: list[tuple[Span, ...]]) -> Any:
        """Collective: ``peers.exchange.fetch`` of ``asks``, what comes held for this load."""
        fetched = self.exchange.fetch(manifest, asks, hold=self.received)
        self.report(fetched)
        return fetched

    def refuse(self, manifest: Manifest, exc: BaseException) -> None:
        """Collective: this rank cannot go on; every rank raises its error (after the own files,
        so that every rank's collectives keep one order)."""
        self.own_files_came()
        self.exchange.fetch(manifest, [], problem=f"{type(exc).__name__}: {exc}")

    def report(self, fetched: Any) -> None:
        """What came from elsewhere, per source kind, and what was damaged there (last_stats)."""
        for kind, entry in fetched.taken.items():
            mine = self.came.setdefault(kind, {"files": 0, "bytes": 0, "seconds": 0.0})
            mine["bytes"] += entry["bytes"]
            mine["seconds"] += entry["seconds"]
        if fetched.damaged:
            self.came.setdefault("damaged", []).extend(fetched.damaged)

    def take_received(self, requests: list, dests: list[torch.Tensor]) -> list:
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

