"""NVMeWriter: DCP's StorageWriter over one coalesced, checksummed container per rank.

Order of calls (DCP's): reset -> set_up_storage_writer -> prepare_local_plan ->
prepare_global_plan (coordinator) -> write_data (every rank) -> finish (coordinator).

Each rank's write (``write_data``) is: resolve the items (``items``), place them
(``format.container``), write the container through the engine under the node's turn, and hand
back WriteResults carrying the rows; ``finish`` writes the tables, then the manifest."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_nvme import seams
from dcp_nvme.compat import dcp_version
from dcp_nvme.config import (
    COMPRESS_MODES,
    WRITER_IO,
    IOConfig,
    check_option,
    option_or_default,
    option_or_env,
    resolve_config,
)
from dcp_nvme.engines import shared_engine
from dcp_nvme.engines.host_io import host_address
from dcp_nvme.engines.requests import PhaseTimer
from dcp_nvme.engines.small import take_owed, write_container
from dcp_nvme.errors import CheckpointLockedError, InvalidInputError, StorageError
from dcp_nvme.format.container import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ContainerLayout,
    data_file_name,
    new_save_key,
    plan_container,
    table_name,
)
from dcp_nvme.format.manifest import build_manifest_doc, seal, table_entry
from dcp_nvme.format.tables import files_table, index_table_bytes
from dcp_nvme.host.job import (
    NODE_LOCAL,
    NodeTag,
    Topology,
    budgeted,
    decide,
    host_name,
    job_store,
    leads_its_node,
    local_world_size,
    node_identity,
    node_turn,
    probe_visible,
    ranks_per_host,
    remove_probe,
    write_probe,
)
from dcp_nvme.save import copies
from dcp_nvme.save.after_commit import AfterCommit, Started
from dcp_nvme.save.dropin import (
    POINTER,
    held_key,
    refuse_existing,
    refuse_existing_early,
    whole_on_every_node,
    with_cached_plans,
    write_pointer,
    writer_stock_options,
)
from dcp_nvme.save.handoff import taken
from dcp_nvme.save.items import resolve_item, unique_keys, with_pads
from dcp_nvme.save.node_commit import (
    NodeCommitter,
    abort_everywhere,
    commit_on_every_node,
    end_waiting,
    start_committer,
)
from dcp_nvme.save.results import (
    check_planner_data,
    collect_rows,
    copy_rows,
    format_summary,
    key_from_results,
    layer_summary,
    rank_stats_doc,
    storage_meta_doc,
    write_results,
)
from dcp_nvme.storage import save_lock
from dcp_nvme.storage.local_dir import (
    LocalStore,
    finish_begins,
    is_local_path,
    refuse_run_dir,
    remove_save_files,
    require_location,
    save_begins,
    write_commit_file,
    write_commit_files,
    writer_location,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlan:
    """What the coordinator hands each rank in its plan's ``storage_data``."""

    rank: int
    save_key: str
    local_ranks: int = 1
    """Ranks on this rank's host, counted from the host names in the local plans."""
    node_writer: bool = False
    """This rank commits the metadata on its node, whose directory the coordinator cannot see."""
    copies_from: int | None = None
    """Where the copies (``save.copies``) start in this rank's items; None: it writes none."""
    replicators: tuple[int, ...] = ()
    """With ``replicas`` in a node-local save: the ranks that commit a node's copy (the
    coordinator and the node writers), which replicate over a group of their own."""
    overwrite: bool = False
    """The writer's ``overwrite``, or the step is not whole on every node (``whole_on_every_node``)."""


