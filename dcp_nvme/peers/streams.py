"""How the transfers of one exchange move (``peers.exchange``): every pair of ranks streams its own.

``waves`` groups the transfers so that no rank talks to more than ``MAX_PEERS`` others at once
(a thread each). In a wave (``run_wave``) each pair streams its transfers in order, cut into
pieces of whole checksum blocks (``cut``: a pair's first pieces small, then doubling), each
announced by a status on a tag of its own: the holder reads and checks the next piece
(``read_checked``) while ``IN_FLIGHT`` are on the wire, and a piece it cannot read intact is
announced as status 0 with nothing more of its transfer; the receiver asks for the next piece
while one arrives, and checks and keeps each on a thread.
What failed on this rank is the wave's ``WaveOutcome``, for ``peers.exchange`` to tell every rank.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dcp_nvme.errors import ChecksumMismatchError, DCPNVMeError, PeerError
from dcp_nvme.format.pieces import Span, verify_piece
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.host.files import open_regular

PIECE = 16 << 20
"""A transfer goes in pieces of at most this many bytes (whole checksum blocks), each checked
on its own: what a rank holds in memory is a few pieces per peer."""
FIRST_PIECE = 2 << 20
"""A pair's first piece: the link starts once this much is read and checked, not a whole piece."""
MAX_PEERS = 4
"""In one wave a rank sends to, and receives from, at most this many other ranks (a thread each)."""
IN_FLIGHT = 2
"""Pieces of one pair on the wire at once: the next is asked for while one arrives."""
KEEP_AHEAD = 4
"""Pieces a rank is receiving or has received and not yet checked and kept, from all its holders
together (its receiving threads wait beyond)."""


@dataclass(frozen=True)
class Transfer:
    """One range from a holder rank to the rank that needs it: the needer's ask ``index``."""

    needer: int
    index: int
    span: Span
    holder: int


@dataclass
class WaveOutcome:
    """What failed in a wave on this rank, by transfer (its slot in the exchange's list)."""

    refused: dict[int, str] = field(default_factory=dict)
    """As the holder: the transfers it could not read intact, and why."""
    damaged: dict[int, str] = field(default_factory=dict)
    """As the receiver: the transfers that failed their check on arrival, and why."""
    fatal: str | None = None
    """Why this rank cannot keep what came (every rank then raises it)."""

    def add(self, other: WaveOutcome) -> None:
        """``other``'s failures too (a later wave's); the first fatal one stays."""
        self.refused.update(other.refused)
        self.damaged.update(other.damaged)
        self.fatal = self.fatal or other.fatal


def waves(assigned: list[Transfer]) -> list[list[int]]:
    """The transfers (their indexes) in waves in which no rank sends to, or receives from, more
    than ``MAX_PEERS`` others: a thread each, a few pieces each in memory."""
    out: list[list[int]] = []
    sends: dict[int, set[int]] = defaultdict(set)
    receives: dict[int, set[int]] = defaultdict(set)
    for slot, transfer in enumerate(assigned):
        needer, holder = transfer.needer, transfer.holder
        new_send = needer not in sends[holder] and len(sends[holder]) >= MAX_PEERS
        new_receive = holder not in receives[needer] and len(receives[needer]) >= MAX_PEERS
        if out and (new_send or new_receive):
            out.append([])
            sends, receives = defaultdict(set), defaultdict(set)
        if not out:
            out.append([])
        out[-1].append(slot)
        sends[holder].add(needer)
        receives[needer].add(holder)
    return out


