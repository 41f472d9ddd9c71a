"""The target as a whole: whose mirror it holds, small files written and read back, and
(node-local) whether every node's files are on it, before the manifest goes."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from dcp_nvme.format.container import MANIFEST
from dcp_nvme.tiers.coded import same_save
from dcp_nvme.tiers.journal import Journal
from dcp_nvme.tiers.options import DrainOptions
from dcp_nvme.tiers.sinks import Sink
from dcp_nvme.tiers.source import DrainSource
from dcp_nvme.tiers.transfer import (
    IncompleteOnTarget,
    NodeSilent,
    TargetTaken,
    step,
)

log = logging.getLogger(__name__)


def _checkpoint_of(manifest: dict[str, Any]) -> str | None:
    meta = manifest.get("storage_meta")
    return meta.get("checkpoint_id") if isinstance(meta, dict) else None


def refuse_other_checkpoint(doc: dict[str, Any], sink: Sink) -> None:
    """A target whose committed manifest is another checkpoint's (another step drained onto the
    same URL) is never replaced: retention would then trust a mirror that no longer holds the
    checkpoint it deletes locally. ``doc``: the manifest of the save being drained."""
    if not sink.has(MANIFEST):
        return
    try:
        remote = json.loads(sink.read_small(MANIFEST))
    except ValueError:
        return  # not a manifest we can read: the drain replaces it as it would any leftover
    theirs, ours = _checkpoint_of(remote), _checkpoint_of(doc)
    if theirs and ours and theirs != ours:
        raise TargetTaken(f"{sink.target} holds the mirror of {theirs}, not of {ours}: one mirror URL holds one "
                          "checkpoint. Drain to a URL of its own (NVMeWriter(mirror_root=...) appends each "
                          "checkpoint's directory name)")


NODE_MARKER = ".drain-node.{key}.{node}"
"""On the target: node ``node`` confirmed its files of save ``key`` there (JSON: names, sizes)."""


NODE_ALIVE = ".drain-alive.{key}.{node}"
"""On the target: node ``node``'s drain of save ``key`` is running (a counter it rewrites)."""


class Heartbeat:
    """While a node's drain of a node-local save runs: its nodes' ``NODE_ALIVE`` files on the
    target, rewritten every ``interval`` seconds from a thread of their own (a failed write is
    tried again at the next beat)."""

    def __init__(self, sink: Sink, key: str, nodes: list[str], interval: float) -> None:
        self.sink, self.names, self.interval = sink, [NODE_ALIVE.format(key=key, node=n) for n in nodes], interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="dcp-nvme-drain-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        beat = 0
        while True:
            beat += 1
            for name in self.names:
                try:
                    self.sink.put_small(name, json.dumps({"beat": beat, "pid": os.getpid()}).encode())
                except Exception as exc:  # noqa: BLE001  the drain itself says what is wrong with the target
                    log.debug("dcp_nvme: heartbeat %s on %s not written: %s", name, self.sink.target, exc)
            if self.stopped.wait(self.interval):
                return

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)  # a beat held by an unreachable target must not hold the drain's end


def heartbeat_interval(options: DrainOptions) -> float:
    """A beat several times per silence limit, at most every 30 s."""
    return min(30.0, options.node_silence / 5)


def _alive(sink: Sink, key: str, node: str) -> bytes | None:
    try:
        return sink.read_small(NODE_ALIVE.format(key=key, node=node))
    except FileNotFoundError:
        return None


def wait_for_every_node(sink: Sink, source: DrainSource, options: DrainOptions, journal: Journal) -> None:
    """A node-local checkpoint's mirror: say which files this node confirmed, then wait until
    every node has (or the manifest of this save is already committed there), giving up on a
    node whose heartbeat stays the same for ``node_silence`` seconds. The journal's cause says
    which nodes it waits for (``dcp-nvme status``)."""
    key, by_node = source.save_key, source.manifest.files_by_node()
    for node in source.nodes_here:
        sizes = {name: source.files[name].size for name in by_node[node]}
        put_confirmed(sink, NODE_MARKER.format(key=key, node=node), json.dumps(sizes, sort_keys=True).encode())
    began = time.monotonic()
    deadline, pause, said = began + options.node_wait, 0.05, None
    heard: dict[str, tuple[bytes | None, float]] = {}  # node -> (its last heartbeat, when it changed)
    while True:
        waiting = [node for node in by_node if not sink.has(NODE_MARKER.format(key=key, node=node))]
        if not waiting or (sink.has(MANIFEST) and same_save(sink.read_small(MANIFEST), source.manifest_bytes)):
            journal.update(cause="", nodes_confirmed=sorted(by_node))
            return
        if waiting != said:
            said = waiting
            journal.update(cause=f"node(s) {', '.join(source.nodes_here)} sent; waiting for node(s) "
                                 f"{', '.join(waiting)} to drain their files",
                           nodes_confirmed=sorted(set(by_node) - set(waiting)))
        now = time.monotonic()
        for node in waiting:
            beat = _alive(sink, key, node)
            if node not in heard or heard[node][0] != beat:
                heard[node] = (beat, now if node in heard or beat is not None else began)
        silent = [node for node in waiting if now - heard[node][1] >= options.node_silence]
        if silent:
            raise NodeSilent(
                f"{sink.target}: node(s) {', '.join(silent)} did not drain their files of save {key} and wrote "
                f"no heartbeat there for {options.node_silence:.0f} s (node_silence): the node died, or its "
                "drain stopped (its log and `dcp-nvme status` there say why); not committing. What this node "
                "sent stays on the target: `dcp-nvme drain PATH` on each node resumes")
        if time.monotonic() >= deadline:
            raise IncompleteOnTarget(
                f"{sink.target}: node(s) {', '.join(waiting)} did not drain their files of save {key} "
                f"within {options.node_wait:.0f} s (each node drains its own); not committing")
        time.sleep(pause)
        pause = min(pause * 2, 2.0)


def put_confirmed(sink: Sink, name: str, data: bytes, commit: bool = False) -> None:
    """Write a small file and read it back; a manifest that does not read back is removed."""
    where = sink.location(name)
    with step(f"{'committing' if commit else 'writing'} {where}"):
        sink.put_small(name, data)
    with step(f"reading back {where}"):
        back = sink.read_small(name)
    if back != data:
        if commit:
            sink.remove(name)
        raise IncompleteOnTarget(f"{where} reads back as {len(back)} bytes that differ from the "
                                 f"{len(data)} written; not committing")
