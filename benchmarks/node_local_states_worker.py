"""Worker of benchmarks/node_local_states.py: one layout, both variants, on simulated nodes.

    torchrun ... node_local_states_worker.py LAYOUT RUN_DIR [--hidden H] [--layers L] [--reps N] [--expected]
    torchrun ... node_local_states_worker.py LAYOUT RUN_DIR --action restore --restore-dir DIR [--hidden H] [--layers L]

LAYOUT as in harness/dcp_nvme_harness/multinode_scripts/train_states.py (ddp, fsdp2, hsdp; tpdp too), built the same
way but on a bigger MLP: L x Linear(H, H) with ReLUs, AdamW stepped once, so the state
(parameters + exp_avg + exp_avg_sq) is about 12 * L * H * H bytes. Saves
``{"model", "optim", "step"}`` with a plain ``NVMeWriter`` under RUN_DIR, for each variant:

  per-node   ``dcp_nvme.save.copies.ENABLED = True``: every node's disk gets every item its ranks hold
  job-wide   ``ENABLED = False``: DCP's dedup, each item once in the whole job

After one unmeasured warm-up save (sync and async), REPS rounds, each running both variants (their
order alternating between rounds): a sync ``dcp.save`` then a ``dcp.async_save`` with one
``NVMeStager`` per process. Every save goes to its own step directory; the first sync save of each
variant is kept (its bytes per node, its copies table, the restart), the others are removed once
durable. Then the restart: a fresh model and optimizer (another seed) ``dcp.load`` with a plain
``NVMeReader`` from each variant's kept directory, at the same world size, in the same processes
(the page cache holds the files: this times the reader, not the disk).

With ``--expected`` the bench also keeps what each rank saved (its tensor leaves, DTensors as
local shards) in its node's TMPDIR, for a later ``--action restore`` launch to compare with.

``--action restore`` (a fresh launch, on the same nodes, after the host wiped a node's copy of
DIR): builds the fresh model and optimizer as the restart does and ``dcp.load`` s from DIR with
``NVMeReader(DIR, peers=True)`` (what a node's disk lacks comes from the other nodes over a gloo
group, see dcp_nvme/peers/exchange.py), then compares bitwise with the state the bench kept. For
DDP and HSDP a rank's state depends only on its local rank (and the same ranks land on the same
nodes), so the expected state saved by rank r in the bench is rank r's in the restore. Its
seconds include what a restart pays once: the exchange's gloo group, the first load's imports.

Times are the slowest rank's, each save started after a barrier. Every rank prints one
``RESULT {json}`` line: its rank, host, restart read figures (or error); rank 0's also carries
``summary`` (every figure of the layout). After ``--action restore``, each rank's line carries
``restore`` (its seconds, bytes, remote bytes, sources, bitwise) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dcp_nvme.save.copies as copies
from dcp_nvme import NVMeReader, NVMeStager, NVMeWriter

VARIANTS = {"per-node": True, "job-wide": False}

parser = argparse.ArgumentParser()
parser.add_argument("layout")
parser.add_argument("run_dir")
parser.add_argument("--hidden", type=int, default=1792)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--action", choices=("bench", "restore"), default="bench")
parser.add_argument("--expected", action="store_true", help="bench: keep each rank's saved state in TMPDIR")
parser.add_argument("--restore-dir", help="restore: the checkpoint directory to load with peers=True")
args = parser.parse_args()
layout = args.layout
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local_rank, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
nodes = world // per_node
dist.init_process_group("gloo")
ckpt_group = dist.new_group(backend="gloo")  # async_save's collectives run on its upload thread


def report(record: dict) -> None:
    os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())  # one write: ranks share stdout


def mlp() -> nn.Sequential:
    mods: list[nn.Module] = []
    for i in range(args.layers):
        mods += [nn.Linear(args.hidden, args.hidden)] + ([nn.ReLU()] if i < args.layers - 1 else [])
    return nn.Sequential(*mods)


def build(seed: int):
    """(model, optimizer, data seed) of ``layout``, as harness/dcp_nvme_harness/multinode_scripts/train_states.py builds it."""
    torch.manual_seed(seed)
    model = mlp()
    linears = [m for m in model if isinstance(m, nn.Linear)]
    data_seed = 100 + rank
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout in ("fsdp2", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        if layout == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
        for layer in linears:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tpdp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("dp", "tp"))
        plan = {str(i): (ColwiseParallel() if (i // 2) % 2 == 0 else RowwiseParallel())
                for i, m in enumerate(model) if isinstance(m, nn.Linear)}
        parallelize_module(model, mesh["tp"], plan)
        for layer in linears:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        data_seed = 100 + rank // per_node
    else:
        raise ValueError(f"unknown layout {layout!r}")
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, optim, data_seed


def train(model, optim, data_seed: int, steps: int = 1) -> None:
    gen = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        model(torch.randn(4, args.hidden, generator=gen)).square().mean().backward()
        optim.step()
        optim.zero_grad()


def make_state(model, optim) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "step": 1000}


def leaves(obj, prefix: str = "", out: dict | None = None) -> dict:
    """Every tensor leaf (a DTensor as its local shard)."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        for key, value in obj.items():
            leaves(value, f"{prefix}{key}.", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            leaves(value, f"{prefix}{i}.", out)
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj.to_local() if isinstance(obj, DTensor) else obj
    return out


def logical_bytes(state: dict) -> int:
    """The state's size as one copy of every item (a DTensor by its global shape)."""
    total = 0
    for obj in _walk(state):
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()  # a DTensor's numel is its global one
    return total


def _walk(obj):
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk(value)
    else:
        yield obj


def slowest(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def sync_save(state: dict, path: str) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=NVMeWriter(path))
    return slowest(time.perf_counter() - t0)[0]


def async_save(state: dict, path: str, stager: NVMeStager) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    response = dcp.async_save(state, storage_writer=NVMeWriter(path), async_stager=stager,
                              process_group=ckpt_group)
    blocking = time.perf_counter() - t0
    response.upload_completion.result()
    durable = time.perf_counter() - t0
    blocking, durable = slowest(blocking, durable)
    return blocking, durable


def node_disk(path: str) -> dict | None:
    """On each node (its local rank 0): bytes of the rank files on its own disk, and the copies
    table's row count in its manifest."""
    dist.barrier()
    mine = None
    if local_rank == 0:
        names = sorted(os.listdir(path))
        ranks = [n for n in names if n.startswith("rank_") and n.endswith(".safetensors")]
        doc = json.loads(open(os.path.join(path, "manifest.json")).read())
        mine = {"host": os.uname().nodename, "rank_files": len(ranks),
                "rank_bytes": sum(os.path.getsize(os.path.join(path, n)) for n in ranks),
                "all_bytes": sum(os.path.getsize(os.path.join(path, n)) for n in names),
                "copies_rows": (doc.get("copies") or {}).get("rows", 0),
                "index_rows": (doc.get("index") or {}).get("rows")}
    got: list = [None] * world
    dist.all_gather_object(got, mine)
    return [g for g in got if g is not None]


def remove(path: str) -> None:
    dist.barrier()
    if local_rank == 0:  # each node its own disk
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):  # DCP's collective error: the failing ranks' causes
        by_text: dict[str, list[int]] = {}
        for r, (e, _) in sorted(exc.failures.items()):
            text = (str(e).strip().splitlines() or [""])[0]
            by_text.setdefault(f"{type(e).__name__}: {text}"[:400], []).append(r)
        return " | ".join(f"ranks {ranks}: {text}" for text, ranks in by_text.items())
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:400]


