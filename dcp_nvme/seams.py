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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from dcp_nvme.config import IOConfig
from dcp_nvme.errors import ChecksumMismatchError, MissingDependencyError

if TYPE_CHECKING:  # named in the signatures; `import dcp_nvme` loads neither torch nor these
    import torch

    from dcp_nvme.engines.requests import IOStats, ReadRequest
    from dcp_nvme.format.manifest import Manifest
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


class Sources(Protocol):
    """What a one-process load uses of its sources (``peers.sources.RestoreSources``)."""

    def ensure_metadata(self) -> None: ...
    def ensure_files(self, manifest: Manifest, names: Iterable[str]) -> None: ...
    def replace_damaged(self, manifest: Manifest, exc: ChecksumMismatchError) -> bool: ...
    def stats(self, read: Any = None, read_seconds: float = 0.0) -> dict[str, Any]: ...


class RestoreSources(Protocol):
    def __call__(self, path: str, node: str, mirror: str | None, mirror_options: dict[str, Any] | None,
                 config: IOConfig) -> Sources: ...


class Exchange(Protocol):
    """What a many-rank load uses of its restore (``peers.exchange.PeerRestore``); ``load.peer_load``
    calls its ``fetch``, ``settle`` and ``node_ranks``."""

    def agree_metadata(self) -> None: ...
    def held_anywhere(self) -> set[str]: ...


class PeerRestore(Protocol):
    def __call__(self, path: str, mirror: str | None = None,
                 mirror_options: dict[str, Any] | None = None) -> Exchange | None: ...


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
restore_sources: Seam[RestoreSources] = Seam("restore_sources", "a load that may take files from peers or a mirror; "
                       "(path, node, mirror, mirror_options, config) -> sources with ensure_metadata, "
                       "ensure_files, replace_damaged, stats")
peer_restore: Seam[PeerRestore] = Seam("peer_restore", "a load on several ranks that may take byte ranges from other nodes; "
                    "(path, mirror, mirror_options) -> None in one process, else an object with "
                    "agree_metadata() and fetch(manifest, needs, problem) -> received ranges")
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
