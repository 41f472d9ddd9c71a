"""A restore's load copies what already came to its rank into the tensors while the rest still
comes (``peers.restore.ManyRankRestore.take_while_coming``): only items whose every checked block
is held, the others are left for the read after the exchange."""

from __future__ import annotations

import concurrent.futures
import threading

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.engines.requests import IOStats, PhaseTimer
from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.peers.kept import ReceivedBytes
from dcp_nvme.peers.restore import ManyRankRestore
from dcp_nvme.seams import Wanted
from dcp_nvme.storage.local_dir import LocalStore


def test_items_whose_bytes_came_are_copied_while_the_rest_comes(tmp_path):
    path = str(tmp_path / "step_1")
    torch.manual_seed(0)
    saved = {f"w{i}": torch.randn(64, 1024) for i in range(4)}  # 256 KiB each, in file order
    dcp.save(saved, storage_writer=NVMeWriter(path, block_size="64KiB"), no_dist=True)
    manifest = read_manifest(LocalStore(path), path)
    (name,) = manifest.file_names
    record = read_files(LocalStore(path), manifest, path)[name]
    with open(f"{path}/{name}", "rb") as f:
        data = f.read()

    # the first two tensors' blocks came (with the header), the rest is still on its way
    reader = NVMeReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    out = {k: torch.full_like(v, -1.0) for k, v in saved.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(out, metadata, True)
    items = reader._planned_items(planner.create_local_plan(), planner)
    chunks = {item.dest_index.fqn: reader._chunk(item) for item in items}
    second = chunks["w1"]
    came = record.data_start + -(-(second.byte_offset + second.length - record.data_start)
                                 // record.checksum_block) * record.checksum_block
    assert came < chunks["w2"].byte_offset + chunks["w2"].length  # w2 is not whole yet
    peers = ManyRankRestore.__new__(ManyRankRestore)
    peers.received, peers.from_received, peers.came = ReceivedBytes(1 << 30), 0, {}
    peers.files, peers.kept = read_files(LocalStore(path), manifest, path), None
    own: concurrent.futures.Future[set[str]] = concurrent.futures.Future()
    peers._own = own
    reader._restore = peers

    def read(some, into, spans, held_only):
        return reader._run_items(some, planner, into, spans, held_only)

    def arrive() -> None:  # in two pieces, a little apart; then the own files are done
        peers.received.add(name, 0, memoryview(data[:came // 2]))
        threading.Event().wait(0.1)
        peers.received.add(name, came // 2, memoryview(data[came // 2:came]))
        threading.Event().wait(0.3)
        own.set_result(set())

    thread = threading.Thread(target=arrive)
    thread.start()
    wanted = Wanted(items, [reader._chunk(item) for item in items], set(), reader.storage_data, read)
    rest = peers.take_while_coming(list(zip(wanted.items, wanted.chunks)), wanted, IOStats("read"), PhaseTimer())
    thread.join()
    assert sorted(item.dest_index.fqn for item, _ in rest) == ["w2", "w3"]
    assert torch.equal(out["w0"], saved["w0"]) and torch.equal(out["w1"], saved["w1"])
    assert (out["w2"] == -1).all() and (out["w3"] == -1).all()  # left for the read after the exchange
    assert peers.from_received >= 2 * 64 * 1024 * 4