def expected_path() -> str:
    """Where this rank keeps the state it saved: its node's TMPDIR (each node its own)."""
    return os.path.join(tempfile.gettempdir(), f"node_local_states-{layout}-rank{rank:05d}.pt")


def restart(path: str, expected: dict, peers: bool = False) -> dict:
    model, optim, _ = build(1234)
    state = make_state(model, optim)
    state["step"] = 0
    reader = NVMeReader(path, peers=peers)
    out: dict = {}
    dist.barrier()
    t0 = time.perf_counter()
    try:
        dcp.load(state, storage_reader=reader)
        out["seconds_rank"] = time.perf_counter() - t0
        got = leaves(state)
        out["bitwise"] = (got.keys() == expected.keys() and state["step"] == 1000
                          and all(torch.equal(got[k], expected[k]) for k in expected))
    except BaseException as exc:  # noqa: BLE001  CheckpointException is a BaseException
        out["error"] = first_line(exc).replace(path, "DIR")
    stats = reader.last_stats or {}
    out["bytes"], out["remote_bytes"] = stats.get("bytes"), stats.get("remote_bytes")
    if peers:
        out["sources"], out["phases"] = stats.get("sources"), stats.get("phases")
    out["seconds"] = slowest(out.get("seconds_rank", float("nan")))[0]
    return out


