"""Multi-rank conformance cases, run for every backend inside one spawned gloo group per world size.

Starting processes costs far more than a checkpoint of a few small tensors, so one spawn runs
every case for both backends in turn and records each case's outcome per rank in a JSON file;
``test_conformance.py`` turns each (backend, case) into its own test. Cases check their own
rank's local data (no gather), so a failing case cannot leave another rank waiting.
"""

from __future__ import annotations

import io
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction

import torch
import torch._dynamo  # noqa: F401  DTensor imports it on first use (seconds); here it is imported once,
import torch.distributed as dist  # in the forkserver, not in every rank
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.conformance_backends import BACKENDS, Backend, assert_bitwise, full_tensor
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

CROSS_WORLD = "cross_world"
"""Checkpoints the 4-rank run leaves for the 2-rank run and the single-process tests to load."""


@dataclass
class Ctx:
    backend: Backend
    rank: int
    world: int
    root: str
    shared: str
    """Where the 4-rank run leaves checkpoints for other world sizes (one folder per backend)."""
    case: str = ""
    _meshes: dict[tuple[int, ...], DeviceMesh] = field(default_factory=dict)

    def path(self, tag: str = "ckpt") -> str:
        return os.path.join(self.root, self.backend.name, self.case, tag)

    def cross_world_path(self) -> str:
        return os.path.join(self.shared, self.backend.name, CROSS_WORLD)

    def mesh(self, *shape: int) -> DeviceMesh:
        if shape not in self._meshes:  # a 2-D mesh creates sub-groups: build each shape once
            self._meshes[shape] = init_device_mesh("cpu", shape)
        return self._meshes[shape]

    def save(self, state: dict, tag: str = "ckpt", overwrite: bool | None = None) -> None:
        dcp.save(state, storage_writer=self.backend.writer(self.path(tag), overwrite=overwrite))

    def load(self, state: dict, tag: str = "ckpt") -> None:
        dcp.load(state, storage_reader=self.backend.reader(self.path(tag)))


CASES: dict[str, tuple[tuple[int, ...], Callable[[Ctx], None]]] = {}
"""name -> (world sizes it runs at, function)."""


def case(*worlds: int):
    def register(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        CASES[fn.__name__] = (worlds, fn)
        return fn
    return register


# --------------------------------------------------------------------------- DTensor helpers


def dtensor(full: torch.Tensor, mesh: DeviceMesh, placements: list[Placement]) -> DTensor:
    return distribute_tensor(full, mesh, placements, src_data_rank=None)  # local chunking, no comm


def empty_like_dtensor(full: torch.Tensor, mesh: DeviceMesh, placements: list[Placement],
                       dtype: torch.dtype | None = None) -> DTensor:
    return dtensor(torch.full_like(full, -7, dtype=dtype or full.dtype), mesh, placements)


def check_dtensor(loaded: DTensor, full: torch.Tensor, what: str) -> None:
    expected = dtensor(full.to(loaded.dtype), loaded.device_mesh, list(loaded.placements))
    assert_bitwise(loaded.to_local(), expected.to_local(), what)


def reshard_roundtrip(ctx: Ctx, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      save_layout: Callable[[str], tuple[DeviceMesh, list[Placement]]],
                      load_layout: Callable[[str], tuple[DeviceMesh, list[Placement]]]) -> None:
    full = {name: full_tensor(name, shape, dtype) for name, (shape, dtype) in tensors.items()}
    ctx.save({name: dtensor(t, *save_layout(name)) for name, t in full.items()})
    dest = {name: empty_like_dtensor(t, *load_layout(name)) for name, t in full.items()}
    ctx.load(dest)
    for name, t in full.items():
        check_dtensor(dest[name], t, name)


# --------------------------------------------------------------------------- ShardedTensor helpers


def chunk_spec(world: int, dim: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])


