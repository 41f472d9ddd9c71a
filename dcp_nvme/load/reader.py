"""NVMeReader: DCP's StorageReader reading straight into destination tensors, verified; and
what it keeps of DCP's stock reader (``reader_stock_options``: FileSystemReader's arguments
accepted where they are what it does anyway, refused saying why otherwise).

Each ReadItem becomes byte ranges of its container: one range read directly into the
destination when the slice is contiguous on both sides, else the slice's runs (or the rows
covering it) into a bounded temporary that is narrowed and copied. Ranges are sorted, merged
into requests of ``block_size`` bytes and run ``queue_depth`` at a time; every request covers
whole checksum blocks and is verified before the data is handed to DCP.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_nvme import seams
from dcp_nvme.config import (
    IOConfig,
    check_option,
    option_or_default,
    refuse_positional,
    resolve_config,
    unknown_option,
)
from dcp_nvme.engines import shared_engine
from dcp_nvme.engines.host_io import tensor_bytes
from dcp_nvme.engines.requests import IOStats, PhaseTimer
from dcp_nvme.errors import (
    ChecksumMismatchError,
    InvalidInputError,
    ManifestError,
    MissingItemError,
    ShapeMismatchError,
)
from dcp_nvme.format.checksums import items_in
from dcp_nvme.format.container import MANIFEST, parse_dtype
from dcp_nvme.format.manifest import Manifest, read_files, read_manifest
from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.format.validation import check_container
from dcp_nvme.host.job import node_identity
from dcp_nvme.load.foreign import open_foreign
from dcp_nvme.load.local_copies import KeptRanges, local_copies
from dcp_nvme.load.node_index import shared_columns
from dcp_nvme.load.objects import bytes_for_planner, check_destination_kind
from dcp_nvme.load.peer_load import PeerLoad, lacking_asks
from dcp_nvme.load.planning import FileBlocks, Need, count_runs, covering_rows, plan_reads, slice_runs
from dcp_nvme.storage.fsspec_dir import FsspecStore, open_store
from dcp_nvme.storage.local_dir import (
    LocalStore,
    is_local_path,
    is_remote_url,
    reader_location,
    require_location,
)

log = logging.getLogger(__name__)

MAX_DIRECT_RUNS = 64
"""Above this many runs a slice is read as the whole rows that cover it, then narrowed."""

DEFAULT_MEMORY_BUDGET = 256 << 20
"""Bytes of temporaries (resharded slices, non-tensor items) held at once per rank."""


class _Batch:
    """Reads planned together: destinations, their needs, and what to do after the bytes land."""

    def __init__(self) -> None:
        self.dests: list[torch.Tensor] = []
        self.needs: dict[str, list[Need]] = {}
        self.after: list[Callable[[], None]] = []
        self.temp_bytes = 0
        self.owners: dict[str, list[tuple[int, int, str]]] = {}  # file -> (start, end, item)

    def add_dest(self, tensor: torch.Tensor) -> int:
        self.dests.append(tensor)
        return len(self.dests) - 1

    def need(self, chunk: ChunkRecord, start: int, length: int, dest: int, dest_offset: int = 0) -> None:
        if length <= 0:
            return
        self.needs.setdefault(chunk.file, []).append(Need(chunk.byte_offset + start, length, dest, dest_offset))
        self.owners.setdefault(chunk.file, []).append(
            (chunk.byte_offset, chunk.byte_offset + chunk.length, chunk.key))


def check_one_save(plans: list[LoadPlan]) -> None:
    """The coordinator: every rank loads the same save (a restart that took each node's newest
    step would load one model from two steps); else an error naming what each rank read."""
    ranks: dict[tuple[str, str], list[str]] = {}
    for rank, tag in enumerate(plan.storage_data for plan in plans):
        if isinstance(tag, tuple) and len(tag) == 3:
            ranks.setdefault((tag[0], tag[1]), []).append(f"{rank} (node {tag[2]})")
    if len({key for key, _ in ranks}) <= 1:
        return
    held = "; ".join(f"{path} (save {key}) on ranks {', '.join(who[:8])}{' ...' if len(who) > 8 else ''}"
                     for (key, path), who in ranks.items())
    raise ManifestError(f"the ranks are loading different saves, which would make one model of several steps: "
                        f"{held}. Load one step on every rank: dcp_nvme.latest(run, agree=True) on every rank "
                        "picks the newest step every node can load")


class NVMeReader(StorageReader):
    """Load a checkpoint written by NVMeWriter, resharding as DCP's planner asks; also a
    Hugging Face model directory, a single ``.safetensors`` file and, with ``allow_pickle``, a
    stock DCP checkpoint (``load.foreign``: their own formats, no checksums to verify).

    Args:
        path: the checkpoint directory, or an fsspec URL; or None, and DCP's ``checkpoint_id=``
            names it (``dcp.load(sd, checkpoint_id=DIR, storage_reader=NVMeReader())``).
        queue_depth, block_size, direct_io, engine: as for NVMeWriter (and the same env vars).
        verify: check every byte read against the manifest's crc32c (default on).
        read_mode: ``"direct"`` (O_DIRECT), ``"buffered"`` (page cache with sequential readahead)
            or ``"auto"``: what ``dcp-nvme tune`` measured faster on this machine, else as
            ``direct_io``.
        memory_budget: bytes of temporary buffers held at once for resharded slices.
        allow_pickle: load non-tensor items with full pickle, which runs any code the
            checkpoint's author put in them. Off by default: they are decoded by torch's
            weights-only unpickler (plain Python values, containers, tensors), and an item that
            needs more is refused with an error naming it. Turn on only for checkpoints you trust.
        storage_options: for a URL path (``s3://...``, any fsspec URL): the filesystem's options;
            reads are then ranged GETs, ``queue_depth`` in flight, checksum verified.
        mirror, mirror_options: the checkpoint's mirror (its URL, or the run's ``mirror_root``)
            and its storage options. With it (or ``peers=True``), passed on every rank, a file
            this node lacks or holds damaged comes from the nearest copy that verifies: a
            replica, a peer node, the mirror (``dcp_nvme.peers.sources``), and is kept here.
        peers: find the other nodes' copies and replicas without a mirror.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *stock_args: Any,
        queue_depth: int | None = None,
        block_size: int | str | None = None,
        direct_io: bool | None = None,
        engine: str | None = None,
        verify: bool | None = None,
        read_mode: str | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        mirror: str | os.PathLike | None = None,
        mirror_options: dict[str, Any] | None = None,
        peers: bool | None = None,
        **stock_kwargs: Any,
    ) -> None:
        super().__init__()
        reader_stock_options(type(self), stock_args, stock_kwargs)  # FileSystemReader's arguments
        self.mirror = None if mirror is None else check_option("mirror", mirror)
        self.mirror_options = mirror_options
        self.peers = option_or_default("peers", peers, self.mirror is not None)
        self._sources: seams.Sources | None = None
        """``peers.sources.RestoreSources`` of the current load, with a mirror or peers."""
        self.path: str | None = reader_location(path)
        self.config: IOConfig = resolve_config(
            queue_depth=queue_depth, block_size=block_size, direct_io=direct_io,
            engine=engine, verify=verify, read_mode=read_mode,
        )
        self.memory_budget = check_option("memory_budget", memory_budget)
        self.allow_pickle = check_option("allow_pickle", allow_pickle)
        self.storage_options = storage_options
        self._store: LocalStore | FsspecStore | None = None
        self._manifest: Manifest | None = None
        self._checked: set[str] = set()
        """Containers whose header was checked against the index in this load."""
        self._moved: dict[tuple, ChunkRecord] | None = None
        """Chunks read from this node's copy instead of the index's file (``local_copies``)."""
        self._here: set[str] | None = None
        """The names in this node's directory, where the load looks at them (copies, peers)."""
        self._exchange: seams.Exchange | None = None
        """``seams.peer_restore`` of the current load: several ranks, ``peers``."""
        self._kept: KeptRanges | None = None
        """The ranges of other nodes' files this node keeps: earlier restores', this one's."""
        self._peer_load: PeerLoad | None = None
        """This load's use of the exchange (``load.peer_load``), made once the ranks agreed on the save."""
        self.storage_data: dict[Any, ChunkRecord] = {}
        self.last_stats: dict[str, Any] | None = None
        """This rank's figures for its last load: bytes read, seconds, GB/s, requests."""
        self.load_id: str = str(uuid.uuid4())
        """DCP's ``StorageMeta.load_id``: new at every reset, set on ``read_metadata()``."""
        self._foreign: StorageReader | None = None
        """The reader of a checkpoint we did not write (``load.foreign``), which this one hands to."""

    @property
    def _dir(self) -> str:
        """``path``, which a load needs (the error of a reader given none, otherwise)."""
        return require_location(type(self), self.path, "dcp.load")

    @property
    def store(self) -> LocalStore | FsspecStore:
        if self._store is None:  # one fsspec client per checkpoint, not one per call
            self._store = open_store(self._dir, self.storage_options)
        return self._store

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = reader_location(checkpoint_id)
            self._store = None
        if self._peer_load is not None:  # a load that failed while DCP planned: its restore ends first
            self._peer_load.finish()
        self._manifest = None
        self._checked = set()
        self._moved, self._here, self._exchange, self._kept, self._peer_load = None, None, None, None, None
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
        self._sources = None
        self._foreign = None

    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = read_manifest(self.store, self._dir, share=shared_columns)  # one decode a node
        return self._manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._dir
        if is_local_path(path) and not os.path.exists(os.path.join(path, MANIFEST)):
            # a Hugging Face directory, a safetensors file, a stock DCP checkpoint (allow_pickle)
            self._foreign = open_foreign(path, self.allow_pickle)
        if self._foreign is not None:
            return self._foreign.read_metadata(*args, **kwargs)
        if self.peers and not is_remote_url(path):
            # many ranks: they agree on the save and exchange byte ranges (peers.exchange); one
            # process: this disk, its replicas, the mirror (peers.sources)
            self._exchange = seams.peer_restore(path, self.mirror, self.mirror_options)
            if self._exchange is not None:
                self._exchange.agree_metadata()  # a replacement node's empty disk gets it from a peer
            else:
                self._sources = seams.restore_sources(path, node_identity(), self.mirror, self.mirror_options,
                                                      self.config)
                self._sources.ensure_metadata()
            self._manifest, self._store = None, None
        metadata = self.manifest().to_metadata()
        assert metadata.storage_meta is not None  # to_metadata always makes one
        metadata.storage_meta.load_id = self.load_id
        if self._exchange is not None:  # a replacement node's own files come while DCP plans
            files = read_files(self.store, self.manifest(), self._dir)
            self._peer_load = PeerLoad(self._exchange, files, self.manifest(), set(self.store.names()))
        return metadata

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._foreign is not None:
            return self._foreign.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._foreign is not None:
            return self._foreign.prepare_local_plan(plan)
        if plan.storage_data is not None:  # a planner's own: left as it is
            return plan
        # which save this rank loads, so that the coordinator refuses a load of several
        return replace(plan, storage_data=(self.manifest().save_key, str(self.path), node_identity()))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self._foreign is not None:
            return self._foreign.prepare_global_plan(plans)
        check_one_save(plans)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._foreign is not None:
            return self._foreign.read_data(plan, planner)
        started = time.perf_counter()
        stats, timer = IOStats("read"), PhaseTimer()
        needed = 0
        try:
            items = self._planned_items(plan, planner)
        except Exception as exc:
            if self._peer_load is None:
                raise
            self._peer_load.refuse(self.manifest(), exc)  # raises everywhere
            raise
        if self._peer_load is not None:  # every rank, even one that needs nothing from elsewhere
            # what this node's disk holds is read on a thread while the exchange runs: a holder
            # sends and loads at once, and the load ends with the last transfer
            assert self._here is not None  # a local path: _planned_items listed it
            beside = [item for item in items if self._chunk(item).file in self._here]
            items = [item for item in items if self._chunk(item).file not in self._here]
            beside_stats, beside_timer = IOStats("read"), PhaseTimer()
            with ThreadPoolExecutor(1, thread_name_prefix="dcp-nvme-load-here") as pool:
                early = pool.submit(self._run_items, beside, planner, beside_stats, beside_timer)
                with timer.span("fetch (own files, after DCP planned)"):
                    items = self._take_while_coming(items, planner, stats, timer)
                    self._here |= self._peer_load.own_files_came()  # this node's from now on
                with timer.span("fetch"):
                    self._fetch_elsewhere(items, self._peer_load)
            needed += early.result()
            stats.merge(beside_stats)
            for name, seconds in beside_timer.phases.items():
                timer.add(f"{name} (beside the exchange)", seconds)
        if self._sources is not None:  # each file this rank needs, here or from the nearest copy
            with timer.span("fetch"):
                self._sources.ensure_files(self.manifest(), {self._chunk(i).file for i in items})
        needed += self._run_items(items, planner, stats, timer)
        if self._peer_load is not None:
            self._peer_load.finish()  # what came is in the tensors, and kept on disk
        stats.seconds = time.perf_counter() - started
        sources = self._sources.stats(stats, timer.phases.get("io", 0.0)) if self._sources is not None else {}
        if self._peer_load is not None:
            sources = {"read": {"bytes": int(stats.bytes)}, **self._peer_load.came}
        remote = sum(v["bytes"] for k, v in sources.items() if k not in ("read", "local", "damaged"))
        self.last_stats = {"bytes_needed": needed, **stats.to_dict(), "remote_bytes": int(remote),
                           **({"from_received_bytes": self._peer_load.from_received} if self._peer_load else {}),
                           "phases": {k: round(v, 6) for k, v in timer.phases.items()},
                           **({"sources": sources} if sources else {})}
        log.info("dcp_nvme: read %.3f GB (%.3f GB needed) in %.3f s (%.2f GB/s), %d requests, depth %d",
                 stats.bytes / 1e9, needed / 1e9, stats.seconds, stats.gbps, stats.requests,
                 stats.max_inflight)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _fetch_elsewhere(self, items: list[ReadItem], peers: PeerLoad) -> None:
        """Collective (``peers.exchange``): the chunks ``items`` need that this node's disk
        lacks, each read afterwards where it came to."""
        assert self._here is not None and self._moved is not None  # set by _planned_items
        files = read_files(self.store, self.manifest(), self._dir)
        try:
            self._kept = KeptRanges(self._dir, files)
            asks, where, kept_here = lacking_asks([self._chunk(i) for i in items], self._here, self.manifest(),
                                                  self.storage_data, files, self._kept, self._dir)
        except Exception as exc:
            peers.refuse(self.manifest(), exc)
            raise
        self._moved.update(kept_here)
        fetched = peers.fetch(self.manifest(), asks)
        for places, chosen in zip(where, fetched.chosen):  # read each where it came from
            place = places[chosen]
            self._moved[(place.fqn, place.offsets if place.kind == "tensor" else None)] = place
        self._kept = KeptRanges(self._dir, files)

    def _take_while_coming(self, items: list[ReadItem], planner: LoadPlanner, stats: IOStats,
                           timer: PhaseTimer) -> list[ReadItem]:
        """While this node's own files come, the items whose bytes came to this rank whole go into
        their tensors from memory (the load ends soon after the last piece, not a copy of all
        later); returns the others."""
        assert self._peer_load is not None
        files = read_files(self.store, self.manifest(), self._dir)
        pending = [(item, files[chunk.file], chunk) for item in items for chunk in [self._chunk(item)]]
        held = 0
        while pending and (now := self._peer_load.more_came(held)) is not None:
            if now == held:
                continue
            held = now
            ready = [self._peer_load.holds(record, chunk) for _, record, chunk in pending]
            try:
                self._run_items([p[0] for p, r in zip(pending, ready) if r], planner, stats, timer, held_only=True)
            except Exception:  # raised again where they are read after the exchange: no rank leaves it early
                break
            pending = [p for p, r in zip(pending, ready) if not r]
        return [item for item, _, _ in pending]

    def _run_items(self, items: list[ReadItem], planner: LoadPlanner, stats: IOStats, timer: PhaseTimer,
                   held_only: bool = False) -> int:
        """Read ``items`` in batches of at most ``memory_budget`` bytes of temporaries; returns
        the bytes they needed (``held_only``: every byte is held in memory, none is read)."""
        needed, batch = 0, _Batch()
        for item in items:
            with timer.span("plan"):
                self._add_item(batch, item, planner)
            if batch.temp_bytes >= self.memory_budget:
                needed += self._run(batch, stats, timer, held_only)
                batch = _Batch()
        return needed + self._run(batch, stats, timer, held_only)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_local_path(checkpoint_id) or is_remote_url(checkpoint_id)

    def _planned_items(self, plan: LoadPlan, planner: LoadPlanner) -> list[ReadItem]:
        """The plan's items in file order, once every one is known to be loadable."""
        for item in plan.items:  # refuse before any byte lands in the caller's state_dict
            if item.type == LoadItemType.BYTE_IO:
                check_destination_kind(planner, item.dest_index.fqn, str(self.path))
        if self._moved is None:  # once per load: what this node's disk holds, and its copies
            manifest = self.manifest()
            local = not is_remote_url(self._dir) and (manifest.copies or self._exchange is not None)
            self._here = set(self.store.names()) if local else None
            self._moved = local_copies(manifest, self._here, self.storage_data, self._dir) if self._here else {}
            if self._exchange is not None:  # a chunk whose file no node holds: a copy some node holds
                anywhere = local_copies(manifest, self._exchange.held_anywhere(), self.storage_data, self._dir)
                self._moved = {**anywhere, **self._moved}
        return sorted(plan.items, key=lambda i: (self._chunk(i).file, self._chunk(i).byte_offset))

    # ------------------------------------------------------------------ planning

    def _chunk(self, item: ReadItem) -> ChunkRecord:
        try:
            chunk = self.storage_data[item.storage_index]
        except KeyError:
            raise MissingItemError(f"{self.path}: the checkpoint has no stored chunk for {item.storage_index}; "
                           "was the metadata from another checkpoint?") from None
        if self._moved:  # the index's file is on another node's disk; this node has a copy
            return self._moved.get((chunk.fqn, chunk.offsets if chunk.kind == "tensor" else None), chunk)
        return chunk

    def _add_item(self, batch: _Batch, item: ReadItem, planner: LoadPlanner) -> None:
        chunk = self._chunk(item)
        if item.type == LoadItemType.BYTE_IO:
            dest = torch.empty(chunk.length, dtype=torch.uint8)
            batch.need(chunk, 0, chunk.length, batch.add_dest(dest))
            batch.temp_bytes += chunk.length
            batch.after.append(lambda: planner.load_bytes(item, bytes_for_planner(
                dest.numpy().tobytes(), item.dest_index.fqn, str(self.path), allow_pickle=self.allow_pickle)))
            return
        stored = parse_dtype(chunk.dtype)
        itemsize = stored.itemsize  # no tensor made: no warning for an experimental dtype
        shape, offsets, lengths = chunk.sizes, tuple(item.storage_offsets), tuple(item.lengths)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise ShapeMismatchError(f"{item.dest_index.fqn}: destination shape {tuple(target.shape)} "
                             f"does not match the requested slice {lengths}")
        runs = count_runs(shape, offsets, lengths)

        def commit() -> None:
            planner.commit_tensor(item, target)

        if runs == 0:
            batch.after.append(commit)
            return
        # device targets too: the kvikio engine reads straight into them, POSIX bounces
        direct = runs == 1 and target.is_contiguous() and target.dtype == stored
        if direct:
            (src, nbytes, _), = slice_runs(shape, offsets, lengths, itemsize)
            batch.need(chunk, src, nbytes, batch.add_dest(tensor_bytes(target)))
            batch.after.append(commit)
            return
        if runs <= MAX_DIRECT_RUNS:
            temp = torch.empty(lengths, dtype=stored, device=target.device)
            temp_dest = batch.add_dest(tensor_bytes(temp))
            for src, nbytes, dst in slice_runs(shape, offsets, lengths, itemsize):
                batch.need(chunk, src, nbytes, temp_dest, dst)
            view = temp
        else:
            src, nbytes = covering_rows(shape, offsets, lengths, itemsize)
            temp = torch.empty((lengths[0], *shape[1:]), dtype=stored, device=target.device)
            batch.need(chunk, src, nbytes, batch.add_dest(tensor_bytes(temp)))
            view = temp
            for dim in range(1, len(shape)):
                view = view.narrow(dim, offsets[dim], lengths[dim])
        batch.temp_bytes += temp.numel() * itemsize

        def copy_then_commit() -> None:
            target.copy_(view)
            commit()

        batch.after.append(copy_then_commit)

    def _run(self, batch: _Batch, stats: IOStats, timer: PhaseTimer, held_only: bool = False) -> int:
        if not batch.after:
            return 0
        with timer.span("plan"):
            requests, request_size = self._plan_requests(batch, held_only)
        # the checkpoint's checksum block, not this reader's block_size, sets the smallest request
        config = self.config if request_size <= self.config.block_size else \
            replace(self.config, block_size=request_size)
        has_device = any(d.device.type != "cpu" for d in batch.dests)
        if self.manifest().compression is not None:  # a compressed mirror
            coded = seams.coded_engine(self.store, self.manifest(), self._dir, config)
            assert coded is not None  # a manifest with a compression section has its coded engine
            engine = coded
        elif is_remote_url(self.path):
            engine = cast(FsspecStore, self.store).read_engine(config)  # a URL's store (open_store)
        else:
            engine, _ = shared_engine(config, has_device, self.path)
        try:
            with timer.span("io"):
                if self._peer_load is not None:  # what came to this rank, from memory
                    requests = self._peer_load.take_received(requests, batch.dests)
                    assert not (held_only and requests), "the items taken from memory need a read"
                if requests:
                    stats.merge(engine.read(requests, batch.dests))
        except ChecksumMismatchError as exc:
            if self._sources is None or not self._sources.replace_damaged(self.manifest(), exc):
                raise exc.with_items(_items_in(batch, exc)) from None
            with timer.span("io"):  # this node's copy was damaged: read the verified one fetched
                stats.merge(engine.read(requests, batch.dests))
        with timer.span("commit"):  # narrowing copies and DCP's commit_tensor / load_bytes
            for action in batch.after:
                action()
        return sum(n.length for needs in batch.needs.values() for n in needs)

    def _plan_requests(self, batch: _Batch, held_only: bool = False) -> tuple[list, int]:
        """The batch's requests, and the largest request size they were cut to (``held_only``:
        the bytes are held in memory, checked on arrival; the file may not be on disk yet)."""
        files = read_files(self.store, self.manifest(), self._dir)
        requests, largest = [], self.config.block_size
        for name, needs in batch.needs.items():
            record = files[name]  # read_manifest checked that every row's file is listed
            if not held_only:
                self._check_container(record)
            blocks, max_request = None, self.config.block_size
            if self.config.verify:
                blocks = FileBlocks(record.data_start, record.data_size, record.checksum_block, record.crcs)
                # whole checksum blocks per request, as close to block_size as they allow
                granule = record.checksum_block
                max_request = max(granule, max_request // granule * granule)
                largest = max(largest, max_request)
            where = self.store.path(name) if held_only else self._kept_path(name) or self.store.path(name)
            requests += plan_reads(where, needs, max_request=max_request, blocks=blocks)
        return requests, largest

    def _check_container(self, record: FileRecord) -> None:
        """Before reading a container: it is here (an absent one, another node's or lost, is
        told apart from a damaged one), and its own header agrees with the index (once per load)."""
        if self._kept_path(record.name) is not None:
            return  # only ranges are kept, without the header: every byte read is checked against its blocks
        if record.name not in self._checked:
            view = self._plain_view()
            try:
                view.size(record.name)
            except FileNotFoundError:
                raise self.manifest().missing_file_error(record.name, record.rank, self._dir) from None
            check_container(view, record, self.manifest(), self._dir, self.config.verify)
            self._checked.add(record.name)

    def _kept_path(self, name: str) -> str | None:
        """Where this node keeps ranges of ``name``, when it lacks the whole file."""
        if self._kept is None or (self._here is not None and name in self._here):
            return None
        return self._kept.path(name)

    def _plain_view(self) -> Any:
        """The store as the plain checkpoint it holds: a compressed mirror's rank files are
        read through their decoder, so their headers are checked like any other."""
        if self.manifest().compression is None:
            return self.store
        return seams.decoded_store(self.store, self.manifest(), self._dir)


def _items_in(batch: _Batch, exc: ChecksumMismatchError) -> str:
    name = os.path.basename(exc.path)
    hits = items_in(batch.owners.get(name, []), exc.start, exc.end)
    return ", ".join(hits) if hits else "none of the requested items (a neighbouring block)"


STOCK_READER_POSITIONAL = ("_extension_registry",)


def reader_stock_options(cls: type, args: tuple[Any, ...], extra: dict[str, Any]) -> None:
    """FileSystemReader's arguments on NVMeReader: the stock defaults are accepted (they are
    what the reader does), anything else is refused saying why."""
    refuse_positional(cls, "FileSystemReader", STOCK_READER_POSITIONAL, args)
    for name, value in extra.items():
        if name == "_extension_registry":
            if value is not None:
                raise InvalidInputError(
                    f"{cls.__name__} reads no stream extensions (_extension_registry={value!r}): a "
                    "dcp_nvme checkpoint is plain safetensors, and a compressed mirror is decoded by "
                    "the reader itself")
            continue
        raise unknown_option(cls, name, value)
