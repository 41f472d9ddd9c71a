"""Each worker writes <mount>/hello.<RANK> (its host name and node rank) and joins a gloo all_reduce.

    python hello.py MOUNT
env HELLO_STALL=1: write the file, then wait forever before the all_reduce (a node that hangs,
for a test to kill from outside).
"""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def report(record: dict) -> None:
    """One `RESULT {json}` line in a single write: the node's ranks share one stdout."""
    os.write(1, ("RESULT " + json.dumps(record) + "\n").encode())


mount = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
host = socket.gethostname()
with open(os.path.join(mount, f"hello.{rank}"), "w") as f:
    f.write(f"{host} {os.environ['GROUP_RANK']}\n")
if os.environ.get("HELLO_STALL") == "1":
    time.sleep(3600)
total = torch.tensor([float(rank)])
dist.all_reduce(total)
# the name's address only on a private network, whose /etc/hosts names the nodes: on the host's
# network a lookup of "node1" could go to a DNS server off the machine
resolves = socket.gethostbyname(host) if os.environ.get("GLOO_SOCKET_IFNAME") == "eth0" else None
report({"rank": rank, "world": world, "host": host, "group_rank": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]), "sum": total.item(), "seen": sorted(os.listdir(mount)),
        "addr": os.environ.get("MULTINODE_ADDR"), "resolves": resolves})
dist.destroy_process_group()
