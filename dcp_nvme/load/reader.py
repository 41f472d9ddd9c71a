"""NVMeReader: DCP's StorageReader reading straight into destination tensors, verified (with
FileSystemReader's arguments: ``load.dropin``). Each ReadItem becomes byte ranges of its
container (``load.planning``), run ``queue_depth`` requests at a time; every request covers
whole checksum blocks and is verified before the data is handed to DCP.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_nvme import seams
from dcp_nvme.config import READER_IO, IOConfig, check_option, option_or_default, resolve_config
from dcp_nvme.engines import shared_engine
from dcp_nvme.engines.requests import IOStats, PhaseTimer
from dcp_nvme.errors import ChecksumMismatchError, MissingItemError
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.copies import local_copies
from dcp_nvme.format.manifest import Manifest, read_files, read_manifest
from dcp_nvme.format.tables import ChunkRecord, FileRecord
from dcp_nvme.format.validation import check_container
from dcp_nvme.host.job import node_identity
from dcp_nvme.load.dropin import reader_stock_options
from dcp_nvme.load.foreign import open_foreign
from dcp_nvme.load.node_index import shared_columns
from dcp_nvme.load.objects import check_destination_kind
from dcp_nvme.load.planning import Batch, check_one_save
from dcp_nvme.storage.fsspec_dir import FsspecStore, open_store
from dcp_nvme.storage.local_dir import (
    LocalStore,
    is_local_path,
    is_remote_url,
    reader_location,
    require_location,
)

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BUDGET = 256 << 20
"""Bytes of temporaries (resharded slices, non-tensor items) held at once per rank."""


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
        self._restore: seams.Restore | None = None
        """The current load's restore (``seams.restore``), with a mirror or peers."""
        self.path: str | None = reader_location(path)
        # the I/O keywords IOConfig gives the reader, from its arguments (locals() of __init__)
        self.config: IOConfig = resolve_config(**{n: v for n, v in locals().items() if n in READER_IO})
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
        if self._restore is not None:  # a load that failed while DCP planned: its restore ends first
            self._restore.finish()
        self._manifest = None
        self._checked = set()
        self._moved, self._here, self._restore = None, None, None
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
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
            # many ranks agree on the save and exchange ranges; one process takes the nearest copy
            self._restore = seams.restore(path, node_identity(), self.mirror, self.mirror_options, self.config)
            self._restore.ensure_metadata()
            self._manifest, self._store = None, None
        metadata = self.manifest().to_metadata()
        assert metadata.storage_meta is not None  # to_metadata always makes one
        metadata.storage_meta.load_id = self.load_id
        if self._restore is not None:  # a replacement node's own files come while DCP plans
            self._restore.begin(self.store, self.manifest())
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
            if self._restore is not None:
                self._restore.refuse(exc)  # several ranks: raises everywhere
            raise
        if self._restore is not None:  # what this node lacks, from elsewhere (collective on several ranks)
            assert self._moved is not None  # set by _planned_items, as _here on several ranks
            here = self._here if self._here is not None else set()  # None: one process, no copies
            wanted = seams.Wanted(items, [self._chunk(i) for i in items], here, self.storage_data,
                                  lambda some, into, spans, held: self._run_items(some, planner, into, spans, held))
            brought = self._restore.bring_in(wanted, stats, timer)
            items, needed = brought.items, brought.needed
            self._moved.update(brought.moved)
        needed += self._run_items(items, planner, stats, timer)
        if self._restore is not None:
            self._restore.finish()  # what came is in the tensors, and kept on disk
        stats.seconds = time.perf_counter() - started
        restored = self._restore.stats(stats, timer.phases.get("io", 0.0)) if self._restore is not None else {}
        sources = restored.pop("sources", None)
        self.last_stats = {"bytes_needed": needed, **stats.to_dict(), "remote_bytes": 0, **restored,
                           "phases": {k: round(v, 6) for k, v in timer.phases.items()},
                           **({"sources": sources} if sources else {})}
        log.info("dcp_nvme: read %.3f GB (%.3f GB needed) in %.3f s (%.2f GB/s), %d requests, depth %d",
                 stats.bytes / 1e9, needed / 1e9, stats.seconds, stats.gbps, stats.requests,
                 stats.max_inflight)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _run_items(self, items: list[ReadItem], planner: LoadPlanner, stats: IOStats, timer: PhaseTimer,
                   held_only: bool = False) -> int:
        """Read ``items`` in batches of at most ``memory_budget`` bytes of temporaries; returns
        the bytes they needed (``held_only``: every byte is held in memory, none is read)."""
        needed, batch = 0, Batch()
        for item in items:
            with timer.span("plan"):
                batch.add_item(item, self._chunk(item), planner, str(self.path), self.allow_pickle)
            if batch.temp_bytes >= self.memory_budget:
                needed += self._run(batch, stats, timer, held_only)
                batch = Batch()
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
            held = self._restore.held_anywhere() if self._restore is not None else None
            local = not is_remote_url(self._dir) and (manifest.copies or held is not None)
            self._here = set(self.store.names()) if local else None
            self._moved = local_copies(manifest, self._here, self.storage_data, self._dir) if self._here else {}
            if held is not None:  # several ranks: a chunk whose file no node holds, a copy some node holds
                anywhere = local_copies(manifest, held, self.storage_data, self._dir)
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

    def _run(self, batch: Batch, stats: IOStats, timer: PhaseTimer, held_only: bool = False) -> int:
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
                if self._restore is not None:  # what came to this rank, from memory
                    requests = self._restore.take_held(requests, batch.dests)
                    assert not (held_only and requests), "the items taken from memory need a read"
                if requests:
                    stats.merge(engine.read(requests, batch.dests))
        except ChecksumMismatchError as exc:
            if self._restore is None or not self._restore.replace_damaged(exc):
                raise exc.with_items(batch.items_in(exc)) from None
            with timer.span("io"):  # this node's copy was damaged: read the verified one fetched
                stats.merge(engine.read(requests, batch.dests))
        with timer.span("commit"):  # narrowing copies and DCP's commit_tensor / load_bytes
            for action in batch.after:
                action()
        return sum(n.length for needs in batch.needs.values() for n in needs)

    def _plan_requests(self, batch: Batch, held_only: bool = False) -> tuple[list, int]:
        """The batch's requests, and the largest request size they were cut to (``held_only``:
        the bytes are held in memory, checked on arrival; the file may not be on disk yet)."""

        def where(record: FileRecord) -> str:
            if held_only:
                return self.store.path(record.name)
            self._check_container(record)
            kept = self._restore.kept_path(record.name) if self._restore is not None else None
            return kept or self.store.path(record.name)

        return batch.requests(read_files(self.store, self.manifest(), self._dir), self.config, where)

    def _check_container(self, record: FileRecord) -> None:
        """Before reading a container: it is here (an absent one, another node's or lost, is
        told apart from a damaged one), and its own header agrees with the index (once per load)."""
        if self._restore is not None and self._restore.kept_path(record.name) is not None:
            return  # only ranges are kept, without the header: every byte read is checked against its blocks
        if record.name not in self._checked:
            view = self._plain_view()
            try:
                view.size(record.name)
            except FileNotFoundError:
                raise self.manifest().missing_file_error(record.name, record.rank, self._dir) from None
            check_container(view, record, self.manifest(), self._dir, self.config.verify)
            self._checked.add(record.name)

    def _plain_view(self) -> Any:
        """The store as the plain checkpoint it holds: a compressed mirror's rank files are
        read through their decoder, so their headers are checked like any other."""
        if self.manifest().compression is None:
            return self.store
        return seams.decoded_store(self.store, self.manifest(), self._dir)

