"""Surviving a node loss on simulated nodes: saves replicated to peers, restores from the nearest copy.

    python node_loss.py ACTION RUN_DIR [options from the environment]

ACTION:
  save     save steps $STEPS to RUN_DIR/step_<s> with ``replicas=$REPLICAS``; each rank's shard of
           ``w`` is 1000*step + 100*rank + arange; with $MIRROR_ROOT each is drained there
           (Drainer keep_last=$KEEP); the drain and the replication are waited for
  restore  load RUN_DIR/step_<s> for each s in $LOAD_STEPS (saved by $SAVED_WORLD ranks) with
           ``NVMeReader(mirror=$MIRROR_ROOT, peers=True)``: each rank checks its values bit for bit

Faults: $FLIP_REPLICA_SENDS, $NO_ROOM_FOR_REPLICAS_OF (below).
Each rank prints one ``RESULT {json}`` line. $SHARD_ELEMS: float32 elements per saved rank.
$MIRROR_OPTIONS: storage options (JSON) for an s3:// mirror.
"""

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.tiers import Drainer, DrainOptions, set_default_drainer

SHARD = int(os.environ.get("SHARD_ELEMS", "1024"))

action, run_dir = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (world,))
mirror_root = os.environ.get("MIRROR_ROOT") or None
mirror_options = json.loads(os.environ["MIRROR_OPTIONS"]) if os.environ.get("MIRROR_OPTIONS") else None


def report(record: dict) -> None:
    import json

    os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())  # one write: ranks share stdout


def saved(step: int, saved_world: int) -> torch.Tensor:
    """The whole ``w`` of a step as ``saved_world`` ranks saved it."""
    return torch.cat([1000.0 * step + 100.0 * r + torch.arange(SHARD, dtype=torch.float32)
                      for r in range(saved_world)])


def flip_what_this_node_replicates() -> None:
    """A fault of this test ($FLIP_REPLICA_SENDS=1): each piece this node sends to its replica
    has a byte flipped after its own check, as a bad link would."""
    from dcp_nvme.peers import replicate

    checked = replicate._read_piece

    def flipped(*args, **kwargs):
        data = checked(*args, **kwargs)
        if data is not None:
            data[len(data) // 2] ^= 0xFF
        return data

    replicate._read_piece = flipped


def no_room_for_replicas_of(step: str) -> None:
    """A fault of this test ($NO_ROOM_FOR_REPLICAS_OF=STEP): this node's disk is full when it
    makes the directory of the replica it holds of step STEP (it fails before a byte comes)."""
    import errno

    from dcp_nvme.peers import replicate

    real = replicate.make_private_dir

    def full(path, *args, **kwargs):
        if f"step_{step}{os.sep}.replicas" in os.fspath(path):
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))
        return real(path, *args, **kwargs)

    replicate.make_private_dir = full


def do_save(record: dict) -> None:
    if os.environ.get("FLIP_REPLICA_SENDS") == "1":
        flip_what_this_node_replicates()
    if os.environ.get("NO_ROOM_FOR_REPLICAS_OF"):
        no_room_for_replicas_of(os.environ["NO_ROOM_FOR_REPLICAS_OF"])
    keep = int(os.environ.get("KEEP", "0")) or None
    set_default_drainer(Drainer(DrainOptions(backoff=0.1, retries=2, node_wait=120), keep_last=keep))
    writer = NVMeWriter(os.path.join(run_dir, "step_0"), mirror_root=mirror_root, mirror_options=mirror_options,
                        replicas=int(os.environ.get("REPLICAS", "1")))
    record["saves"] = []
    for step in [int(s) for s in os.environ["STEPS"].split(",")]:
        began = time.perf_counter()
        local = saved(step, world)[rank * SHARD:(rank + 1) * SHARD].clone()
        dcp.save({"w": DTensor.from_local(local, mesh, [Shard(0)])}, storage_writer=writer,
                 checkpoint_id=os.path.join(run_dir, f"step_{step}"))
        entry = {"step": step, "seconds": round(time.perf_counter() - began, 3)}
        if writer.replication_future is not None:
            result = writer.replication_future.result(timeout=120)
            entry["replication"] = {"pulled": result.pulled, "replicated_on": result.replicated_on,
                                    "failed": result.failed, "bytes": result.bytes,
                                    "seconds": round(result.seconds, 3)}
        if writer.drain_future is not None:
            writer.drain_future.result(timeout=180)
            entry["drained"] = True
        record["saves"].append(entry)
        dist.barrier()


def do_restore(record: dict) -> None:
    saved_world = int(os.environ["SAVED_WORLD"])
    record["loads"] = []
    for step in [int(s) for s in os.environ["LOAD_STEPS"].split(",")]:
        total = saved_world * SHARD
        loaded = {"w": DTensor.from_local(torch.full((total // world,), -1.0), mesh, [Shard(0)])}
        reader = NVMeReader(os.path.join(run_dir, f"step_{step}"), mirror=mirror_root, mirror_options=mirror_options,
                            peers=True)
        began = time.perf_counter()
        entry = {"step": step}
        try:
            dcp.load(loaded, storage_reader=reader)
            want = saved(step, saved_world)[rank * (total // world):(rank + 1) * (total // world)]
            entry["equal"] = bool(torch.equal(loaded["w"].to_local(), want))
            entry["sources"] = (reader.last_stats or {}).get("sources")
            entry["from_received"] = (reader.last_stats or {}).get("from_received_bytes", 0)
        except BaseException as exc:  # noqa: BLE001  DCP raises CheckpointException (a BaseException)
            entry["error"] = f"{type(exc).__name__}: {str(exc).strip()[-600:]}"
        entry["seconds"] = round(time.perf_counter() - began, 3)
        record["loads"].append(entry)
        dist.barrier()


record = {"rank": rank, "host": os.uname().nodename, "action": action}
try:
    {"save": do_save, "restore": do_restore}[action](record)
except BaseException as exc:  # noqa: BLE001
    traceback.print_exc()
    record["error"] = f"{type(exc).__name__}: {str(exc).strip()[-600:]}"
report(record)
dist.destroy_process_group()
# a failed rank exits non-zero: its torchrun ends the node at once instead of waiting in the
# exit barrier (minutes) for agents of nodes that died
sys.exit(1 if "error" in record else 0)