def main(record: dict) -> None:
    model, optim, data_seed = build(0)
    train(model, optim, data_seed)
    state = make_state(model, optim)
    expected = {k: v.detach().clone() for k, v in leaves(state).items()}
    if args.expected:  # for a later restore launch (fresh processes) to compare with
        torch.save(expected, expected_path())
    local = sum(v.numel() * v.element_size() for v in expected.values())
    summary = {"layout": layout, "hidden": args.hidden, "layers": args.layers, "reps": args.reps,
               "world": world, "nodes": nodes, "logical_bytes": logical_bytes(state),
               "rank_state_bytes": None, "variants": {}}
    summary["rank_state_bytes"] = [None] * world
    dist.all_gather_object(summary["rank_state_bytes"], local)
    stager = NVMeStager()
    try:
        copies.ENABLED = True  # warm-up: imports, the stager's arena, first-time planning
        sync_save(state, f"{args.run_dir}/warm_sync")
        async_save(state, f"{args.run_dir}/warm_async", stager)
        remove(f"{args.run_dir}/warm_sync")
        remove(f"{args.run_dir}/warm_async")
        runs = {v: {"sync": [], "async_blocking": [], "async_durable": []} for v in VARIANTS}
        kept: dict[str, str] = {}
        disks: dict[str, list] = {}
        order = list(VARIANTS)
        for rep in range(args.reps):
            for variant in (order if rep % 2 == 0 else order[::-1]):
                copies.ENABLED = VARIANTS[variant]  # every rank; the coordinator is the one that reads it
                tag = variant.replace("-", "_")
                path = f"{args.run_dir}/{tag}_sync_{rep}"
                runs[variant]["sync"].append(sync_save(state, path))
                if variant not in kept:
                    kept[variant], disks[variant] = path, node_disk(path)
                else:
                    remove(path)
                path = f"{args.run_dir}/{tag}_async_{rep}"
                blocking, durable = async_save(state, path, stager)
                runs[variant]["async_blocking"].append(blocking)
                runs[variant]["async_durable"].append(durable)
                remove(path)
        copies.ENABLED = True
        for variant in VARIANTS:
            out = restart(kept[variant], expected)
            per_rank: list = [None] * world
            dist.all_gather_object(per_rank, {k: out.get(k) for k in ("seconds_rank", "bytes", "remote_bytes",
                                                                       "bitwise", "error")})
            errors = sorted({r.pop("error") for r in per_rank} - {None})
            summary["variants"][variant] = {
                "copies_enabled": VARIANTS[variant], "dir": kept[variant], "disks": disks[variant],
                "sync_s": runs[variant]["sync"], "async_blocking_s": runs[variant]["async_blocking"],
                "async_durable_s": runs[variant]["async_durable"],
                "sync_median_s": statistics.median(runs[variant]["sync"]),
                "async_blocking_median_s": statistics.median(runs[variant]["async_blocking"]),
                "async_durable_median_s": statistics.median(runs[variant]["async_durable"]),
                "restart": {"seconds": None if errors else out["seconds"], "error": errors[0] if errors else None,
                            "per_rank": per_rank}}
            record.setdefault("restart", {})[variant] = "failed" if errors else "ok"
    finally:
        stager.close()
    if rank == 0:
        record["summary"] = summary


def restore(record: dict) -> None:
    """A fresh launch: every rank loads ``--restore-dir`` with peers=True (a node's disk may lack
    the step) and compares with the state this rank saved in the bench launch."""
    expected = torch.load(expected_path(), weights_only=True)
    out = restart(args.restore_dir, expected, peers=True)
    if out.get("error"):
        out["error"] = out["error"].replace(args.restore_dir, "DIR")
    record["restore"] = {k: out.get(k) for k in ("seconds_rank", "seconds", "bytes", "remote_bytes", "sources",
                                                   "phases", "bitwise", "error")}
    if out.get("error"):
        raise RuntimeError(out["error"])


record = {"rank": rank, "host": os.uname().nodename, "layout": layout, "action": args.action}
try:
    (restore if args.action == "restore" else main)(record)
except BaseException as exc:  # noqa: BLE001
    traceback.print_exc()
    record["error"] = first_line(exc)
report(record)
dist.destroy_process_group()
