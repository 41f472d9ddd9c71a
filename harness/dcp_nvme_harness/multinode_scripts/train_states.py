"""Trainers' state dicts, saved and restored on simulated nodes: items several ranks hold.

    python train_states.py ACTION LAYOUT[,LAYOUT...] RUN_DIR    (under torchrun: N nodes x R ranks)

Several layouts run one after another in one launch (a launch costs more than a layout: every
process imports torch); each layout's checkpoint is RUN_DIR/step_1, where a ``{layout}`` in
RUN_DIR is the layout's name.

LAYOUT, each built the way a trainer builds it (seeded; a small MLP Linear(16,8)-ReLU-Linear(8,4),
AdamW stepped twice on per-rank data, ``get_state_dict(model, optim)``):
  ddp     DistributedDataParallel: every parameter and optimizer state replicated on all ranks
  fsdp2   ``fully_shard`` over the whole world: parameters and exp_avg(_sq) Shard(0), each
          parameter's AdamW ``step`` a plain tensor that every rank holds
  hsdp    ``fully_shard`` on a (nodes, ranks per node) mesh ("replicate", "shard"): DTensors
          [Replicate(), Shard(0)], the same shards on every node
  tpdp    torchtitan's 2-D layout: ColwiseParallel/RowwiseParallel on the "tp" dim (ranks of a
          node), then ``fully_shard`` on the "dp" dim (nodes): FSDP over nodes, TP within a node
Every layout adds ``{"step": 1000, "note": io.BytesIO(NOTE)}`` (a non-tensor item and a BytesIO),
except the control:
  sharded fsdp2's model, trained the same, saving only ``{"model": get_model_state_dict}``: every
          item Shard(0) over the world, nothing that two ranks hold

ACTION:
  save    train, save to RUN_DIR/step_1 with a plain ``NVMeWriter(path)``, and keep the state this
          rank saved (flattened, to plain tensors) in its node's TMPDIR for the restart to compare
  load    ($READER_PEERS=1: ``peers=True``, the ranks exchange what a node lacks; with
          $CORRUPT_SENDS_ON_NODE=<node rank> that node flips a byte of every range it sends)
          build the same model and optimizer fresh (another seed, untrained), ``dcp.load`` with a
          plain ``NVMeReader(path)`` into its ``get_state_dict``, ``set_state_dict``, and compare
          ``get_state_dict`` then, and the extra items, bitwise with what this rank saved

Each rank prints one ``RESULT {json}`` line: rank, host, layout, placements, and either
``error`` (per failing rank for a CheckpointException) or the comparison; after a load the
reader's ``last_stats`` (bytes read, by source where the reader has sources).
"""

import io
import json
import logging
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dcp_nvme import NVMeReader, NVMeWriter

action, LAYOUTS, RUN_DIR = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
layout, run_dir = LAYOUTS[0], RUN_DIR  # this layout's, set for each in turn below
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
per_node = int(os.environ["LOCAL_WORLD_SIZE"])
nodes = world // per_node
NOTE = b"dcp_nvme node-local states: a BytesIO every rank holds\x00\xff"
STEP = 1000
TRAINED_SEED, FRESH_SEED = 0, 1234
dist.init_process_group("gloo")


def report(record: dict) -> None:
    os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())  # one write: ranks share stdout


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def build(seed: int):
    """(model, optimizer, data seed) of ``layout``, parameters initialised from ``seed``."""
    torch.manual_seed(seed)
    model = mlp()
    data_seed = 100 + rank  # data parallel over every rank unless the layout says otherwise
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout in ("fsdp2", "sharded"):
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tpdp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2]):  # torchtitan: TP first, then FSDP on the dp dim
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        data_seed = 100 + rank // per_node  # the ranks of a TP group see the same batch
    else:
        raise ValueError(f"unknown layout {layout!r}")
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, optim, data_seed


def train(model: nn.Module, optim: torch.optim.Optimizer, data_seed: int, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=gen)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    if layout == "sharded":  # the control: no replicated item at all
        return {"model": msd}
    return {"model": msd, "optim": osd, "step": STEP, "note": io.BytesIO(NOTE)}


