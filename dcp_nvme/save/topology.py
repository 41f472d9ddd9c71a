"""Where a checkpoint's directory lives: one filesystem every rank sees, or each node its own.

The same path (``/nvme/run1/step_10``) may name one parallel-filesystem directory shared by all
ranks, or a directory on each node's local NVMe. The writer finds out while DCP plans, with no
collective of its own: each node's first rank (``LOCAL_RANK`` 0; every rank where torchrun did
not say) creates a probe file of a random name in the directory and names it in its local plan;
the coordinator then looks for each node's probe by that name. A node whose probe it sees shares
its directory; a node whose probe it cannot see has a disk of its own, and must get its own copy
of the checkpoint's metadata (``node_commit``). Looking a fresh random name up by name is exact
on NFS too (no cached listing or negative entry can hide it).

Node identity: torchrun's ``GROUP_RANK`` (the node rank) when set, else the host name.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import node_identity  # noqa: F401  (its home is config: load needs it too)
from ..errors import InvalidInputError, StorageError

SHARED = "shared"
NODE_LOCAL = "node-local"
MODES = (SHARED, NODE_LOCAL)
PROBE_PREFIX = ".dcp_nvme-probe."


@dataclass(frozen=True)
class NodeTag:
    """What a rank's local plan tells the coordinator about where it runs."""

    host: str
    node: str
    probe: str | None = None
    """The probe file this rank created in the checkpoint directory (node leaders only)."""


@dataclass(frozen=True)
class Topology:
    """The coordinator's finding, handed to every rank in its plan and kept in the manifest."""

    mode: str
    rank_nodes: tuple[str, ...]
    """The node of each rank."""
    node_writers: tuple[int, ...] = ()
    """One rank per node that does not share the coordinator's directory: it commits the
    metadata there. Empty in shared mode."""

    def to_doc(self) -> dict[str, Any]:
        names = sorted(set(self.rank_nodes), key=_node_order)
        index = {name: i for i, name in enumerate(names)}
        return {"mode": self.mode, "nodes": names, "rank_nodes": [index[n] for n in self.rank_nodes]}

    def ranks_of(self, node: str) -> list[int]:
        return [rank for rank, name in enumerate(self.rank_nodes) if name == node]


def _node_order(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def leads_its_node(environ: dict[str, str] | None = None) -> bool:
    """Whether this rank probes for its node: ``LOCAL_RANK`` 0, or any rank when it is unset."""
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_RANK", "").strip()
    return raw in ("", "0")


def write_probe(directory: str) -> str:
    """Create a probe file of a fresh random name in ``directory``; return its name."""
    name = PROBE_PREFIX + secrets.token_hex(8)
    try:
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot create {os.path.join(directory, name)} (the probe that "
                                      f"tells whether nodes share the directory): {exc.strerror}") from exc
    return name


def probe_visible(directory: str, name: str) -> bool:
    return os.path.lexists(os.path.join(directory, name))


def remove_probe(directory: str, name: str | None) -> None:
    if name:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def is_probe(name: str) -> bool:
    return name.startswith(PROBE_PREFIX)


def decide(coordinator: int, tags: Sequence[NodeTag | None], visible: Callable[[str], bool]) -> Topology:
    """The topology of a save from every rank's tag (pure, given ``visible``: whether the
    coordinator sees a probe file of that name).

    A rank without a tag (a writer DCP did not plan through ours) counts as on the coordinator's
    node. A node other than the coordinator's is on the coordinator's filesystem when any of its
    probes is visible; otherwise its lowest probing rank commits its copy of the metadata."""
    own = tags[coordinator].node if tags[coordinator] is not None else ""
    nodes = tuple(tag.node if tag is not None else own for tag in tags)
    probes: dict[str, list[tuple[int, str]]] = {}
    for rank, tag in enumerate(tags):
        if tag is not None and tag.probe:
            probes.setdefault(tag.node, []).append((rank, tag.probe))
    writers = []
    for node in sorted(set(nodes) - {own}, key=_node_order):
        seen = probes.get(node, [])
        if not seen:
            raise InvalidInputError(
                f"node {node} sent no probe of the checkpoint directory (no rank there has "
                "LOCAL_RANK=0): set LOCAL_RANK and GROUP_RANK as torchrun does, or unset both")
        if not any(visible(probe) for _, probe in seen):
            writers.append(min(rank for rank, _ in seen))
    return Topology(NODE_LOCAL if writers else SHARED, nodes, tuple(writers))