def cut(record: FileRecord, span: Span, first: int | None = None) -> list[tuple[int, int]]:
    """``span`` as pieces (offset, length) of whole checksum blocks, each checked on its own: the
    first of at most ``first`` bytes (default ``PIECE``), each next one at most twice the one
    before, up to ``PIECE`` (a piece is at least one block). A pair's first transfer starts at
    ``FIRST_PIECE``: its first bytes go as soon as a small piece is read, and each next piece is
    read while the one before is on the wire."""
    block = record.checksum_block
    pieces, at, limit = [], span.start, PIECE if first is None else min(first, PIECE)
    while at < span.end:
        # the last block boundary at most ``limit`` bytes on, or the next one
        k = max((at + limit - record.data_start) // block, (at - record.data_start) // block + 1, 1)
        end = min(span.end, record.data_start + k * block)
        pieces.append((at, end - at))
        at, limit = end, min(2 * limit, PIECE)
    return pieces


def pair_pieces(records: dict[str, FileRecord], jobs: list[tuple[int, Span]]) -> list[tuple[int, str, int, int]]:
    """The pieces (slot, file, offset, length) of one pair's transfers, in the order they go (the
    holder and the receiver cut them alike)."""
    return [(slot, span.file, at, length) for n, (slot, span) in enumerate(jobs)
            for at, length in cut(records[span.file], span, FIRST_PIECE if n == 0 else None)]


def run_wave(group: Any, tag: int, wave: list[tuple[int, Transfer]], records: dict[str, FileRecord],
             nodes: list[str], here: dict[str, str], keep_piece: Callable[[FileRecord, int, memoryview], None],
             halted: bool = False) -> WaveOutcome:
    """One wave on this rank: a thread for each rank it sends to and each it receives from, so
    that every link of the wave is busy at once (the transfers of one pair go in order). A
    transfer goes in pieces (``cut``), each announced by a status on a tag of its own (1: it
    follows; 0: the holder could not read it intact, and the rest of that transfer is not sent):
    the holder reads and checks the next piece while ``IN_FLIGHT`` are sent; the receiver asks
    for the next piece while one arrives, and checks and keeps each on a thread (a wave read
    whole before its first send, and kept after its last, left the link idle meanwhile).
    Returns what failed on this rank; ``halted`` (an earlier wave's failure was fatal): what
    comes is received, not kept."""
    me = dist.get_rank()
    outcome = WaveOutcome()
    refused, damaged = outcome.refused, outcome.damaged
    sends: dict[int, list[tuple[int, Span]]] = defaultdict(list)
    receives: dict[int, list[tuple[int, Span]]] = defaultdict(list)
    for slot, transfer in wave:
        if transfer.holder == me:
            sends[transfer.needer].append((slot, transfer.span))
        elif transfer.needer == me:
            receives[transfer.holder].append((slot, transfer.span))
    if not sends and not receives:
        return outcome
    room = threading.BoundedSemaphore(KEEP_AHEAD)  # pieces received and not yet kept
    errors: list[BaseException] = []

    status_tag, piece_tag = 2 * tag, 2 * tag + 1  # a tag each: a pair's statuses run ahead of its pieces

    def send_to(needer: int, jobs: list[tuple[int, Span]]) -> None:
        pieces = pair_pieces(records, jobs)

        def read(piece: tuple[int, str, int, int]) -> bytearray:
            _, name, at, length = piece
            return read_checked(here[name], records[name], Span(name, at, at + length), nodes[me])

        said: list[tuple[Any, Any]] = []  # status sends (a tensor each, alive until sent)
        sending: deque[tuple[Any, Any]] = deque()
        with ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-exchange-read") as reader:
            ahead: Future[bytearray] | None = reader.submit(read, pieces[0])
            for at, piece in enumerate(pieces):
                future, ahead = ahead, (reader.submit(read, pieces[at + 1]) if at + 1 < len(pieces) else None)
                assert future is not None
                if piece[0] in refused:
                    continue  # the rest of a transfer this holder could not read
                try:
                    payload = torch.frombuffer(future.result(), dtype=torch.uint8)
                    flag = torch.ones(1, dtype=torch.int64)
                except (OSError, KeyError, DCPNVMeError) as exc:
                    refused[piece[0]] = f"{type(exc).__name__}: {exc}"
                    flag, payload = torch.zeros(1, dtype=torch.int64), None
                said.append((dist.isend(flag, needer, group=group, tag=status_tag), flag))
                if payload is None:
                    continue
                if len(sending) >= IN_FLIGHT:
                    sending.popleft()[0].wait()
                sending.append((dist.isend(payload, needer, group=group, tag=piece_tag), payload))
        for request, _ in [*said, *sending]:
            request.wait()

    def keep(slot: int, holder: int, name: str, at: int, piece: Any) -> None:
        try:
            if slot in damaged or outcome.fatal or halted:
                return
            data = memoryview(piece.numpy()).cast("B")
            try:
                verify_piece(records[name], at, data, f"{name} from node {nodes[holder]}")
            except ChecksumMismatchError as exc:
                damaged[slot] = str(exc)
                return
            try:
                keep_piece(records[name], at, data)
            except OSError as exc:
                outcome.fatal = outcome.fatal or f"cannot keep what came of {name}: {exc}"
        finally:
            room.release()

    def receive_from(holder: int, jobs: list[tuple[int, Span]], keeper: ThreadPoolExecutor) -> None:
        pieces = pair_pieces(records, jobs)
        index = 0  # the next piece whose status is awaited
        coming: deque[tuple[int, str, int, int]] = deque()  # said to follow, not yet asked for
        asked: deque[tuple[int, str, int, Any, Any]] = deque()  # receives posted, oldest first
        try:
            while index < len(pieces) or coming or asked:
                if index < len(pieces) and not coming and len(asked) < IN_FLIGHT:
                    flag = torch.zeros(1, dtype=torch.int64)
                    dist.recv(flag, holder, group=group, tag=status_tag)
                    if flag.item():
                        coming.append(pieces[index])
                        index += 1
                    else:  # the holder could not read it intact: nothing more of that transfer comes
                        slot = pieces[index][0]
                        while index < len(pieces) and pieces[index][0] == slot:
                            index += 1
                # the next piece is asked for while one arrives; room is waited for only with
                # nothing asked (a thread holding room while it waits for room could stall them all)
                elif coming and len(asked) < IN_FLIGHT and room.acquire(blocking=not asked):
                    slot, name, at, length = coming.popleft()
                    piece = torch.empty(length, dtype=torch.uint8)
                    asked.append((slot, name, at, dist.irecv(piece, holder, group=group, tag=piece_tag), piece))
                else:
                    slot, name, at, request, piece = asked[0]
                    request.wait()
                    asked.popleft()
                    keeper.submit(keep, slot, holder, name, at, piece)
        finally:
            for _ in asked:  # a transfer that failed: what it held is free for the other threads
                room.release()

    def guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except RuntimeError as exc:  # gloo's: the peer closed the link, or sent nothing within the job's timeout
            peer, role = args[0], "holder" if fn is receive_from else "receiver"
            failure = PeerError(f"node {nodes[peer]} (rank {peer}, the {role} of a transfer) stopped answering: "
                                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__} "
                                "(a process that is frozen, killed or cut off; the group fails after the job's "
                                "timeout, init_process_group(timeout=...))")
            failure.__cause__ = exc
            errors.append(failure)
        except BaseException as exc:  # noqa: BLE001  raised below, once every thread ended
            errors.append(exc)

    with ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-exchange-keep") as keeper:
        threads = [threading.Thread(target=guarded, args=(send_to, needer, jobs), daemon=True,
                                    name=f"dcp-nvme-exchange-send-{needer}") for needer, jobs in sends.items()]
        threads += [threading.Thread(target=guarded, args=(receive_from, holder, jobs, keeper), daemon=True,
                                     name=f"dcp-nvme-exchange-receive-{holder}") for holder, jobs in receives.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    return outcome


def read_checked(local: str, record: FileRecord, span: Span, node: str) -> bytearray:
    """``span`` of this node's copy of the file at ``local``, checked against the blocks table."""
    data = bytearray(span.length)
    fd = open_regular(local)
    try:
        got = os.preadv(fd, [data], span.start)
    finally:
        os.close(fd)
    if got != span.length:
        raise OSError(f"{local}: read {got} of {span.length} bytes at {span.start}")
    verify_piece(record, span.start, memoryview(data), f"{local} on node {node}")
    return data
