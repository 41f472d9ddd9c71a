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
from collections.abc import Callable
from typing import Any

from dcp_nvme.errors import MissingDependencyError


class Seam:
    """One hook point: a callable the core calls, plugged by name (``"module:function"``) or
    with a function."""

    def __init__(self, name: str, what: str) -> None:
        self.name = name
        self.what = what
        self._target: str | Callable[..., Any] | None = None
        self._lock = threading.Lock()
        self.plugged = False
        """Whether a target is plugged in (an attribute: asking costs a save no call)."""

    def plug(self, target: str | Callable[..., Any] | None) -> None:
        """Plug ``target`` in (None unplugs)."""
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"seam {self.name}: {target!r} is not 'module:function'")
        with self._lock:
            self._target = target
            self.plugged = target is not None

    def function(self) -> Callable[..., Any]:
        """The plugged function, imported now if it was plugged by name (outside the lock: an
        import takes Python's own import lock, and holding ours meanwhile could deadlock)."""
        target = self._target
        if target is None:
            raise MissingDependencyError(f"dcp_nvme: nothing is plugged into the {self.name} seam "
                                         f"({self.what}); import dcp_nvme, which plugs it")
        if not isinstance(target, str):
            return target
        module, _, attr = target.partition(":")
        found = getattr(importlib.import_module(module), attr)
        with self._lock:
            if self._target is target:  # not re-plugged meanwhile: keep the function, not the name
                self._target = found
        return found

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function()(*args, **kwargs)


drain = Seam("drain", "after a commit, copy the checkpoint to its mirror in the background; "
             "(path, url, storage_options, compress) -> Future of a DrainResult")
replicate = Seam("replicate", "after a node-local commit, pull this node's files onto other nodes; "
                 "(path, node, replicas, queue_depth, block_size, bandwidth, stride) -> Future")
replication_group = Seam("replication_group", "with replicas, on every rank of a node-local save: make "
                         "(once) the gloo group of the ranks that replicate; (ranks) -> None")
restore_sources = Seam("restore_sources", "a load that may take files from peers or a mirror; "
                       "(path, node, mirror, mirror_options, config) -> sources with ensure_metadata, "
                       "ensure_files, replace_damaged, stats")
peer_restore = Seam("peer_restore", "a load on several ranks that may take byte ranges from other nodes; "
                    "(path, mirror, mirror_options) -> None in one process, else an object with "
                    "agree_metadata() and fetch(manifest, needs, problem) -> received ranges")
coded_engine = Seam("coded_engine", "reads of a compressed mirror; (store, manifest, location, "
                    "config) -> an engine, or None for a plain checkpoint")
decoded_store = Seam("decoded_store", "a compressed mirror's files as the plain checkpoint they hold; "
                     "(store, manifest, location) -> a store")
mirror_restored = Seam("mirror_restored", "a step whose metadata a restore took from its mirror: journal it "
                       "as mirrored there; (path, target, save_key, storage_options) -> None")
save_diagnostics = Seam("save_diagnostics", "drive health and block-layer advice around a save's write, "
                        "when asked (dcp-nvme bench/tune); (directory, queue_depth, local_ranks, "
                        "block_size) -> an object whose finish() returns fields for last_stats")
