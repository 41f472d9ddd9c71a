"""Where the optional systems plug into the core.

The core -- what a plain ``dcp.save``/``dcp.load``/``dcp.async_save`` runs: ``save/``, ``load/``,
``format/``, ``engines/``, ``storage/``, ``host/`` -- never imports the optional systems (``tiers/``:
the drain and its compression; ``peers/``: replicas and restores from other nodes; ``observe/``:
drive health and block-layer advice). It calls the seams below instead. ``dcp_nvme/__init__.py``
plugs each one with the dotted name of the function that does the work, imported at its first
call, so a save without a mirror, replicas or diagnostics never loads them.

A seam left unplugged raises a clear error when called; its ``plugged`` says whether it is.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from dcp_nvme.config import IOConfig
from dcp_nvme.errors import ChecksumMismatchError, MissingDependencyError

if TYPE_CHECKING:  # named in the signatures; `import dcp_nvme` loads neither torch nor these
    import torch

    from dcp_nvme.engines.requests import IOStats, PhaseTimer, ReadRequest
    from dcp_nvme.format.manifest import ChunkRecord, Manifest
    from dcp_nvme.storage.local_dir import Store

F = TypeVar("F", bound=Callable[..., Any])


class Seam(Generic[F]):
    """One hook point: a callable the core calls, plugged by name (``"module:function"``) or
    with a function. ``F``, a Protocol below, is the signature the core calls it with and a
    target must have (``tests/cross/test_seams.py`` checks the plugged ones)."""

    def __init__(self, name: str, what: str) -> None:
        self.name = name
        self.what = what
        self._target: str | F | None = None
        self._lock = threading.Lock()
        self.plugged = False
        """Whether a target is plugged in (an attribute: asking costs a save no call)."""

    def plug(self, target: str | F | None) -> None:
        """Plug ``target`` in (None unplugs)."""
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"seam {self.name}: {target!r} is not 'module:function'")
        with self._lock:
            self._target = target
            self.plugged = target is not None

    def function(self) -> F:
        """The plugged function, imported now if it was plugged by name (outside the lock: an
        import takes Python's own import lock, and holding ours meanwhile could deadlock)."""
        target = self._target
        if target is None:
            raise MissingDependencyError(f"dcp_nvme: nothing is plugged into the {self.name} seam "
                                         f"({self.what}); import dcp_nvme, which plugs it")
        if not isinstance(target, str):
            return target
        module, _, attr = target.partition(":")
        found: F = getattr(importlib.import_module(module), attr)
        with self._lock:
            if self._target is target:  # not re-plugged meanwhile: keep the function, not the name
                self._target = found
        return found

    if TYPE_CHECKING:
        __call__: F  # a call is checked against the seam's signature
    else:

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.function()(*args, **kwargs)


# -- what the core hands each seam and uses of what it returns


class Drain(Protocol):
    """``tiers.submit_mirror``: the drain of a committed checkpoint; a Future of its DrainResult."""

    def __call__(self, local: str, target: str, storage_options: dict[str, Any] | None = None, *,
                 compress: str | None = None) -> Future[Any]: ...


class Replicate(Protocol):
    """``peers.replicate.start_replication``: a Future of this node's ReplicationResult."""

    def __call__(self, directory: str, node: str, copies: int, *, queue_depth: int = ...,
                 block_size: int = ..., bandwidth: float | None = ..., stride: int = ...,
                 group: Any = ...) -> Future[Any]: ...


class ReplicationGroup(Protocol):
    def __call__(self, ranks: tuple[int, ...]) -> None: ...


@dataclass
class Wanted:
    """What a rank's load asks of its restore in ``read_data`` (``Restore.bring_in``)."""

    items: list[Any]
    """DCP's ReadItems of this rank, in file order."""
    chunks: list[ChunkRecord]
    """Where each item would be read: its index row, or a copy's."""
    here: set[str]
    """The data files on this node's disk; a restore adds those that came whole."""
    storage_data: Mapping[Any, ChunkRecord]
    read: Callable[[list[Any], IOStats, PhaseTimer, bool], int]
    """Reads items into their tensors; returns the bytes they needed (``True``: every byte is
    held in memory by the restore, none is read)."""


@dataclass
class Brought:
    """What a restore did with a ``Wanted``."""

    items: list[Any]
    """The items left for the load to read."""
    needed: int = 0
    """The bytes of the items it read itself."""
    moved: dict[tuple, ChunkRecord] = field(default_factory=dict)
    """``(fqn, offsets)`` -> where a chunk is read now (where it came to)."""


class Restore(Protocol):
    """A load's restore from the other copies of its checkpoint (``peers.restore``): in one
    process each file from the nearest copy that verifies, on several ranks the byte ranges
    this node lacks over the exchange. The reader (``load.reader.NVMeReader``) holds one."""

    def ensure_metadata(self) -> None:
        """This node's directory holds the manifest of the save to load (agreed on every rank)."""

    def begin(self, store: Store, manifest: Manifest) -> None:
        """The metadata is read: what needs no load plan may start."""

    def held_anywhere(self) -> set[str] | None:
        """The data files some node of the job holds; None in one process."""

    def refuse(self, exc: BaseException) -> None:
        """This rank cannot go on: on several ranks, every rank raises."""

    def bring_in(self, wanted: Wanted, stats: IOStats, timer: PhaseTimer) -> Brought:
        """What the items need that this node lacks, brought in (collective on several ranks)."""

    def take_held(self, requests: list[ReadRequest], dests: list[torch.Tensor]) -> list[ReadRequest]:
        """The requests whose bytes the restore holds are copied into ``dests``; the rest returned."""

    def replace_damaged(self, exc: ChecksumMismatchError) -> bool:
        """A damaged range of this node's copy, replaced from another: False if it cannot be."""

    def kept_path(self, name: str) -> str | None:
        """Where this node keeps the ranges of ``name`` a restore fetched, if any."""

    def finish(self) -> None:
        """The load is done, or failed: what runs ends, what is held is dropped."""

    def stats(self, read: IOStats, read_seconds: float) -> dict[str, Any]:
        """Fields for ``last_stats``: ``remote_bytes``, ``sources`` (per source kind)."""


class OpenRestore(Protocol):
    def __call__(self, path: str, node: str, mirror: str | None, mirror_options: dict[str, Any] | None,
                 config: IOConfig) -> Restore: ...


class CodedReads(Protocol):
    """The engine of a compressed mirror's reads (``tiers.coded.CodedEngine``)."""

    def read(self, requests: Sequence[ReadRequest], dests: Sequence[torch.Tensor]) -> IOStats: ...
    def close(self) -> None: ...


class CodedEngine(Protocol):
    def __call__(self, store: Store, manifest: Manifest, location: str,
                 config: IOConfig) -> CodedReads | None: ...


class DecodedStore(Protocol):
    def __call__(self, store: Store, manifest: Manifest, location: str) -> Store: ...


class ObjectStore(Protocol):
    """``tiers.s3_client.object_store``: an ``s3://`` checkpoint through botocore (a store with
    ``FsspecStore``'s methods and ``read_engine``), or None where fsspec must serve it."""

    def __call__(self, url: str, storage_options: dict[str, Any] | None) -> Any: ...


class MirrorRestored(Protocol):
    def __call__(self, path: str, target: str, save_key: str,
                 storage_options: dict[str, Any] | None) -> None: ...


class Diagnostics(Protocol):
    """A save's diagnostics (``observe.drive_health.SaveWatch``)."""

    def finish(self) -> dict[str, Any]: ...


class SaveDiagnostics(Protocol):
    def __call__(self, directory: str, queue_depth: int, local_ranks: int, block_size: int) -> Diagnostics: ...


drain: Seam[Drain] = Seam("drain", "after a commit, copy the checkpoint to its mirror in the background; "
             "(path, url, storage_options, compress) -> Future of a DrainResult")
replicate: Seam[Replicate] = Seam("replicate", "after a node-local commit, pull this node's files onto other nodes; "
                 "(path, node, replicas, queue_depth, block_size, bandwidth, stride) -> Future")
replication_group: Seam[ReplicationGroup] = Seam("replication_group", "with replicas, on every rank of a node-local save: make "
                         "(once) the gloo group of the ranks that replicate; (ranks) -> None")
restore: Seam[OpenRestore] = Seam("restore", "a load that may take what its node lacks from peers or a mirror; "
               "(path, node, mirror, mirror_options, config) -> a Restore")
coded_engine: Seam[CodedEngine] = Seam("coded_engine", "reads of a compressed mirror; (store, manifest, location, "
                    "config) -> an engine, or None for a plain checkpoint")
decoded_store: Seam[DecodedStore] = Seam("decoded_store", "a compressed mirror's files as the plain checkpoint they hold; "
                     "(store, manifest, location) -> a store")
object_store: Seam[ObjectStore] = Seam("object_store", "an s3:// URL read through botocore itself; "
                    "(url, storage_options) -> a store, or None for fsspec")
mirror_restored: Seam[MirrorRestored] = Seam("mirror_restored", "a step whose metadata a restore took from its mirror: journal it "
                       "as mirrored there; (path, target, save_key, storage_options) -> None")
save_diagnostics: Seam[SaveDiagnostics] = Seam("save_diagnostics", "drive health and block-layer advice around a save's write, "
                        "when asked (dcp-nvme bench/tune); (directory, queue_depth, local_ranks, "
                        "block_size) -> an object whose finish() returns fields for last_stats")
