"""Items several ranks hold, kept once per checkpoint directory instead of once per job.

DCP's planner writes each item that several ranks hold -- every DDP parameter, AdamW's
per-parameter ``step``, a non-tensor value, a shard an HSDP mesh replicates across nodes -- on
one rank of the whole job (``dedup_save_plans``). With one shared directory that is all a
restart needs. With a disk per node, a node whose ranks hold an item that a rank elsewhere wrote
cannot restart from its own disk.

So in a node-local save the coordinator gives each directory one copy of every item its ranks
held before DCP's dedup: for an item none of the directory's ranks writes after it, the holder
there with the least planned bytes writes it too (``add_copies``). The copies go last in that
rank's plan; their index rows go to the checkpoint's ``copies`` table, and the index keeps DCP's
choice, so it still has one row per chunk (stock readers, the mirror and a resharding load read
it as before) and a reader takes a copy only where the index's file is not on its disk
(``load.reader``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from dcp_nvme.host.job import Topology

ENABLED = True
"""A switch for benchmarks and tests only (the job-wide dedup, as before, when False): a
node-local save without its copies cannot restart on its own nodes."""


def directory_of_each_rank(topology: Topology) -> list[str]:
    """The directory each rank writes to: its node's where that node has a disk of its own
    (a node writer commits there), else the coordinator's (``""``)."""
    own = {topology.rank_nodes[rank] for rank in topology.node_writers}
    return [node if node in own else "" for node in topology.rank_nodes]


def _bytes(item: WriteItem) -> int:
    return item.tensor_storage_size() or 1  # as DCP's dedup weighs a non-tensor item


def add_copies(plans: Sequence[SavePlan], held: Sequence[Sequence[WriteItem] | None],
               directories: Sequence[str]) -> tuple[list[SavePlan], list[int], int]:
    """``plans`` (after the planner's dedup) with each directory's missing items appended, per
    rank how many of its items are the planner's (the rest are copies), and the copies' bytes.

    ``held[rank]`` is the rank's local plan before the dedup (None: not known, nothing added).
    Deterministic: holders are taken in rank order and items in each rank's plan order."""
    written: dict[str, set[MetadataIndex]] = {}
    load = []
    for rank, plan in enumerate(plans):
        written.setdefault(directories[rank], set()).update(item.index for item in plan.items)
        load.append(sum(map(_bytes, plan.items)))
    holders: dict[tuple[str, MetadataIndex], list[tuple[int, WriteItem]]] = {}
    for rank, items in enumerate(held):
        directory = directories[rank]
        have = written.setdefault(directory, set())
        for item in items or ():
            if item.index not in have:
                holders.setdefault((directory, item.index), []).append((rank, item))
    extra: list[list[WriteItem]] = [[] for _ in plans]
    copied = 0
    for candidates in holders.values():
        rank, item = min(candidates, key=lambda pair: load[pair[0]])
        extra[rank].append(item)
        load[rank] += _bytes(item)
        copied += _bytes(item)
    primary = [len(plan.items) for plan in plans]
    out = [replace(plan, items=[*plan.items, *more]) if more else plan for plan, more in zip(plans, extra)]
    return out, primary, copied
