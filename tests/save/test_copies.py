"""Items several ranks hold, once per checkpoint directory (``save.copies``), and the reader's
choice of this node's copy (``format.copies``), pure. tests/cross/test_node_local_states.py
saves and restarts the states trainers build on simulated nodes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.copies import local_copies
from dcp_nvme.format.manifest import Manifest
from dcp_nvme.format.tables import ChunkRecord
from dcp_nvme.host.job import NODE_LOCAL, SHARED, Topology
from dcp_nvme.save.copies import add_copies, directory_of_each_rank


def _local_plans(states):
    plans = []
    for state in states:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=False)
        plans.append(planner.create_local_plan())
    return plans


def _states(world: int):
    """A DDP-like state: ``w`` and ``step`` on every rank, ``own.<r>`` on rank r alone; ``big``
    on every rank, so that the least-loaded holder matters."""
    return [{"w": torch.arange(8.0), "big": torch.zeros(1000), "step": 7, f"own.{r}": torch.full((4,), float(r))}
            for r in range(world)]


def test_each_directory_gets_every_item_its_ranks_hold_once():
    local = _local_plans(_states(4))
    deduped = dedup_save_plans(local)  # DCP's default: each replicated item on one rank of the job
    directories = ["", "", "1", "1"]  # ranks 0-1 share the coordinator's directory, 2-3 have node 1's
    plans, primary, copied = add_copies(deduped, [p.items for p in local], directories)

    assert primary == [len(p.items) for p in deduped]
    for plan, before in zip(plans, deduped):
        assert plan.items[:len(before.items)] == before.items  # DCP's choice first, unchanged
    for directory in ("", "1"):
        ranks = [r for r, d in enumerate(directories) if d == directory]
        written = [item.index for r in ranks for item in plans[r].items]
        held = {item.index for r in ranks for item in local[r].items}
        assert sorted(map(str, written)) == sorted(map(str, held)), directory  # each once, all of them
    assert copied == sum(i.tensor_storage_size() or 1 for r in range(4) for i in plans[r].items[primary[r]:])


def test_a_copy_goes_to_the_holder_with_the_fewest_planned_bytes():
    local = _local_plans(_states(4))
    deduped = dedup_save_plans(local, save_to_lowest_rank=True)  # every replicated item on rank 0
    plans, primary, _ = add_copies(deduped, [p.items for p in local], ["", "", "1", "1"])
    copies = {i.index.fqn: r for r in range(4) for i in plans[r].items[primary[r]:]}
    # node 1: ranks 2 and 3 hold 16 bytes each; w (32 B) to rank 2, big (4000 B) then to rank 3,
    # step to rank 2 again; the coordinator's directory already has all of them (rank 0)
    assert copies == {"w": 2, "big": 3, "step": 2}


def test_one_directory_or_unknown_holders_add_nothing():
    local = _local_plans(_states(2))
    deduped = dedup_save_plans(local)
    plans, primary, copied = add_copies(deduped, [p.items for p in local], ["", ""])
    assert [p.items for p in plans] == [p.items for p in deduped] and copied == 0
    plans, primary, copied = add_copies(deduped, [None, None], ["0", "1"])  # writers DCP did not plan through ours
    assert [p.items for p in plans] == [p.items for p in deduped] and copied == 0


def test_directories_follow_the_node_writers():
    topology = Topology(NODE_LOCAL, ("0", "0", "1", "1", "2", "2"), node_writers=(4,))  # node 1 shares
    assert directory_of_each_rank(topology) == ["", "", "", "", "2", "2"]
    assert directory_of_each_rank(Topology(SHARED, ("0", "1"))) == ["", ""]


def _chunk(file: str, offset: int, sizes=(8,), dtype="float32", key="w") -> ChunkRecord:
    n = 1
    for s in sizes:
        n *= s
    return ChunkRecord("w", "tensor", (0,), tuple(sizes), (8,), dtype, file, offset, 4 * n, key)


def _manifest(copies: list[ChunkRecord]) -> Manifest:
    manifest = Manifest({"files": [{"name": "a", "rank": 0, "size": 4096}, {"name": "b", "rank": 2, "size": 4096}]})
    manifest.copies = copies
    return manifest


def test_the_reader_takes_the_copy_on_its_own_disk():
    index = {MetadataIndex("w", (0,)): _chunk("a", 512)}
    moved = local_copies(_manifest([_chunk("b", 1024, key="w.copy")]), {"b"}, index, "/ckpt")
    assert moved == {("w", (0,)): _chunk("b", 1024, key="w.copy")}
    assert local_copies(_manifest([_chunk("b", 1024)]), {"a", "b"}, index, "/ckpt") == {}  # the index's file is here
    assert local_copies(_manifest([_chunk("a", 1024)]), {"b"}, index, "/ckpt") == {}  # the copy is not here


@pytest.mark.parametrize("copy, words", [
    (_chunk("b", 1024, sizes=(4,)), "the index says"),  # another shape: its bytes would not fit
    (_chunk("b", 1024, dtype="float64"), "the index says"),
    (ChunkRecord("v", "tensor", (0,), (8,), (8,), "float32", "b", 1024, 32, "v"), "the index does not have"),
])
def test_a_copy_that_is_not_its_chunk_is_refused(copy, words):
    index = {MetadataIndex("w", (0,)): _chunk("a", 512)}
    with pytest.raises(ManifestError, match=words):
        local_copies(_manifest([copy]), {"b"}, index, "/ckpt")
