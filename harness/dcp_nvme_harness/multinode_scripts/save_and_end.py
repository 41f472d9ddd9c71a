"""One save, every rank ending its script right after it returns (or fails).

    python save_and_end.py CHECKPOINT_DIR     (under torchrun, or RANK/WORLD_SIZE/MASTER_* set)

$MIRROR_ROOT: the writer's ``mirror_root`` (its drain is not waited for: the exit does that).
$FAIL_RANK: this rank's data file write fails with ENOSPC (DCP then skips ``finish``).
$FAIL_PREPARE=1: this node's copy of the metadata cannot be written (ENOSPC): its node writer
votes no and the coordinator aborts the save.
Each rank prints one ``RESULT {json}`` line (its error) and ends at once, without a barrier.
"""

import errno
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeWriter
from dcp_nvme.engines import host_io
from dcp_nvme.save import node_commit

path = sys.argv[1]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


if os.environ.get("FAIL_RANK") == str(rank):
    host_io.pwrite_all = full
if os.environ.get("FAIL_PREPARE") == "1":
    node_commit.write_commit_file = full
record = {"rank": rank, "host": os.uname().nodename}
try:
    writer = NVMeWriter(path, mirror_root=os.environ.get("MIRROR_ROOT") or None)
    # 9 MiB: more than a request, so the engine writes it (engines.small writes one request)
    dcp.save({f"r{rank}": torch.full((9 << 18,), float(rank))}, storage_writer=writer)
    record["error"] = None
except BaseException as exc:  # noqa: BLE001  DCP raises CheckpointException (a BaseException)
    record["error"] = f"{type(exc).__name__}: {str(exc).strip()[-600:]}"
os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())
dist.destroy_process_group()  # (without it torch may abort at exit, and torchrun then kills the node)
# the script ends here: no barrier, no wait for the drain
