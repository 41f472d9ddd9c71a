"""The node-local checkpoint's life on simulated nodes: saves, drains, restarts, reshards.

    python node_local.py ACTION RUN_DIR [options from the environment]

ACTION (one per torchrun launch, as a job would do it):
  save      save steps $STEPS (comma-separated) to RUN_DIR/step_<s>, each rank's shard of ``w``
            full of 10*step + rank; ``overwrite=True`` for every step in $OVERWRITE; with
            $MIRROR_ROOT each is drained there (``mirror_root``) by a Drainer(keep_last=$KEEP) and
            waited for; $CRASH_AT_STEP makes this node's ranks die while writing that step's data,
            $DIE_IN_DRAIN=1 once their drain sent a piece; $NODE_SILENCE: the drains' node_silence
  load      find ``latest(RUN_DIR)`` and load it into fresh tensors (a restart)
  reshard   load RUN_DIR/step_$STEP at this run's world size: from the node's disk (expected to
            fail where the bytes are on another node) and from $MIRROR_ROOT/step_$STEP

Each rank prints one ``RESULT {json}`` line: what it did, figures, and any error.
$MIRROR_OPTIONS: storage options (JSON) for an s3:// mirror. $SHARD_ELEMS: float32 elements per rank (4).
"""

import json
import os
import sys
import threading
import time
import traceback
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dcp_nvme
from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.engines import host_io as files
from dcp_nvme.engines import small
from dcp_nvme.tiers import Drainer, DrainOptions, set_default_drainer

SHARD = int(os.environ.get("SHARD_ELEMS", "4"))  # elements per rank of the saved world (a bench sets more)

action, run_dir = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (world,))
mirror_root = os.environ.get("MIRROR_ROOT") or None
mirror_options = json.loads(os.environ["MIRROR_OPTIONS"]) if os.environ.get("MIRROR_OPTIONS") else None


def report(record: dict) -> None:
    os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())  # one write: ranks share stdout


def state(global_len: int, fill=None) -> dict:
    """``w``: a DTensor of ``global_len`` elements sharded over this world."""
    local = torch.empty(global_len // world)
    if fill is not None:
        local.copy_(fill)
    return {"w": DTensor.from_local(local, mesh, [Shard(0)])}


def saved_values(step: int, saved_world: int) -> list[float]:
    """The whole ``w`` of a step as saved by ``saved_world`` ranks."""
    return [float(10 * step + r) for r in range(saved_world) for _ in range(SHARD)]


save_returned = threading.Event()


def do_save(record: dict) -> None:
    keep = int(os.environ.get("KEEP", "0")) or None
    set_default_drainer(Drainer(DrainOptions(backoff=0.1, retries=2, node_wait=120,
                                             node_silence=float(os.environ.get("NODE_SILENCE", "600"))),
                                keep_last=keep))
    if os.environ.get("DIE_IN_DRAIN") == "1":  # this node dies once its drain sent a piece
        from dcp_nvme.tiers.drainer import set_drain_hook

        def die_in_drain(point, info):
            if point == "piece-sent":
                # once this node's save returned: dying before DCP's last broadcast would fail the
                # survivor's dcp.save (a node dying mid-save is tested apart)
                save_returned.wait(60)
                os._exit(9)

        set_drain_hook(die_in_drain)
    crash_at = int(os.environ.get("CRASH_AT_STEP", "0"))
    overwrite = {int(s) for s in os.environ.get("OVERWRITE", "").split(",") if s}
    writer = NVMeWriter(os.path.join(run_dir, "step_0"), mirror_root=mirror_root, mirror_options=mirror_options)
    record["saves"] = []
    for step in [int(s) for s in os.environ["STEPS"].split(",")]:
        if step == crash_at:
            def die(fd, buffer, offset, real=files.pwrite_all):  # this node loses power mid-write
                real(fd, buffer, offset)
                os._exit(9)
            files.pwrite_all = die  # the engine's first write
            small.pwritev_all = partial(die, real=small.pwritev_all)  # a container of one request
        writer.overwrite = step in overwrite
        began = time.perf_counter()
        dcp.save(state(world * SHARD, float(10 * step + rank)), storage_writer=writer,
                 checkpoint_id=os.path.join(run_dir, f"step_{step}"))
        saved = time.perf_counter() - began
        save_returned.set()
        drained = None
        if writer.drain_future is not None:
            result = writer.drain_future.result(timeout=180)
            drained = {"seconds": round(result.seconds, 3), "nodes": result.nodes, "target": result.target}
        record["saves"].append({"step": step, "seconds": round(saved, 3), "drain": drained})
        dist.barrier()


def do_load(record: dict) -> None:
    found = dcp_nvme.latest(run_dir)
    record["latest"] = None if found is None else os.path.basename(str(found))
    began = time.perf_counter()
    saved_world = int(os.environ.get("SAVED_WORLD", world))
    loaded = state(saved_world * SHARD)
    dcp.load(loaded, storage_reader=NVMeReader(str(found)))
    record["load_seconds"] = round(time.perf_counter() - began, 3)
    values = loaded["w"].to_local()
    record["loaded"] = values.tolist() if values.numel() <= 64 else [float(v) for v in values.unique()]


def do_reshard(record: dict) -> None:
    step, saved_world = int(os.environ["STEP"]), int(os.environ["SAVED_WORLD"])
    try:
        dcp.load(state(saved_world * SHARD), storage_reader=NVMeReader(os.path.join(run_dir, f"step_{step}")))
        record["local_error"] = None
    except BaseException as exc:  # noqa: BLE001  DCP raises CheckpointException (a BaseException)
        record["local_error"] = str(exc)
    loaded = state(saved_world * SHARD)
    began = time.perf_counter()
    dcp.load(loaded, storage_reader=NVMeReader(f"{mirror_root.rstrip('/')}/step_{step}",
                                               storage_options=mirror_options))
    record["mirror_seconds"] = round(time.perf_counter() - began, 3)
    record["loaded"] = loaded["w"].to_local().tolist()
    per_rank = saved_world * SHARD // world
    record["expected"] = saved_values(step, saved_world)[rank * per_rank:(rank + 1) * per_rank]


record = {"rank": rank, "host": os.uname().nodename, "action": action}
try:
    {"save": do_save, "load": do_load, "reshard": do_reshard}[action](record)
except BaseException as exc:  # noqa: BLE001
    traceback.print_exc()
    record["error"] = f"{type(exc).__name__}: {str(exc).strip()[-600:]}"
report(record)
dist.destroy_process_group()
# a failed rank exits non-zero: its torchrun ends the node at once instead of waiting in the
# exit barrier (minutes) for agents of nodes that died
sys.exit(1 if "error" in record else 0)