class NVMeWriter(StorageWriter):
    """Save a DCP checkpoint as one safetensors container per rank plus a Parquet manifest.

    Args:
        path: the checkpoint directory (created if missing); or None, and DCP's
            ``checkpoint_id=`` names it (``dcp.save(sd, checkpoint_id=DIR, storage_writer=NVMeWriter())``).
            A local directory only: a URL is refused (save locally with ``mirror=URL``).
        queue_depth: requests in flight per rank (env ``DCP_NVME_QUEUE_DEPTH``).
        block_size: bytes per request, e.g. ``"8MiB"`` (env ``DCP_NVME_BLOCK_SIZE``).
        direct_io: O_DIRECT where the filesystem allows it (env ``DCP_NVME_DIRECT_IO``).
        engine: ``"auto"``, ``"posix"`` (threads), ``"uring"`` (io_uring) or ``"kvikio"`` (env ``DCP_NVME_ENGINE``).
        node_queue_depth: requests in flight shared by the ranks of a node: each keeps
            ``node_queue_depth // local ranks`` (env ``DCP_NVME_NODE_QUEUE_DEPTH``; ``host.job``).
        node_write_order: ``"together"`` (the node's ranks write at once, sharing the budget) or
            ``"staggered"`` (one at a time, each with the whole budget); unset: what
            ``dcp-nvme tune --ranks`` measured faster, else ``"together"``.
        overwrite: replace a committed checkpoint at ``path``; the old one stays loadable until
            the new one commits.
        mirror, mirror_options: an fsspec URL (or directory) and its storage options: after each
            local commit the checkpoint is drained there in the background (``dcp_nvme.tiers``);
            ``writer.drain_future`` resolves when it is mirrored. One URL holds one checkpoint.
        mirror_root: the run's mirror: each checkpoint drains to ``mirror_root/<its directory
            name>``, so a writer reused with ``checkpoint_id=`` for every step gets a mirror per
            step (``mirror`` then refuses a second checkpoint).
        compress: how the drain sends to ``mirror``: ``"off"``, ``"bytegroup"``, ``"auto"`` or ``"delta"``
            (None: the drainer's option). The local checkpoint is always plain safetensors.
        replicas: with node-local disks, after each commit every node's files are pulled by this
            many other nodes into their ``<checkpoint>/.replicas/<node>/`` in the background
            (node i's go to i+1.. mod N; ``dcp_nvme.peers.replicate``), default 0.
            ``writer.replication_future`` resolves when this node's part is done.
        replica_bandwidth: bytes/s each pull may use (e.g. ``"200MB"``; unlimited by default).

    FileSystemWriter's own arguments (``sync_files``, ``thread_count``...) are accepted where
    their value is what this writer does, else refused naming the option that does that job.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *stock_args: Any,
        queue_depth: int | None = None,
        block_size: int | str | None = None,
        direct_io: bool | None = None,
        engine: str | None = None,
        node_queue_depth: int | None = None,
        node_write_order: str | None = None,
        overwrite: bool = False,
        mirror: str | None = None,
        mirror_root: str | None = None,
        mirror_options: dict[str, Any] | None = None,
        compress: str | None = None,
        replicas: int | None = None,
        replica_bandwidth: int | str | None = None,
        **stock_kwargs: Any,
    ) -> None:
        super().__init__()
        writer_stock_options(type(self), stock_args, stock_kwargs)
        self.replicas = option_or_default("replicas", replicas, 0)
        self.replica_bandwidth = option_or_default("replica_bandwidth", replica_bandwidth, None)
        self.replica_stride = option_or_env("replica_stride", None, 1)  # env only: checked here, not after a commit
        self._started = Started()
        """What the after-commit work of this writer's saves started (``after_commit``)."""
        self.path: str | None = writer_location(path)
        # the I/O keywords IOConfig gives the writer, from its arguments (locals() of __init__)
        self.config: IOConfig = resolve_config(**{n: v for n, v in locals().items() if n in WRITER_IO})
        self.overwrite = check_option("overwrite", overwrite)
        self.mirror = None if mirror is None else check_option("mirror", mirror)
        self.mirror_root = None if mirror_root is None else check_option("mirror_root", mirror_root)
        if self.mirror and self.mirror_root:
            raise InvalidInputError(
                f"mirror={self.mirror!r} and mirror_root={self.mirror_root!r} both given: mirror is one "
                "checkpoint's URL, mirror_root a run's (each checkpoint drains to mirror_root/<its "
                "directory name>); pass one")
        self.mirror_options = mirror_options
        if self.mirror or self.mirror_root:
            # the drain's module now, not at the first commit (which may come on a save thread
            # while the interpreter exits): importing it installs the exit hook that waits for drains
            seams.drain.function()
        if compress is not None and compress not in COMPRESS_MODES:
            raise InvalidInputError(f"compress must be one of {COMPRESS_MODES}, got {compress!r}")
        self.compress = compress
        self.is_coordinator = False
        self.save_key: str | None = None
        self.save_id: str = str(uuid.uuid4())
        """DCP's ``StorageMeta.save_id``: new at every reset, stored in the manifest."""
        self.use_collectives = True
        """DCP's ``use_collectives`` of the current save (False is refused on several ranks)."""
        self._rank = 0
        self.last_stats: dict[str, Any] | None = None
        """This rank's figures for its last save: bytes, seconds by phase, GB/s, requests."""
        self.last_manifest: dict[str, Any] | None = None
        """On the coordinator, the committed manifest document of the last save."""
        self._lock: save_lock.SaveLock | None = None
        """On the coordinator (and a node writer), the directory's save lock until the commit."""
        self._probe: str | None = None
        """The probe file this rank made in the directory while planning (``nodes``)."""
        self._topology: Topology | None = None
        """On the coordinator: where the ranks' directories are, found while planning."""
        self._committer: NodeCommitter | None = None
        """On a node writer: the thread committing this node's copy of the last save."""
        self._sent_plans: list[SavePlan] | None = None
        """On the coordinator: the plans of the last save, for a planner that caches
        (``dropin.with_cached_plans``)."""
        refuse_existing_early(self.path, self.overwrite)

    @property
    def drain_future(self) -> concurrent.futures.Future[Any] | None:
        """With a mirror, on the coordinator (and on each node writer of a node-local save): a
        Future of the last save's drain of this node (DrainResult)."""
        return self._started.drain_future

    @drain_future.setter
    def drain_future(self, future: concurrent.futures.Future[Any] | None) -> None:
        self._started.drain_future = future

    @property
    def replication_future(self) -> concurrent.futures.Future[Any] | None:
        """With ``replicas``, on each node writer: a Future of the last save's ReplicationResult."""
        return self._started.replication_future

    @replication_future.setter
    def replication_future(self, future: concurrent.futures.Future[Any] | None) -> None:
        self._started.replication_future = future

    @property
    def _dir(self) -> str:
        """``path``, which a save needs (the error of ``set_up_storage_writer`` on a writer given none)."""
        return require_location(type(self), self.path, "dcp.save")

    # ------------------------------------------------------------------ DCP protocol

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = writer_location(checkpoint_id)
            refuse_existing_early(self.path, self.overwrite)  # before DCP's collectives: one line
        self.save_key = None
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        require_location(type(self), self.path, "dcp.save")
        self.is_coordinator = is_coordinator
        self.use_collectives = kwargs.get("use_collectives", True)
        self._rank = kwargs.get("rank", 0)  # in the save's group: the index of this rank's plan
        # a new save on this writer: its previous one has ended. If that save failed on another
        # rank, DCP never called finish here, so its lock is still ours: release it now.
        self._release_lock()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.use_collectives and _world_size() > 1:
            # each rank would plan alone as rank 0 and commit its own manifest over the others'
            raise InvalidInputError(
                f"{self.path}: dcp_nvme saves need use_collectives=True (the default): one manifest, "
                "committed by the coordinator, describes every rank's data. Save without "
                "use_collectives=False, or give each rank its own checkpoint directory")
        refuse_run_dir(self._dir)
        try:
            os.makedirs(self._dir, exist_ok=True)
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot create checkpoint directory {self.path}: {exc.strerror}") from exc
        remove_probe(self._dir, self._probe)
        self._probe = write_probe(self._dir) if _world_size() > 1 and leads_its_node() else None
        # the coordinator counts ranks per host, and finds which nodes share its directory
        held = held_key(self._dir) if self._probe is not None else None  # is a step here whole?
        return replace(plan, storage_data=NodeTag(host_name(), node_identity(), self._probe, held, plan.items))

    def mirror_url(self) -> str | None:
        """Where this checkpoint drains: ``mirror``, or ``mirror_root`` + its directory name."""
        if self.mirror_root is None:
            return self.mirror
        name = os.path.basename(os.path.normpath(self._dir))
        root = self.mirror_root
        return f"{root.rstrip('/')}/{name}" if "://" in root else os.path.join(root, name)

    def _check_mirror_reuse(self) -> None:
        """A writer reused for another checkpoint (``checkpoint_id=``) with one ``mirror`` URL
        would drain each step over the last: refused before any byte is written."""
        url = self.mirror_url()
        earlier = self._started.mirrored.get(url) if url else None
        if earlier is not None and earlier != self.path:
            assert url is not None  # earlier was found under it
            raise InvalidInputError(
                f"mirror={url!r} already holds the mirror of {earlier}; draining {self.path} there "
                f"would replace it. Give the run's mirror as NVMeWriter(mirror_root={url.rsplit('/', 1)[0]!r}) "
                "(each checkpoint drains to <mirror_root>/<its directory name>), or a mirror per checkpoint")

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator takes the directory's save lock before any rank writes; a refusal here
        # reaches every rank through DCP's scatter of the plan, so none hangs.
        self._check_mirror_reuse()
        key = new_save_key()
        self._release_lock()
        self._lock = save_lock.acquire(self._dir, key)
        try:
            plans, cached = with_cached_plans(plans, self._sent_plans, self._dir)  # enable_plan_caching
            check_planner_data(plans)  # fail before any byte is written, not after
            tags = [plan.storage_data if isinstance(plan.storage_data, NodeTag) else None for plan in plans]
            # ours (whole on every node: a step the ranks' latest() passes over is replaced) or stock
            overwrite = refuse_existing(self._dir, self._dir, self.overwrite, whole_on_every_node(tags))
            counts = ranks_per_host([tag.host if tag else None for tag in tags])
            if not (cached and self._topology is not None):
                self._topology = decide(self._rank, tags, lambda name: probe_visible(self._dir, name))
        except BaseException:
            self._release_lock()
            raise
        save_begins(self._dir, key)  # its files go at exit unless its finish begins
        writers = set(self._topology.node_writers)
        self._sent_plans = plans
        primary: list[int | None] = [None] * len(plans)
        if self._topology.mode == NODE_LOCAL and copies.ENABLED:  # each disk: every item its node's ranks hold
            plans, counts_primary, _ = copies.add_copies(
                plans, [tag.items if tag else None for tag in tags], copies.directory_of_each_rank(self._topology))
            primary = [n if n < len(plan.items) else None for n, plan in zip(counts_primary, plans)]
        replicators = tuple(sorted(writers | {self._rank})) if self.replicas and writers else ()
        return [replace(plan, storage_data=RankPlan(rank, key, counts[rank], rank in writers, primary[rank],
                                                    replicators, overwrite))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        remove_probe(self._dir, self._probe)  # the coordinator has looked
        self._probe, self._committer = None, None
        if plan.storage_data.replicators:  # every rank, at the same point: the group is made collectively
            seams.replication_group(plan.storage_data.replicators)
        try:
            if plan.storage_data.node_writer:
                self._start_node_copy(plan.storage_data)
            return self._write_rank(plan, planner)
        except BaseException:
            if self._committer is not None:  # this node's copy will not come: stop waiting for it
                self._committer.cancel_if_waiting()
            else:
                self._release_lock()  # the coordinator's own failure ends the save: finish never comes
            raise

    def _start_node_copy(self, target: RankPlan) -> None:
        """On a node writer: this node's lock, then the thread that commits its copy (``node_commit``)."""
        self._release_lock()
        end_waiting(self._dir)  # an earlier failed save's committer lets go of this node's lock
        lock = save_lock.acquire(self._dir, target.save_key)
        try:
            refuse_existing(self._dir, f"{self.path} on node {node_identity()}", target.overwrite)
        except BaseException:
            lock.release()
            raise
        self._lock = lock  # the committer releases it when it ends (a second release is a no-op)
        self._committer = start_committer(NodeCommitter(
            job_store(), self._dir, target.save_key, target.rank, node_identity(), self._after_commit(), lock))

    def _after_commit(self) -> AfterCommit:
        """What follows this save's commit on this node, fixed now: a node writer's commit may
        end after the writer moved on to its next checkpoint."""
        return AfterCommit(
            self._dir, str(self.path), self._started, getattr(self, "replicas", 0),
            {"queue_depth": self.config.queue_depth, "block_size": self.config.block_size,
             "bandwidth": getattr(self, "replica_bandwidth", None), "stride": getattr(self, "replica_stride", 1)},
            self.mirror_url(), self.mirror_options, getattr(self, "compress", None))

    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """One rank's part of the save, as named steps: resolve and place its items, write the
        container through the engine, and hand DCP the results that carry the index rows."""
        target: RankPlan = plan.storage_data
        self.save_key = target.save_key
        future: Future[list[WriteResult]] = Future()
        if not plan.items:  # e.g. a coordinator that holds nothing: still a part of the save
            self.last_stats = {"rank": target.rank, "bytes": 0, "items": 0, "phases": {}}
            future.set_result([])
            return future
        timer = PhaseTimer()
        resolved, layout, data = self._place_items(plan, planner, target, timer)
        name = data_file_name(target.rank, target.save_key)
        written, stats = self._write_container(name, layout, data, len(plan.items), target, timer)
        self.last_stats = stats
        future.set_result(write_results(plan, resolved, layout, written, stats, target.copies_from))
        return future

    def _place_items(self, plan: SavePlan, planner: SavePlanner, target: RankPlan, timer: PhaseTimer):
        """Each item as bytes (``items``), placed in this rank's container (``format.container``):
        host tensors congruent to their addresses, so they are written from their memory."""
        with timer.span("resolve"):
            resolved = unique_keys([resolve_item(item, planner.resolve_data(item)) for item in plan.items])
            sources = [source for _, source, _ in resolved]
        with timer.span("plan"):
            layout = plan_container([spec for spec, _, _ in resolved], {
                "format": FORMAT, "format_version": str(FORMAT_VERSION),
                "rank": str(target.rank), "save_key": target.save_key,
            }, addresses=[host_address(s) for s in sources], pad_tag=target.rank, sharding=True)
            data = with_pads(sources, layout)
        return resolved, layout, data

    def _write_container(self, name: str, layout: ContainerLayout, data: list[torch.Tensor], items: int,
                         target: RankPlan, timer: PhaseTimer):
        """The container written and fsynced under the node's budget (and turn); a failure
        leaves no partial file. Returns the engine's result and this rank's figures."""
        has_device = any(s.device.type != "cpu" for s in data)
        on_node = local_world_size(target.local_ranks) if self.config.node_queue_depth else target.local_ranks
        config = budgeted(self.config, on_node)
        engine, reason = shared_engine(config, has_device, self.path)
        path = os.path.join(self._dir, name)
        watch = seams.save_diagnostics(self._dir, config.queue_depth, on_node, config.block_size) \
            if seams.save_diagnostics.plugged else None  # when asked: dcp-nvme bench and tune
        wave = taken(data)  # a bounded stager's live tensors are in this save
        defer = self.is_coordinator and getattr(self._topology, "mode", NODE_LOCAL) != NODE_LOCAL  # fsync at commit
        try:
            with timer.span("write"), self._turn(config) as waited:
                began_unix = time.time()
                written = write_container(engine, path, layout.header, data, config, defer, wave and wave.progress)
                write_unix = (began_unix, time.time())  # wall clock: comparable across ranks
            timer.add("turn_wait", waited)  # a part of "write": the other local ranks' turns
            if wave is not None:
                wave.release()  # every byte is written: the live tensors are free in any case
        except BaseException as exc:
            if wave is not None:
                wave.release(exc)
            try:  # a failed save leaves no partial data behind (it would never load anyway)
                os.unlink(path)
            except OSError:
                pass
            raise
        io_stats = written.stats.to_dict()
        timer.add("fsync", written.stats.fsync_seconds)  # a part of "write", shown on its own
        stats = {
            "rank": target.rank, "file": name, "items": items, "bytes": written.size,
            "engine": engine.name, "engine_reason": reason, "config": config.to_dict(),
            "phases": {k: round(v, 6) for k, v in timer.phases.items()}, "io": io_stats,
            "host": host_name(), "local_ranks": on_node, "write_order": config.node_write_order,
            "write_unix": [round(t, 6) for t in write_unix],
            **(watch.finish() if watch is not None else {}),
        }
        _log_write(stats)
        return written, stats

    def _turn(self, config: IOConfig) -> contextlib.AbstractContextManager[float]:
        """The node's write turn when ranks write staggered, else nothing to wait for."""
        return node_turn(self._dir) if config.node_write_order == "staggered" else contextlib.nullcontext(0.0)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        started = time.perf_counter()
        store = LocalStore(self._dir)
        key = self.save_key or (self._lock.save_key if self._lock else None) or key_from_results(results)
        after = self._after_commit()
        committed = False
        try:
            finish_begins(self._dir, key)
            doc = self._commit(metadata, results, key)
            committed = True
            after.remove_other_saves(key, self._lock)  # committed and loadable: leftovers are garbage
        except BaseException:
            if not committed:  # nothing of this save may stay behind looking like a checkpoint
                if self._topology is not None and self._topology.mode == NODE_LOCAL:
                    abort_everywhere(job_store(), key)  # a no-op where the nodes already decided
                remove_save_files(self._dir, key)
                if not store.has(MANIFEST):  # no checkpoint here for the pointer to explain
                    store.remove(POINTER)
            raise
        finally:
            self._release_lock()
        doc["commit_seconds"] = time.perf_counter() - started
        self.last_manifest = doc
        if self.last_stats is not None:
            self.last_stats.setdefault("phases", {})["commit"] = round(doc["commit_seconds"], 6)
        after.start()  # this node's replication and drain run on in the background

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]], key: str) -> dict[str, Any]:
        """The tables, then manifest.json renamed into place: the commit. Returns the manifest."""
        rows, files, rank_stats = collect_rows(metadata, results)
        layers = layer_summary(rank_stats)
        log.info("dcp_nvme: save %s: %s", key, format_summary(layers))
        index_bytes = index_table_bytes(rows)
        blocks_bytes = files_table(files)
        index_name, blocks_name = table_name("index", key), table_name("blocks", key)
        tables = [(index_name, index_bytes), (blocks_name, blocks_bytes)]
        copied = copy_rows(results)
        if copied is not None:  # items on several nodes' disks (save.copies)
            tables.append((table_name("copies", key), index_table_bytes(copied)))
        doc = build_manifest_doc(
            save_key=key, files=files,
            index=table_entry(index_name, index_bytes), blocks=table_entry(blocks_name, blocks_bytes),
            world_size=len(results), planner_data=metadata.planner_data,
            dcp_version=metadata.version or dcp_version(),  # what the stock writer records
            storage_meta=storage_meta_doc(self.storage_meta()),
            extra={"created_unix": time.time(), "config": self.config.to_dict(),
                   **rank_stats_doc(rank_stats, layers),
                   **({"topology": self._topology.to_doc()} if self._topology is not None else {}),
                   **({"copies": table_entry(*tables[2])} if copied is not None else {})},
        )
        sealed = seal(doc)  # everything that can fail happens before the commit
        write_pointer(LocalStore(self._dir))
        if self._lock is not None and not self._lock.held():
            raise CheckpointLockedError(
                f"{self.path}: this save ({key}) lost its save lock before its commit (it was "
                "broken as stale); nothing was committed")
        if (topology := self._topology) is not None and topology.mode == NODE_LOCAL:  # every node's own disk
            for name, data in tables:
                write_commit_file(self._dir, name, data, key)
            writers = {rank: topology.rank_nodes[rank] for rank in topology.node_writers}
            commit_on_every_node(job_store(), self._dir, key, sealed, tables, writers)
        else:  # the tables and the manifest fsynced together, then renamed: the manifest's rename is the commit
            write_commit_files(self._dir, [*tables, (MANIFEST, sealed)], key, take_owed(self._dir, key))
        return doc

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def __getstate__(self) -> dict[str, Any]:
        # a Future does not pickle (PROCESS mode); a lock belongs to the process that took it
        return {**self.__dict__, "_started": Started(mirrored=dict(self._started.mirrored)), "_lock": None,
                "_committer": None}

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_local_path(checkpoint_id)


def _log_write(stats: dict[str, Any]) -> None:
    rank, io = stats["rank"], stats["io"]
    log.info("dcp_nvme: rank %d wrote %s: %.3f GB in %.3f s (%.2f GB/s), %d requests, depth %d, "
             "p50 %.2f ms, p99 %.2f ms", rank, stats["file"], stats["bytes"] / 1e9,
             io["seconds"], io["gbps"], io["requests"], io["max_inflight"],
             io["latency_p50_ms"], io["latency_p99_ms"])


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
