"""What checkpoint metadata costs at N ranks: our coordinator and reader beside stock DCP's pickle.

For each N, the save of an FSDP-sharded Llama-like state (each parameter and AdamW's two moments
cut along dim 0 into N chunks, one per rank) is synthesized as DCP hands it to a storage writer:
every rank's SavePlan (WriteItems, the default planner's planner data) and WriteResults (index
rows, the container's blocks-table record with one crc per 256 KiB block, the rank's figures).
The containers are sparse files of the right size; no data is written. Then, each in a fresh
process so its peak memory is its own:

* save:  ``NVMeWriter.prepare_global_plan`` + ``finish`` (the real coordinator: tables, manifest),
         beside ``pickle.dump`` of the equivalent stock ``Metadata`` (what FileSystemWriter writes);
* load:  ``NVMeReader.read_metadata`` and one rank's load plan (DCP's DefaultLoadPlanner, and
         ``NVMeLoadPlanner`` where this dcp_nvme has it) for that rank's shards;
* stock: ``pickle.load`` of the stock ``.metadata`` and the same rank's DefaultLoadPlanner plan.

Wall and CPU seconds (planning: CPU seconds) and peak RSS (ru_maxrss, MiB) per step, as JSON;
``--plot`` draws CPU cost against N, log-log (on a shared machine the wall clock also measures
the neighbours). ``--backed-memory GIB`` touches and frees that much memory in a throw-away
process before each step: on a VM that backs guest memory lazily a fresh page is a trip to the
host, which a GPU node (guest memory pinned for passthrough) or bare metal does not pay; the
config records a GiB's first touch in a fresh process, and after the backing when it is asked.

    python benchmarks/metadata_scale.py --ranks 64,512,1024 --layers 80 --json scale.json
    python benchmarks/metadata_scale.py --ranks 256,1024,4096 --layers 10 --json s10.json --plot s10.svg
    python benchmarks/metadata_scale.py --ranks 256,1024,2048 --layers 80 --backed-memory 12 --json s80.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pickle
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

CRC_BLOCK = 256 << 10
ALIGN = 4096


@dataclass(frozen=True)
class Model:
    layers: int = 80
    hidden: int = 8192
    ffn: int = 28672
    vocab: int = 128256
    kv: int = 1024

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        out = [("tok_embeddings.weight", (self.vocab, self.hidden))]
        h, f, kv = self.hidden, self.ffn, self.kv
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "attention.wq.weight", (h, h)), (p + "attention.wk.weight", (kv, h)),
                    (p + "attention.wv.weight", (kv, h)), (p + "attention.wo.weight", (h, h)),
                    (p + "feed_forward.w1.weight", (f, h)), (p + "feed_forward.w2.weight", (h, f)),
                    (p + "feed_forward.w3.weight", (f, h)), (p + "attention_norm.weight", (h,)),
                    (p + "ffn_norm.weight", (h,))]
        return out + [("norm.weight", (h,)), ("output.weight", (self.vocab, h))]

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(fqn, global shape, dtype): bf16 weights, fp32 AdamW moments."""
        out = []
        for name, shape in self.params():
            out.append((f"model.{name}", shape, "bfloat16"))
            out.append((f"optim.state.{name}.exp_avg", shape, "float32"))
            out.append((f"optim.state.{name}.exp_avg_sq", shape, "float32"))
        return out