def flatten(obj, prefix: str = "", out: dict | None = None) -> dict:
    """Every leaf as a plain value: a DTensor as (its local shard, placements, global shape)."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        for key, value in obj.items():
            flatten(value, f"{prefix}{key}.", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            flatten(value, f"{prefix}{i}.", out)
    elif isinstance(obj, DTensor):
        out[prefix[:-1]] = ("dtensor", obj.to_local().detach().clone(), str(tuple(obj.placements)), tuple(obj.shape))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = ("tensor", obj.detach().clone())
    elif isinstance(obj, io.BytesIO):
        out[prefix[:-1]] = ("bytesio", obj.getvalue())
    else:
        out[prefix[:-1]] = ("value", obj)
    return out


def same(a, b) -> bool:
    """Bitwise equal: same kind, dtype, shape, placements and bytes (or plain values)."""
    if a[0] != b[0]:
        return False
    if a[0] in ("tensor", "dtensor"):
        x, y = a[1], b[1]
        if x.dtype != y.dtype or x.shape != y.shape or a[2:] != b[2:]:
            return False
        return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))
    return a[1] == b[1] and type(a[1]) is type(b[1])


def placements(state: dict) -> dict[str, int]:
    """How many tensors of each placement (``tensor`` for a plain one) the state holds."""
    out: dict[str, int] = {}
    for entry in flatten(state).values():
        kind = entry[2] if entry[0] == "dtensor" else entry[0]
        out[kind] = out.get(kind, 0) + 1
    return out


def expected_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"train_states-{layout}-rank{rank:05d}.pt")


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):  # DCP's collective error: the failing ranks' exceptions
        by_text: dict[str, list[int]] = {}
        for r, (e, _) in sorted(exc.failures.items()):
            by_text.setdefault(f"{type(e).__name__}: {str(e).strip()[:800]}", []).append(r)
        return "CheckpointException: " + " | ".join(f"ranks {ranks}: {text}" for text, ranks in by_text.items())
    return f"{type(exc).__name__}: {str(exc).strip()[:800]}"


def corrupt_what_this_node_sends() -> None:
    """A fault of this test: every range this node sends has one byte flipped after the holder's
    own check (a bad link, or a disk that returned other bytes the second time)."""
    from dcp_nvme.peers import streams

    checked = streams.read_checked
    if getattr(checked, "flips", False):  # once: a second flip would undo the first
        return

    def flipped(*args, **kwargs):
        data = checked(*args, **kwargs)
        data[len(data) // 2] ^= 0xFF
        return data

    flipped.flips = True  # type: ignore[attr-defined]
    streams.read_checked = flipped


def do_save(record: dict) -> None:
    model, optim, data_seed = build(TRAINED_SEED)
    train(model, optim, data_seed)
    state = full_state(model, optim)
    record["placements"] = placements(state)
    if layout == "hsdp":
        got = {str(tuple(t.placements)) for t in state["model"].values() if isinstance(t, DTensor)}
        want = str((Replicate(), Shard(0)))
        if got != {want}:
            raise AssertionError(f"hsdp parameters are {sorted(got)}, expected {want}")
    torch.save(flatten(state), expected_path())
    replicas = int(os.environ.get("WRITER_REPLICAS", "0"))
    writer = NVMeWriter(os.path.join(run_dir, "step_1"), replicas=replicas)
    dcp.save(state, storage_writer=writer)
    record["items"] = len(flatten(state))
    future = getattr(writer, "replication_future", None)
    if replicas and future is not None:  # a node's writer: what its replication did
        done = future.result(timeout=120)
        record["replication"] = {"already_held": done.already_held, "bytes": done.bytes,
                                 "pulled": done.pulled, "replicated_on": done.replicated_on}


def do_load(record: dict) -> None:
    expected = torch.load(expected_path(), weights_only=True)
    model, optim, _ = build(FRESH_SEED)
    state = full_state(model, optim)  # initialises AdamW's state (a zero step), as a restart does
    if layout != "sharded":
        state["step"], state["note"] = 0, io.BytesIO(b"")
    before = flatten(state)
    record["placements"] = placements(state)
    reader = NVMeReader(os.path.join(run_dir, "step_1"), peers=os.environ.get("READER_PEERS") == "1")
    if os.environ.get("CORRUPT_SENDS_ON_NODE") == os.environ.get("GROUP_RANK"):
        corrupt_what_this_node_sends()
    caught = logging.getLogger("dcp_nvme")
    warnings_seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: warnings_seen.append(rec.getMessage())  # type: ignore[method-assign]
    caught.addHandler(handler)
    try:
        dcp.load(state, storage_reader=reader)
    finally:
        caught.removeHandler(handler)
        record["warnings"] = warnings_seen
        stats = reader.last_stats
        if stats is not None:
            record["read"] = {k: stats[k] for k in ("bytes", "bytes_needed", "requests", "remote_bytes") if k in stats}
            record["read"]["sources"] = stats.get("sources")  # only with peers/mirror: None here
    if "optim" in state:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    got = flatten(full_state(model, optim))
    if layout != "sharded":  # what the load put in the state dict (the model and optimizer hold the rest)
        got["step"], got["note"] = ("value", state["step"]), ("bytesio", state["note"].getvalue())
    mismatched = sorted(k for k in expected.keys() | got.keys()
                        if k not in got or k not in expected or not same(got[k], expected[k]))
    record["compared"] = len(expected)
    record["changed_by_load"] = sum(1 for k, v in expected.items() if k in before and not same(before[k], v))
    if mismatched:
        raise AssertionError(f"{len(mismatched)} of {len(expected)} items differ from what was saved: "
                             f"{mismatched[:8]}")
    record["bitwise"] = True


failed = False
for layout in LAYOUTS:
    run_dir = RUN_DIR.replace("{layout}", layout)
    record = {"rank": rank, "host": os.uname().nodename, "action": action, "layout": layout}
    try:
        {"save": do_save, "load": do_load}[action](record)
    except BaseException as exc:  # noqa: BLE001  DCP raises CheckpointException (a BaseException)
        traceback.print_exc()
        record["error"] = describe_error(exc)[:2500]
        failed = True
    report(record)
dist.destroy_process_group()
sys.exit(1 if failed else 0)  # a failed rank ends its node at once (see node_local.py)