def uneven_spec(shape: tuple[int, int], world: int, dim: int) -> EnumerableShardingSpec:
    """Uneven cuts along ``dim``: rank r gets r+1 parts of a 1+2+..+world split (last takes the rest)."""
    total, weights = shape[dim], list(range(1, world + 1))
    cuts, start = [], 0
    for r, w in enumerate(weights):
        size = total - start if r == world - 1 else max(1, total * w // sum(weights))
        cuts.append((start, size))
        start += size
    shards = []
    for r, (start, size) in enumerate(cuts):
        offsets, sizes = [0, 0], list(shape)
        offsets[dim], sizes[dim] = start, size
        shards.append(ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{r}/cpu"))
    return EnumerableShardingSpec(shards)


def grid_spec(shape: tuple[int, int], world: int) -> EnumerableShardingSpec:
    """Blocks of a 2 x (world/2) grid, so each rank holds a piece of both dimensions."""
    rows, cols = 2, world // 2
    shards = []
    for r in range(world):
        i, j = divmod(r, cols)
        r0, r1 = shape[0] * i // rows, shape[0] * (i + 1) // rows
        c0, c1 = shape[1] * j // cols, shape[1] * (j + 1) // cols
        shards.append(ShardMetadata(shard_offsets=[r0, c0], shard_sizes=[r1 - r0, c1 - c0],
                                    placement=f"rank:{r}/cpu"))
    return EnumerableShardingSpec(shards)


def _block(full: torch.Tensor, meta: ShardMetadata) -> torch.Tensor:
    view = full
    for dim, (offset, size) in enumerate(zip(meta.shard_offsets, meta.shard_sizes)):
        view = view.narrow(dim, offset, size)
    return view


def make_sharded(full: torch.Tensor, spec, fill: float | None = None):
    st = sharded_tensor.empty(spec, *full.shape, dtype=full.dtype)
    for shard in st.local_shards():
        shard.tensor.copy_(_block(full, shard.metadata) if fill is None else torch.full_like(shard.tensor, fill))
    return st


def check_sharded(st, full: torch.Tensor, what: str) -> None:
    shards = st.local_shards()
    for shard in shards:
        assert_bitwise(shard.tensor, _block(full, shard.metadata).to(shard.tensor.dtype),
                       f"{what} shard at {shard.metadata.shard_offsets}")


# --------------------------------------------------------------------------- DTensor cases


@case(2, 4)
def dtensor_rowwise_to_columnwise(ctx: Ctx) -> None:
    mesh = ctx.mesh(ctx.world)
    reshard_roundtrip(
        ctx, {"w": ((13, 7), torch.float32), "b": ((10,), torch.bfloat16), "e": ((6, 5), torch.float64)},
        lambda n: (mesh, [Replicate()] if n == "e" else [Shard(0)]),
        lambda n: (mesh, [Shard(1)] if n == "w" else [Replicate()] if n == "b" else [Shard(0)]),
    )


@case(4)
def dtensor_2d_placement_change(ctx: Ctx) -> None:
    mesh = ctx.mesh(2, 2)
    saves = {"a": [Shard(0), Shard(1)], "c": [Replicate(), Shard(0)]}
    loads = {"a": [Shard(1), Shard(0)], "c": [Shard(0), Replicate()]}
    reshard_roundtrip(ctx, {"a": ((9, 6), torch.float32), "c": ((11, 3), torch.bfloat16)},
                      lambda n: (mesh, saves[n]), lambda n: (mesh, loads[n]))


@case(4)
def dtensor_1d_mesh_to_2d_mesh(ctx: Ctx) -> None:
    reshard_roundtrip(ctx, {"w": ((10, 8), torch.float32)},
                      lambda n: (ctx.mesh(4), [Shard(0)]),
                      lambda n: (ctx.mesh(2, 2), [Shard(0), Shard(1)]))


@case(4)
def dtensor_2d_mesh_to_1d_mesh(ctx: Ctx) -> None:
    reshard_roundtrip(ctx, {"w": ((10, 8), torch.float32)},
                      lambda n: (ctx.mesh(2, 2), [Shard(1), Shard(0)]),
                      lambda n: (ctx.mesh(4), [Shard(1)]))


@case(2, 4)
def dtensor_to_plain_and_back(ctx: Ctx) -> None:
    mesh = ctx.mesh(ctx.world)
    full = full_tensor("p", (12, 5))
    ctx.save({"p": dtensor(full, mesh, [Shard(0)])}, "sharded")
    plain = {"p": torch.zeros_like(full)}
    ctx.load(plain, "sharded")
    assert_bitwise(plain["p"], full, "DTensor saved, plain tensor loaded")
    ctx.save({"p": full.clone()}, "plain")
    dest = {"p": empty_like_dtensor(full, mesh, [Shard(1)])}
    ctx.load(dest, "plain")
    check_dtensor(dest["p"], full, "plain tensor saved, DTensor loaded")


@case(2, 4)
def dtensor_dtype_cast_on_load(ctx: Ctx) -> None:
    mesh = ctx.mesh(ctx.world)
    full = full_tensor("cast", (9, 6))
    ctx.save({"w": dtensor(full, mesh, [Shard(0)]), "h": dtensor(full.to(torch.bfloat16), mesh, [Shard(1)])})
    dest = {"w": empty_like_dtensor(full, mesh, [Shard(1)], torch.bfloat16),
            "h": empty_like_dtensor(full, mesh, [Shard(0)], torch.float32)}
    ctx.load(dest)
    check_dtensor(dest["w"], full, "float32 saved, bfloat16 loaded")
    check_dtensor(dest["h"], full.to(torch.bfloat16), "bfloat16 saved, float32 loaded")


# --------------------------------------------------------------------------- ShardedTensor cases


@case(2, 4)
def sharded_rowwise_to_columnwise(ctx: Ctx) -> None:
    full = full_tensor("st", (14, 9))
    ctx.save({"st": make_sharded(full, chunk_spec(ctx.world, 0))})
    dest = {"st": make_sharded(full, chunk_spec(ctx.world, 1), fill=-1)}
    ctx.load(dest)
    check_sharded(dest["st"], full, "row-wise saved, column-wise loaded")


@case(2, 4)
def sharded_different_shard_plans(ctx: Ctx) -> None:
    full = full_tensor("plans", (12, 10), torch.bfloat16)
    save_spec = grid_spec(full.shape, ctx.world) if ctx.world >= 4 else uneven_spec(full.shape, ctx.world, 1)
    ctx.save({"t": make_sharded(full, save_spec)})
    dest = {"t": make_sharded(full, uneven_spec(full.shape, ctx.world, 0), fill=0)}
    ctx.load(dest)
    check_sharded(dest["t"], full, "one shard plan saved, another loaded")


@case(2, 4)
def sharded_to_plain_and_back(ctx: Ctx) -> None:
    full = full_tensor("stp", (8, 6))
    ctx.save({"t": make_sharded(full, chunk_spec(ctx.world, 0))}, "sharded")
    plain = {"t": torch.zeros_like(full)}
    ctx.load(plain, "sharded")
    assert_bitwise(plain["t"], full, "ShardedTensor saved, plain tensor loaded")
    ctx.save({"t": full.clone()}, "plain")
    dest = {"t": make_sharded(full, chunk_spec(ctx.world, 1), fill=0)}
    ctx.load(dest, "plain")
    check_sharded(dest["t"], full, "plain tensor saved, ShardedTensor loaded")


@case(2, 4)
def sharded_to_dtensor(ctx: Ctx) -> None:
    full = full_tensor("s2d", (10, 6))
    ctx.save({"t": make_sharded(full, chunk_spec(ctx.world, 1))})
    dest = {"t": empty_like_dtensor(full, ctx.mesh(ctx.world), [Shard(0)])}
    ctx.load(dest)
    check_dtensor(dest["t"], full, "ShardedTensor saved, DTensor loaded")


# --------------------------------------------------------------------------- who writes what


@case(2, 4)
def coordinator_holds_nothing(ctx: Ctx) -> None:
    """Rank 0 saves an empty state dict; the other ranks save their own tensor and object."""
    def state(fill: bool) -> dict:
        if ctx.rank == 0:
            return {}
        t = full_tensor(f"r{ctx.rank}", (5, 3))
        return {f"t{ctx.rank}": t if fill else torch.zeros_like(t),
                f"o{ctx.rank}": {"rank": ctx.rank if fill else None}}
    ctx.save(state(True))
    dest = state(False)
    ctx.load(dest)
    if ctx.rank:
        assert_bitwise(dest[f"t{ctx.rank}"], full_tensor(f"r{ctx.rank}", (5, 3)), "tensor of rank " + str(ctx.rank))
        assert dest[f"o{ctx.rank}"] == {"rank": ctx.rank}, dest


@case(2, 4)
def empty_state_dict(ctx: Ctx) -> None:
    ctx.save({})
    ctx.load({})


class _CollectiveOnLoad(Stateful):
    """An empty Stateful whose load runs a collective: ranks must load keys in the same order."""

    def __init__(self, op: str) -> None:
        self.op, self.loaded = op, None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        mine = torch.arange(2, dtype=torch.int64) + 2 * dist.get_rank()
        if self.op == "gather":
            out = [torch.empty(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
            dist.all_gather(out, mine)
            self.loaded = torch.cat(out).tolist()
        else:
            dist.all_reduce(mine)
            self.loaded = mine.tolist()


@case(2, 4)
def stateful_empty_differently_ordered_keys(ctx: Ctx) -> None:
    order = ["A", "B"] if ctx.rank == 0 else ["B", "A"]

    def state() -> dict:
        return {key: _CollectiveOnLoad("gather" if key == "A" else "reduce") for key in order}

    ctx.save(state())
    dest = state()
    ctx.load(dest)
    world = ctx.world
    assert dest["A"].loaded == list(range(2 * world)), dest["A"].loaded
    assert dest["B"].loaded == [sum(2 * r for r in range(world)), sum(2 * r + 1 for r in range(world))]


class _Counter(Stateful):
    def __init__(self, value: int) -> None:
        self.value, self.loads = value, 0

    def state_dict(self) -> dict:
        return {"value": torch.tensor(self.value), "note": f"counter {self.value}"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.value = int(state_dict["value"])
        assert state_dict["note"] == f"counter {self.value}", state_dict
        self.loads += 1


@case(2)
def stateful_and_plain_loads(ctx: Ctx) -> None:
    ctx.save({"counter": _Counter(41), "plain": {"t": full_tensor("pl", (4,)), "meta": [1, 2, 3]}})
    counter, plain = _Counter(0), {"t": torch.zeros(4), "meta": None}
    dest = {"counter": counter, "plain": plain}
    ctx.load(dest)
    assert dest["counter"] is counter and counter.value == 41 and counter.loads == 1
    assert_bitwise(dest["plain"]["t"], full_tensor("pl", (4,)), "plain tensor")
    assert dest["plain"]["meta"] == [1, 2, 3], dest["plain"]


@case(2, 4)
def bytes_items(ctx: Ctx) -> None:
    def state(fill: bool) -> dict:
        return {"shared": {"lr": 0.5 if fill else None, "names": ["a", "b"] if fill else None},
                f"mine{ctx.rank}": (ctx.rank, "x" * ctx.rank) if fill else None,
                "empty_obj": [] if fill else None, "nothing": None if fill else 1}
    ctx.save(state(True))
    dest = state(False)
    ctx.load(dest)
    assert dest["shared"] == {"lr": 0.5, "names": ["a", "b"]}, dest["shared"]
    assert dest[f"mine{ctx.rank}"] == (ctx.rank, "x" * ctx.rank), dest
    assert dest["empty_obj"] == [] and dest["nothing"] is None, dest


@case(2)
def pickled_class_item(ctx: Ctx) -> None:
    """An item whose pickle imports a class (fractions.Fraction). Stock unpickles it; ours
    refuses by default, naming the item and the opt-in (a checkpoint's pickle can run any code),
    and with allow_pickle=True loads it as stock does: the documented difference. A BytesIO is
    only its bytes and loads by default in both."""
    blob = bytes(range(256)) * 3
    ctx.save({"blob": io.BytesIO(blob), "ratio": Fraction(1, 3)})
    dest = {"blob": io.BytesIO(), "ratio": None}
    if ctx.backend.name == "nvme":
        try:
            ctx.load(dest)
        except CheckpointException as exc:
            assert "'ratio'" in str(exc) and "allow_pickle=True" in str(exc), exc
        else:
            raise AssertionError("dcp_nvme unpickled a class without allow_pickle=True")
    only_blob = {"blob": io.BytesIO()}
    ctx.load(only_blob)
    assert only_blob["blob"].getvalue() == blob, f"BytesIO item came back as {only_blob['blob']!r}"
    dcp.load(dest, storage_reader=ctx.backend.reader(ctx.path(), trusted=True))
    assert dest["blob"].getvalue() == blob and dest["ratio"] == Fraction(1, 3), dest


@case(2)
def partial_load_of_chosen_keys(ctx: Ctx) -> None:
    mesh = ctx.mesh(ctx.world)
    model, optim = full_tensor("m", (8, 4)), full_tensor("o", (8, 4))
    ctx.save({"model": {"w": dtensor(model, mesh, [Shard(0)])},
              "optim": {"m": dtensor(optim, mesh, [Shard(0)]), "step": 3}})
    dest = {"model": {"w": empty_like_dtensor(model, mesh, [Shard(1)])}}
    ctx.load(dest)
    check_dtensor(dest["model"]["w"], model, "model only")
    assert set(dest) == {"model"}, sorted(dest)


def _fsdp_model(ctx: Ctx):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=ctx.mesh(ctx.world))
    fully_shard(model, mesh=ctx.mesh(ctx.world))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model, optim, steps: int, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=generator)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
    return float(loss)


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


@case(2)
def fsdp2_train_save_resume(ctx: Ctx) -> None:
    """DCP's e2e check: an FSDP2 model and its Adam state saved mid-training and loaded into a
    fresh model continue exactly as the original does."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _fsdp_model(ctx)
    _train(model, optim, 2, seed=ctx.rank)
    model_sd, optim_sd = get_state_dict(model, optim)
    ctx.save({"model": model_sd, "optim": optim_sd, "train": {"step": 2}})
    fresh, fresh_optim = _fsdp_model(ctx)
    _train(fresh, fresh_optim, 1, seed=100 + ctx.rank)  # different values and optimizer state
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_optim)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd, "train": {"step": 0}}
    ctx.load(state)
    set_state_dict(fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["train"]["step"] == 2
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert_bitwise(_local(b), _local(a), f"parameter {name}")
    for group, fresh_group in zip(optim.state.values(), fresh_optim.state.values()):
        for key in group:
            assert_bitwise(_local(fresh_group[key]), _local(group[key]), f"optimizer {key}")
    assert _train(model, optim, 1, seed=7 + ctx.rank) == _train(fresh, fresh_optim, 1, seed=7 + ctx.rank)


class _FailsOnRankOne(DefaultSavePlanner):
    """A save whose data cannot be produced on rank 1 (as a failed device copy would)."""

    def resolve_data(self, write_item):
        if dist.get_rank() == 1:
            raise OSError(5, "injected: rank 1 cannot produce its data")
        return super().resolve_data(write_item)


@case(2)
def failure_on_one_rank_commits_nothing(ctx: Ctx) -> None:
    full = full_tensor("fail", (8, 4))
    state = {"t": dtensor(full, ctx.mesh(ctx.world), [Shard(0)])}  # every rank writes a shard
    try:
        dcp.save(state, storage_writer=ctx.backend.writer(ctx.path()), planner=_FailsOnRankOne())
    except CheckpointException as exc:
        assert "injected" in str(exc), exc
    else:
        raise AssertionError("the save succeeded although rank 1 failed")
    try:
        ctx.backend.reader(ctx.path()).read_metadata()
    except FileNotFoundError:
        return  # nothing was committed: there is no checkpoint to load
    raise AssertionError("a checkpoint was committed by a save that failed")


# --------------------------------------------------------------------------- overwrite, metadata


@case(2)
def overwrite_explicit(ctx: Ctx) -> None:
    first, second = full_tensor("v1", (6,)), full_tensor("v2", (6,))
    ctx.save({"v": first}, overwrite=True)
    ctx.save({"v": second}, overwrite=True)
    dest = {"v": torch.zeros(6)}
    ctx.load(dest)
    assert_bitwise(dest["v"], second, "after overwrite=True the new checkpoint loads")
    try:
        ctx.save({"v": first}, overwrite=False)
    except CheckpointException:
        pass
    else:
        raise AssertionError("a save with overwrite=False over a checkpoint did not fail")
    ctx.load(dest)
    assert_bitwise(dest["v"], second, "a refused save left the checkpoint as it was")


@case(2)
def overwrite_default(ctx: Ctx) -> None:
    """The documented difference: stock overwrites by default (with a warning), ours refuses."""
    first, second = full_tensor("d1", (6,)), full_tensor("d2", (6,))
    ctx.save({"v": first})
    try:
        ctx.save({"v": second})
        refused = None
    except CheckpointException as exc:
        refused = str(exc)
    dest = {"v": torch.zeros(6)}
    ctx.load(dest)
    if ctx.backend.name == "stock":
        assert refused is None, refused
        assert_bitwise(dest["v"], second, "stock overwrites by default")
    else:
        assert refused is not None, "dcp_nvme overwrote a checkpoint without overwrite=True"
        assert "overwrite=True" in refused, refused
        assert_bitwise(dest["v"], first, "the refused save kept the first checkpoint")


@case(2)
def storage_meta_round_trip(ctx: Ctx) -> None:
    writer = ctx.backend.writer(ctx.path())
    dcp.save({"t": torch.ones(3)}, storage_writer=writer)
    coordinator_save_id = [writer.save_id]
    dist.broadcast_object_list(coordinator_save_id, src=0)
    reader = ctx.backend.reader(ctx.path())
    dcp.load({"t": torch.zeros(3)}, storage_reader=reader)
    meta = reader.read_metadata().storage_meta
    assert meta is not None
    assert meta.save_id == coordinator_save_id[0], (meta.save_id, coordinator_save_id)
    assert meta.load_id == reader.load_id, (meta.load_id, reader.load_id)
    assert os.fspath(meta.checkpoint_id) == ctx.path(), meta.checkpoint_id


@case(2)
def save_without_collectives(ctx: Ctx) -> None:
    """Stock: every rank writes and commits its own metadata, and loads it back alone. Ours refuses
    (one manifest per checkpoint is committed by the coordinator): the documented difference."""
    mine = full_tensor(f"uc{ctx.rank}", (4, 3))
    writer = ctx.backend.writer(ctx.path())
    if ctx.backend.name == "nvme":
        try:
            dcp.save({f"t{ctx.rank}": mine}, storage_writer=writer, use_collectives=False)
        except ValueError as exc:
            assert "use_collectives=True" in str(exc), exc
            assert not os.path.exists(os.path.join(ctx.path(), "manifest.json"))
            return
        raise AssertionError("dcp_nvme accepted use_collectives=False on 2 ranks")
    dcp.save({f"t{ctx.rank}": mine}, storage_writer=writer, use_collectives=False)
    dest = {f"t{ctx.rank}": torch.zeros(4, 3)}
    ctx.load(dest)
    assert_bitwise(dest[f"t{ctx.rank}"], mine, "rank-local checkpoint")


# --------------------------------------------------------------------------- async


def _async_roundtrip(ctx: Ctx, kind: AsyncCheckpointerType) -> None:
    mesh = ctx.mesh(ctx.world)
    full = full_tensor(f"async{kind.value}", (10, 4))
    state = {"w": dtensor(full, mesh, [Shard(0)]), "step": 7}
    response = dcp.async_save(state, storage_writer=ctx.backend.writer(ctx.path()), async_checkpointer_type=kind)
    future = getattr(response, "upload_completion", response)
    future.result(timeout=120)
    dest = {"w": empty_like_dtensor(full, mesh, [Shard(1)]), "step": 0}
    ctx.load(dest)
    check_dtensor(dest["w"], full, f"async {kind.value} save")
    assert dest["step"] == 7


@case(2)
def async_save_thread(ctx: Ctx) -> None:
    _async_roundtrip(ctx, AsyncCheckpointerType.THREAD)


@case(2)
def async_save_process(ctx: Ctx) -> None:
    _async_roundtrip(ctx, AsyncCheckpointerType.PROCESS)


# --------------------------------------------------------------------------- across world sizes


def cross_world_state(world: int, mesh: DeviceMesh, *, fill: bool) -> dict:
    full = {"d": full_tensor("xd", (12, 6)), "s": full_tensor("xs", (10, 4), torch.bfloat16)}
    if not fill:
        full = {k: torch.full_like(v, -3) for k, v in full.items()}
    return {"d": dtensor(full["d"], mesh, [Shard(0)]), "s": make_sharded(full["s"], chunk_spec(world, 0)),
            "step": 5 if fill else 0}


@case(4)
def save_for_other_world_sizes(ctx: Ctx) -> None:
    dcp.save(cross_world_state(ctx.world, ctx.mesh(ctx.world), fill=True),
             storage_writer=ctx.backend.writer(ctx.cross_world_path()))


@case(2)
def load_saved_by_4_ranks(ctx: Ctx) -> None:
    mesh = ctx.mesh(ctx.world)
    dest = {"d": empty_like_dtensor(full_tensor("xd", (12, 6)), mesh, [Shard(1)]),
            "s": make_sharded(full_tensor("xs", (10, 4), torch.bfloat16), chunk_spec(ctx.world, 1), fill=0),
            "step": 0}
    dcp.load(dest, storage_reader=ctx.backend.reader(ctx.cross_world_path()))
    check_dtensor(dest["d"], full_tensor("xd", (12, 6)), "DTensor saved by 4 ranks")
    check_sharded(dest["s"], full_tensor("xs", (10, 4), torch.bfloat16), "ShardedTensor saved by 4 ranks")
    assert dest["step"] == 5


# --------------------------------------------------------------------------- the runner


def cases_for(world: int) -> list[str]:
    return [name for name, (worlds, _) in CASES.items() if world in worlds]


def _outcome(exc: BaseException) -> str:
    lines = traceback.format_exception(exc)
    return "".join(lines[-12:])[-3000:]


def worker(rank: int, world: int, port: int, root: str, shared: str, out_dir: str) -> None:
    """Every case of this world size for every backend; outcomes to ``out_dir/rank<r>.json``."""
    import warnings

    warnings.filterwarnings("ignore")  # ShardedTensor's deprecation and DCP's overwrite warnings
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # a case that leaves a collective unmatched fails after this, instead of hanging the suite
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results: dict[str, str] = {}
    seconds: dict[str, float] = {}
    out = os.path.join(out_dir, f"rank{rank}.json")
    try:
        for backend in BACKENDS.values():
            ctx = Ctx(backend, rank, world, root, shared)
            for name in cases_for(world):
                ctx.case = name
                started = time.perf_counter()
                try:
                    CASES[name][1](ctx)
                    results[f"{backend.name}:{name}"] = "ok"
                except (Exception, CheckpointException) as exc:  # recorded; the test reports it
                    results[f"{backend.name}:{name}"] = _outcome(exc)
                dist.barrier()
                seconds[f"{backend.name}:{name}"] = round(time.perf_counter() - started, 3)
                with open(out, "w") as handle:  # after each case: a hang still leaves results
                    json.dump(results, handle)
                with open(os.path.join(out_dir, f"rank{rank}.seconds.json"), "w") as handle:
                    json.dump(seconds, handle)
    finally:
        dist.destroy_process_group()
