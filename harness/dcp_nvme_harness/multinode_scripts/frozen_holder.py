"""A transfer of a restore whose holder freezes after it began: two ranks, one process each.

    python frozen_holder.py CHECKPOINT    (RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT set)

Both ranks join a gloo job whose timeout is $JOB_TIMEOUT seconds and run one wave of the
restore's exchange (``peers.streams.run_wave`` over ``peers.exchange``'s group): rank 1 holds the
checkpoint's rank file and sends it to rank 0 in pieces; after its first piece it stops itself
(SIGSTOP), as a process frozen by a debugger or the kernel would. Rank 0 prints one
``RESULT {json}`` line: the error it got and the seconds it waited, then ends at once.
"""

import datetime
import json
import os
import signal
import sys
import time

import torch.distributed as dist

from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.format.pieces import Span
from dcp_nvme.peers import exchange, streams
from dcp_nvme.storage.local_dir import LocalStore

path = sys.argv[1]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ["JOB_TIMEOUT"])))
manifest = read_manifest(LocalStore(path), path)
records = read_files(LocalStore(path), manifest, path)
name = manifest.file_names[0]
record = records[name]
wave = [(0, streams.Transfer(0, 0, Span(name, record.data_start, record.size), 1))]  # rank 0 needs it, rank 1 holds it
if rank == 1:
    reads = [0]
    checked = streams.read_checked

    def read_then_freeze(*args, **kwargs):
        reads[0] += 1
        if reads[0] == 2:  # the first piece is on its way: freeze
            os.kill(os.getpid(), signal.SIGSTOP)
        return checked(*args, **kwargs)

    streams.read_checked = read_then_freeze
group = exchange._exchange_group()
dist.barrier()
began = time.monotonic()
error = None
try:
    streams.run_wave(group, 0, wave, records, ["n0", "n1"], {name: os.path.join(path, name)},
                     lambda record, at, data: None)
except Exception as exc:  # noqa: BLE001  what the restoring rank sees is the result
    error = f"{type(exc).__name__}: {exc}"
os.write(1, ("RESULT " + json.dumps({"rank": rank, "error": error,
                                     "seconds": round(time.monotonic() - began, 2)}) + "\n").encode())
os._exit(0)  # the peer is frozen: no goodbye to it
