"""A restore's receive from a peer ends with the job's timeout: a holder frozen (SIGSTOP) after
the transfer began fails the restoring rank with a PeerError naming it, instead of holding it
for torch's default 30 minutes of a group made without a timeout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.multinode import SCRIPTS
from dcp_nvme_harness.ports import reserve_port
from dcp_nvme_harness.warm import warm_python

from dcp_nvme import NVMeWriter

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT = 4


@pytest.mark.slow
def test_a_holder_frozen_mid_transfer_fails_the_receive_within_the_job_timeout(tmp_path):
    path = str(tmp_path / "step_1")
    # 12 MiB in 64 KiB blocks: pieces of 2, 4, 6 MiB, so the holder freezes after the first
    dcp.save({"w": torch.arange(3 << 20, dtype=torch.float32)}, storage_writer=NVMeWriter(path, block_size="64KiB"),
             no_dist=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserve_port()),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "JOB_TIMEOUT": str(JOB_TIMEOUT)}
    script = SCRIPTS / "frozen_holder.py"
    holder = warm_python().start([script, path], env={**env, "RANK": "1"})
    try:
        receiver = warm_python().run([script, path], env={**env, "RANK": "0"}, timeout=60)
    finally:
        holder.kill()
        holder.close()
    records = [json.loads(line[len("RESULT "):]) for line in receiver.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(records) == 1, receiver.stderr[-3000:]
    error, seconds = records[0]["error"], records[0]["seconds"]
    assert error and error.startswith("PeerError: node n1 (rank 1, the holder of a transfer) stopped answering"), error
    assert JOB_TIMEOUT - 1 <= seconds < JOB_TIMEOUT + 10, seconds
