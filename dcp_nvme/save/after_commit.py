"""What follows a save's commit on each node that committed it: the files of other saves removed
while the save lock is still held (``dropin.remove_other_saves``), then this node's replication
(the ``replicate`` seam) and its drain to the mirror (the ``drain`` seam) started in the
background.

The coordinator runs it from ``NVMeWriter.finish``; a node writer hands it to its
``node_commit.NodeCommitter``, whose thread runs it once the node's copy committed. It holds the
writer's settings as they were when the save began, never the writer: a node commit may end
after the writer has moved on to its next checkpoint."""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any

from dcp_nvme import seams
from dcp_nvme.host.job import node_identity
from dcp_nvme.save.dropin import remove_other_saves
from dcp_nvme.storage.save_lock import SaveLock

log = logging.getLogger(__name__)


@dataclass
class Started:
    """What a writer's after-commit work started, shared by the writer and each ``AfterCommit``
    it made: the last save's background work on this node."""

    replication_future: concurrent.futures.Future[Any] | None = None
    drain_future: concurrent.futures.Future[Any] | None = None
    mirrored: dict[str, str] = field(default_factory=dict)
    """Mirror URL -> the checkpoint drained there: one URL holds one checkpoint."""


@dataclass
class AfterCommit:
    """One save's after-commit work on one node."""

    directory: str
    """The directory this save committed in (the writer's ``checkpoint_id`` of that save)."""
    label: str
    """How messages name the checkpoint."""
    started: Started
    replicas: int = 0
    replica_options: dict[str, Any] = field(default_factory=dict)
    """``queue_depth``, ``block_size``, ``bandwidth`` and ``stride`` of the replication."""
    mirror: str | None = None
    mirror_options: dict[str, Any] | None = None
    compress: str | None = None

    def remove_other_saves(self, key: str, lock: SaveLock | None) -> None:
        """Committed and loadable: what other saves left here is garbage; a failure to remove it
        is only logged."""
        try:
            remove_other_saves(self.directory, key, lock, self.label)
        except OSError as exc:
            log.warning("dcp_nvme: %s committed, but removing files of other saves failed: %s", self.label, exc)

    def start(self) -> None:
        """This node's replication and its drain to the mirror, on in the background."""
        if self.replicas:
            self.started.replication_future = seams.replicate(
                self.directory, node_identity(), self.replicas, **self.replica_options)
        if self.mirror:
            self.started.mirrored[self.mirror] = self.directory
            self.started.drain_future = seams.drain(self.directory, self.mirror, self.mirror_options,
                                                    compress=self.compress)

    def run(self, key: str, lock: SaveLock | None) -> None:
        """On a node writer, its node's copy committed: what the coordinator does after its own."""
        self.remove_other_saves(key, lock)
        self.start()  # each node drains the files on its own disk