def shard(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP's Shard(0): ceil-sized chunks, the last ranks' empty when dim 0 runs out."""
    each = -(-dim0 // world)
    start = min(rank * each, dim0)
    return start, min(dim0, start + each) - start


ITEMSIZE = {"bfloat16": 2, "float32": 4}


class FakeShard:
    """A rank's shard of one tensor as DCP's load planners see a DTensor: its global size and
    its local chunk (``__create_chunk_list__``), without a process group."""

    def __init__(self, size, chunk):
        self._size, self._chunk = size, chunk

    def size(self):
        return self._size

    def __create_chunk_list__(self):
        return [self._chunk]


def local_chunks(model: Model, world: int, rank: int) -> dict:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    out = {}
    for fqn, shape, _ in model.tensors():
        start, n = shard(shape[0], world, rank)
        chunk = ChunkStorageMetadata(torch.Size((start,) + (0,) * (len(shape) - 1)),
                                     torch.Size((n,) + shape[1:]))
        out[fqn] = FakeShard(torch.Size(shape), chunk)
    return out


def synthesize(model: Model, world: int, directory: str):
    """Every rank's SavePlan and WriteResults, the stock Metadata, and sparse containers."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from dcp_nvme.format import tables
    from dcp_nvme.format.container import data_file_name
    from dcp_nvme.format.tables import ChunkRecord, FileRecord, StoredItem
    from dcp_nvme.host.job import NodeTag

    rows_blob = getattr(tables, "rows_blob", None)  # a dcp_nvme whose ranks encode their rows

    tensors = model.tensors()
    mapping = {fqn: tuple(fqn.split(".")) for fqn, _, _ in tensors}  # DefaultSavePlanner's
    state = {fqn: TensorStorageMetadata(TensorProperties(dtype=getattr(torch, dt)), torch.Size(shape), [])
             for fqn, shape, dt in tensors}
    plans, rank_items, stock_storage = [], [], {}
    for rank in range(world):
        items, placed, offset = [], [], ALIGN
        for fqn, shape, dt in tensors:
            start, n = shard(shape[0], world, rank)
            offsets = (start,) + (0,) * (len(shape) - 1)
            sizes = (n,) + shape[1:]
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            index = MetadataIndex(fqn, torch.Size(offsets))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=chunk, properties=state[fqn].properties, size=state[fqn].size)))
            state[fqn].chunks.append(chunk)
            length = math.prod(sizes) * ITEMSIZE[dt]
            key = fqn if not any(offsets) else f"{fqn}@{','.join(map(str, offsets))}"
            placed.append((index, offsets, sizes, shape, dt, offset, length, key))
            stock_storage[index] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            offset += -(-length // ALIGN) * ALIGN
        plans.append(SavePlan(items, storage_data=NodeTag("host", "node0", None), planner_data=mapping))
        rank_items.append((placed, offset))
    metadata = Metadata(state_dict_metadata=state, planner_data=mapping, storage_data=None)
    return plans, rank_items, metadata, stock_storage, (ChunkRecord, FileRecord, StoredItem, WriteResult,
                                                        data_file_name, rows_blob)


def make_results(rank_items, key: str, directory: str, classes):
    """Every rank's WriteResults, as its write_data returns them (its rows encoded, where this
    dcp_nvme has ranks do that); and the mean seconds a rank spent encoding its rows."""
    ChunkRecord, FileRecord, StoredItem, WriteResult, data_file_name, rows_blob = classes
    results, encode = [], 0.0
    crc = 0x1234ABCD
    for rank, (placed, size) in enumerate(rank_items):
        name = data_file_name(rank, key)
        with open(os.path.join(directory, name), "wb") as f:
            f.truncate(size)  # sparse: the size a reader may check, no data
        crcs = tuple(crc for _ in range(-(-(size - ALIGN) // CRC_BLOCK)))
        record = FileRecord(name, rank, size, ALIGN, CRC_BLOCK, 0, crcs)
        stats = {"rank": rank, "file": name, "items": len(placed), "bytes": size, "engine": "posix",
                 "config": {"queue_depth": 8}, "phases": {"write": 1.0}, "host": f"node{rank // 8}",
                 "io": {"seconds": 1.0, "max_inflight": 8, "requests": 10}, "local_ranks": 8,
                 "drive": {"throttled": False}}
        chunks = [ChunkRecord(index.fqn, "tensor", offsets, sizes, shape, dt, name, offset, length, item_key)
                  for index, offsets, sizes, shape, dt, offset, length, item_key in placed]
        began = time.perf_counter()
        blob = rows_blob(chunks) if rows_blob is not None else None
        encode += time.perf_counter() - began
        extra = (blob,) if blob is not None else ()
        results.append([WriteResult(index=p[0], size_in_bytes=p[6], storage_data=StoredItem(
            chunk, record if i == 0 else None, stats if i == 0 else None, *(extra if i == 0 else ())))
            for i, (p, chunk) in enumerate(zip(placed, chunks))])
    return results, encode / max(len(rank_items), 1)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_save(args) -> dict:
    from dcp_nvme.save.writer import NVMeWriter

    model, world, directory = Model(layers=args.layers), args.world, args.dir
    began = time.perf_counter()
    plans, rank_items, metadata, stock_storage, classes = synthesize(model, world, directory)
    synth = time.perf_counter() - began
    writer = NVMeWriter(directory)
    writer.set_up_storage_writer(True, rank=0)
    base = peak_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    plans = writer.prepare_global_plan(plans)
    t1, c1 = time.perf_counter(), time.process_time()
    results, rank_encode = make_results(rank_items, plans[0].storage_data.save_key, directory, classes)
    t2, c2 = time.perf_counter(), time.process_time()
    writer.finish(metadata, results)
    t3, c3 = time.perf_counter(), time.process_time()
    ours_peak = peak_mib()
    metadata.storage_data = stock_storage
    t4, c4 = time.perf_counter(), time.process_time()
    blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(blob)
    t5, c5 = time.perf_counter(), time.process_time()
    rows = sum(len(r) for r in results)
    sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
             if n.endswith((".parquet", ".json")) or n == ".metadata"}
    return {"rows": rows, "synthesize_s": synth, "rank_encode_rows_s": rank_encode,
            "prepare_global_plan_s": t1 - t0, "finish_s": t3 - t2,
            "commit_s": (t1 - t0) + (t3 - t2), "commit_cpu_s": (c1 - c0) + (c3 - c2),
            "stock_dump_cpu_s": c5 - c4, "commit_peak_mib": ours_peak, "before_commit_peak_mib": base,
            "stock_dump_s": t5 - t4, "stock_bytes": len(blob),
            "manifest_bytes": sizes.get("manifest.json", 0),
            "index_bytes": sum(v for k, v in sizes.items() if k.startswith("index.")),
            "blocks_bytes": sum(v for k, v in sizes.items() if k.startswith("blocks."))}


FLAT = {"flatten_state_dict": False, "flatten_sharded_tensors": False}
"""The fake shards' state dict is flat already (DCP's flattening does not know the fakes)."""


def _plan(planner, state, metadata) -> tuple[float, int]:
    c0 = time.process_time()
    # set_up_planner's state-dict walk drops objects it does not know (the fakes): set it up as it would
    planner.original_state_dict = planner.state_dict = state
    planner.metadata, planner.is_coordinator, planner.mappings = metadata, False, {}
    plan = planner.create_local_plan()
    return time.process_time() - c0, len(plan.items)


def child_load(args) -> dict:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    import dcp_nvme
    from dcp_nvme import NVMeReader

    model, world = Model(layers=args.layers), args.world
    state = local_chunks(model, world, args.rank)
    base = peak_mib()
    reader = NVMeReader(args.dir)
    t0, c0 = time.perf_counter(), time.process_time()
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, False)
    t1, c1 = time.perf_counter(), time.process_time()
    out = {"read_metadata_s": t1 - t0, "read_metadata_cpu_s": c1 - c0, "base_mib": base, "read_peak_mib": peak_mib()}
    ours = getattr(dcp_nvme, "NVMeLoadPlanner", None) if "NVMeLoadPlanner" in dcp_nvme.__all__ else None
    if ours is not None:
        out["nvme_planner_s"], out["nvme_planner_items"] = _plan(ours(**FLAT), state, metadata)
        out["nvme_planner_peak_mib"] = peak_mib()
    out["default_planner_s"], out["default_planner_items"] = _plan(DefaultLoadPlanner(**FLAT), state, metadata)
    out["load_peak_mib"] = peak_mib()
    return out


def _pss_mib() -> float | None:
    """Proportional set size: a page the node's ranks share counts 1/k to each of k."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def child_node(args) -> dict:
    """``read_metadata`` as one of a node's two ranks (``LOCAL_WORLD_SIZE=2``): the first to
    come decodes the index and shares it, the second maps what the first shared."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    from dcp_nvme import NVMeReader

    reader = NVMeReader(args.dir)
    t0, c0 = time.perf_counter(), time.process_time()
    reader.read_metadata()
    t1, c1 = time.perf_counter(), time.process_time()
    mapped = not reader.manifest().columns.grid[0].flags.writeable
    return {"s": t1 - t0, "cpu_s": c1 - c0, "mapped": mapped, "pss_mib": _pss_mib(), "peak_mib": peak_mib()}


def child_stock(args) -> dict:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    model, world = Model(layers=args.layers), args.world
    state = local_chunks(model, world, args.rank)
    base = peak_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    with open(os.path.join(args.dir, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    t1, c1 = time.perf_counter(), time.process_time()
    out = {"stock_load_s": t1 - t0, "stock_load_cpu_s": c1 - c0, "stock_base_mib": base, "stock_read_peak_mib": peak_mib()}
    out["stock_planner_s"], out["stock_planner_items"] = _plan(DefaultLoadPlanner(**FLAT), state, metadata)
    out["stock_peak_mib"] = peak_mib()
    return out


def back_memory(gib: float) -> None:
    """Touch ``gib`` GiB in a process of its own, then free it. On a VM whose host backs guest
    memory lazily (and takes free pages back), a fresh process's first touch of a page is a trip
    to the host; afterwards the guest's free pages are backed, as a GPU node's (VFIO passthrough
    pins all guest memory) or a bare-metal machine's are."""
    if gib > 0:
        subprocess.run([sys.executable, "-c", "import sys, numpy as np; "
                        "a = np.ones(int(float(sys.argv[1]) * (1 << 30)), np.uint8); print(int(a[-1]))", str(gib)],
                       check=True, capture_output=True)


def first_touch_s_per_gib(mib: int = 256) -> float:
    """Seconds a fresh process takes to first touch a GiB (``np.ones`` of ``mib`` MiB, scaled)."""
    code = ("import sys, time, numpy as np; t = time.perf_counter(); a = np.ones(int(sys.argv[1]) << 20, np.uint8); "
            "print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code, str(mib)], check=True, capture_output=True, text=True)
    return float(done.stdout.strip()) * 1024 / mib


def run_child(mode: str, world: int, layers: int, directory: str, rank: int, backed_gib: float = 0.0) -> dict:
    """A step in a fresh process, after ``back_memory(backed_gib)`` (``--backed-memory``)."""
    back_memory(backed_gib)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--world", str(world),
           "--layers", str(layers), "--dir", directory, "--rank", str(rank)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} at {world} ranks failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_here(mode: str, world: int, layers: int, directory: str, rank: int) -> dict:
    """A step in this process (``--in-process``: quick, but the peak memory is not its own)."""
    args = argparse.Namespace(world=world, layers=layers, dir=directory, rank=rank)
    return {"save": child_save, "load": child_load, "stock": child_stock}[mode](args)


def measure(world: int, layers: int, work: str, run: Callable[..., dict]) -> dict:
    """One N: the save, a middle rank's load, a node's two ranks (out of process only) and stock
    DCP's load, each a step by ``run`` (``run_here`` or ``run_child``)."""
    directory = os.path.join(work, f"ckpt_{world}")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    try:
        point = {"ranks": world, "layers": layers}
        point.update(run("save", world, layers, directory, 0))
        rank = world // 2  # a middle rank: its shards are inside every tensor
        point.update(run("load", world, layers, directory, rank))
        if run is not run_here:  # a node's two ranks, one after the other: one decodes, one maps
            first, second = run("node", world, layers, directory, rank), run("node", world, layers, directory, rank)
            point.update({"node_first_read_metadata_cpu_s": first["cpu_s"], "node_first_pss_mib": first["pss_mib"],
                          "node_other_read_metadata_s": second["s"],
                          "node_other_read_metadata_cpu_s": second["cpu_s"],
                          "node_other_mapped": second["mapped"], "node_other_pss_mib": second["pss_mib"]})
        point.update(run("stock", world, layers, directory, rank))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    ours_planning = point.get("nvme_planner_s", point["default_planner_s"])
    # CPU seconds: on a shared machine wall time measures the neighbours too
    point["ours_metadata_plus_planning_s"] = point["read_metadata_cpu_s"] + ours_planning
    point["stock_metadata_plus_planning_s"] = point["stock_load_cpu_s"] + point["stock_planner_s"]
    point["load_speedup"] = point["stock_metadata_plus_planning_s"] / max(point["ours_metadata_plus_planning_s"], 1e-9)
    return point


def fit(points: list[dict], key: str, at: int) -> float | None:
    """Least-squares power law through the points (log-log), evaluated at ``at`` ranks."""
    xs = [(math.log(p["ranks"]), math.log(p[key])) for p in points if p.get(key, 0) > 0]
    if len(xs) < 2:
        return None
    mx, my = sum(x for x, _ in xs) / len(xs), sum(y for _, y in xs) / len(xs)
    var = sum((x - mx) ** 2 for x, _ in xs)
    slope = sum((x - mx) * (y - my) for x, y in xs) / var if var else 0.0
    return math.exp(my + slope * (math.log(at) - mx))


SERIES = [("commit_cpu_s", "our commit"), ("read_metadata_cpu_s", "our read_metadata"),
          ("node_other_read_metadata_cpu_s", "our read_metadata, a node's other ranks"),
          ("nvme_planner_s", "NVMeLoadPlanner plan"), ("default_planner_s", "DefaultLoadPlanner plan (ours)"),
          ("stock_dump_cpu_s", "stock pickle dump"), ("stock_load_cpu_s", "stock pickle load"),
          ("stock_planner_s", "stock DefaultLoadPlanner plan")]


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in SERIES:
        got = [(p["ranks"], p[key]) for p in points if p.get(key)]
        if got:
            ax.loglog(*zip(*got), marker="o", linestyle="--" if key.startswith("stock") else "-", label=label)
    ax.set_xlabel("ranks")
    ax.set_ylabel("CPU seconds (one run)")
    ax.set_title(f"checkpoint metadata cost, {points[0]['layers']} layers, {points[0]['rows'] // points[0]['ranks']} chunks/rank")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="16,64", help="comma-separated rank counts")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--fit-at", type=int, default=16384)
    parser.add_argument("--in-process", action="store_true",
                        help="run every step in this process (a quick check; peak memory is shared)")
    parser.add_argument("--backed-memory", type=float, default=0.0, metavar="GIB",
                        help="touch and free GIB GiB in a process of its own before each measured step: on a "
                             "VM that backs guest memory lazily, the steps then pay for their work and not for "
                             "the host handing out pages (the config records a GiB's first touch either way)")
    parser.add_argument("--child", choices=("save", "load", "node", "stock"), help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"save": child_save, "load": child_load, "node": child_node,
                          "stock": child_stock}[args.child](args)))
        return 0
    try:
        counts = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
    except ValueError:
        raise SystemExit(f"--ranks: comma-separated whole numbers, got {args.ranks!r}") from None
    if not counts or counts[0] < 1 or args.layers < 1:
        raise SystemExit("--ranks and --layers must be positive")
    if args.backed_memory < 0:
        raise SystemExit("--backed-memory must be >= 0")
    import torch

    touch = {"fresh": round(first_touch_s_per_gib(), 4)}
    if args.backed_memory > 0:
        back_memory(args.backed_memory)
        touch["after_backing"] = round(first_touch_s_per_gib(), 4)
    config = {"ranks": counts, "layers": args.layers, "model": Model(layers=args.layers).__dict__,
              "python": platform.python_version(), "torch": torch.__version__,
              "cpus": os.cpu_count(), "machine": platform.machine(), "backed_memory_gib": args.backed_memory,
              "first_touch_s_per_gib": touch}
    print(f"metadata_scale: {config}", flush=True)
    work = args.dir or tempfile.mkdtemp(prefix="dcp_nvme_scale_")
    points = []
    try:
        for world in counts:
            point = measure(world, args.layers, work, run_here if args.in_process else
                            functools.partial(run_child, backed_gib=args.backed_memory))
            points.append(point)
            print(f"{world:>6} ranks {point['rows']:>9} rows | commit {point['commit_s']:7.2f} s "
                  f"(cpu {point['commit_cpu_s']:.2f} s, {point['commit_peak_mib']:6.0f} MiB; each rank encodes its rows "
                  f"in {point.get('rank_encode_rows_s', 0) * 1e3:.1f} ms) | read_metadata "
                  f"{point['read_metadata_s']:6.2f} s (cpu {point['read_metadata_cpu_s']:.2f} s) "
                  f"({point['read_peak_mib']:6.0f} MiB) plan ours {point.get('nvme_planner_s', float('nan')):6.2f} s "
                  f"default {point['default_planner_s']:6.2f} s | stock {point['stock_bytes'] / 1e6:7.1f} MB "
                  f"dump {point['stock_dump_s']:6.2f} s (cpu {point['stock_dump_cpu_s']:.2f}) load {point['stock_load_s']:6.2f} s "
                  f"(cpu {point['stock_load_cpu_s']:.2f}) "
                  f"plan {point['stock_planner_s']:6.2f} s | x{point['load_speedup']:.1f}", flush=True)
            if "node_other_read_metadata_s" in point:
                print(f"{'':>6} a node's other ranks map the first one's index: read_metadata "
                      f"{point['node_other_read_metadata_s']:.3f} s (cpu {point['node_other_read_metadata_cpu_s']:.3f} s,"
                      f" mapped {point['node_other_mapped']}), PSS {point['node_other_pss_mib'] or 0:.0f} MiB vs "
                      f"{point['node_first_pss_mib'] or 0:.0f} MiB for the first", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    fitted = {key: fit(points, key, args.fit_at) for key, _ in SERIES + [
        ("ours_metadata_plus_planning_s", ""), ("stock_metadata_plus_planning_s", ""), ("read_peak_mib", "")]}
    doc = {"config": config, "points": points, "fitted_at": args.fit_at, "fitted": fitted}
    if len(points) > 1:
        print(f"fitted at {args.fit_at} ranks: " + ", ".join(f"{k} {v:.2f}" for k, v in fitted.items() if v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
