"""No lock-in, outward: stock torch (its HuggingFaceStorageReader, no dcp_nvme installed) loads a
checkpoint NVMeWriter saved on 2 and 4 ranks into 1, 2 and 3 ranks, bitwise; what it cannot do
(non-tensor items) fails as the docs say; stock ``dcp.load`` fails as the README says."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.dist_utils import run_ranks
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.format.container import SHARDING_INFO, is_pad_key


def full_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "embed": torch.randn(64, 24, generator=generator),
        "big": torch.randn(256, 160, generator=generator),  # 160 KiB: placed by its address, with pads
        "proj": torch.randn(10, 6, generator=generator).to(torch.bfloat16),  # 10 rows on 4 ranks: 3,3,3,1
        "ids": torch.arange(36, dtype=torch.int64).reshape(12, 3),
        "norm": torch.randn(20_000, generator=generator),  # a plain tensor: replicated, one rank writes it
    }


def _save(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state: dict = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()}
    # 4 bytes into its memory: the writer places it by its address, a pad before it
    state["norm"] = torch.cat([torch.zeros(1), full_state()["norm"]])[1:]
    state["step"] = 11  # a non-tensor item
    dcp.save(state, storage_writer=NVMeWriter(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, str]:
    """One FSDP-like (row-sharded DTensor) save per world size, shared by the module's tests."""
    root = tmp_path_factory.mktemp("hf_interop")
    paths = {}
    for world in (2, 4):
        paths[world] = str(root / f"saved_on_{world}")
        run_ranks(world, _save, paths[world])
    torch.save(full_state(), root / "expected.pt")
    return paths


# Runs with ``python -I`` and a finder that refuses dcp_nvme (the venv's editable install would
# find it otherwise): what a user without the plugin has.
_STOCK_LOADER = textwrap.dedent('''
    import sys

    class NoDcpNvme:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "dcp_nvme":
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoDcpNvme)

    import io, json, os, socket
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def bits(t):
        return t.detach().reshape(-1).view(torch.uint8)

    def load(rank, world, path, expected_file, port):
        expected = torch.load(expected_file, weights_only=True)
        if world == 1:
            dest = {k: torch.zeros_like(v) for k, v in expected.items()}
            dcp.load(dest, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
            got = dest
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
            mesh = init_device_mesh("cpu", (world,))
            dest = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in expected.items()}
            dcp.load(dest, storage_reader=HuggingFaceStorageReader(path))
            got = {k: v.full_tensor() for k, v in dest.items()}
            dist.destroy_process_group()
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and torch.equal(bits(got[key]), bits(value)), (path, world, key)

    if __name__ == "__main__":
        try:
            import dcp_nvme  # noqa: F401
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("dcp_nvme is importable here")
        cases, expected_file = json.loads(sys.argv[1]), sys.argv[2]
        for path, world in cases:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            # torch is imported already: forked ranks start at once (this process runs no torch op
            # before its last fork: a fork of a process with torch's thread pools up can hang)
            mp.start_processes(load, args=(world, path, expected_file, port), nprocs=world,
                               join=True, start_method="fork")
        # the non-tensor item: torch's reader lists it as the uint8 bytes of its torch.save archive
        path = cases[0][0]
        size = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata["step"].size
        raw = {"step": torch.zeros(size, dtype=torch.uint8)}
        dcp.load(raw, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
        assert torch.load(io.BytesIO(raw["step"].numpy().tobytes()), weights_only=True) == 11
        assert not [m for m in sys.modules if m.split(".")[0] == "dcp_nvme"]
        print("stock torch loaded", len(cases), "cases")
''')


@pytest.mark.slow  # other processes
def test_stock_torch_without_dcp_nvme_loads_and_reshards_bitwise(saved, tmp_path):
    script = tmp_path / "stock_loader.py"
    script.write_text(_STOCK_LOADER)
    cases = [[saved[world], load] for world in (2, 4) for load in (1, 2, 3)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    done = subprocess.run([sys.executable, "-I", str(script), json.dumps(cases),
                           os.path.join(os.path.dirname(saved[2]), "expected.pt")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stock torch loaded 6 cases" in done.stdout


def test_every_key_of_every_rank_file_has_its_offsets_and_pads_are_unique(saved):
    path = saved[4]
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(files) == 4  # the directory's only top-level .safetensors: the rank files
    pads: list[str] = []
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            info = json.loads(f.metadata()[SHARDING_INFO])
            assert sorted(info) == sorted(f.keys())  # torch looks up every key it lists
            pads += [k for k in f.keys() if is_pad_key(k)]
            assert info["proj"]["saved_offsets"] == [[0, 3, 6, 9][int(name[5:10])], 0]  # rows 3,3,3,1
    assert pads and len(pads) == len(set(pads))  # named by rank: no two files' pads are one tensor


def test_a_non_tensor_item_is_refused_by_torchs_reader_as_the_docs_say(saved):
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"step": 0}, storage_reader=HuggingFaceStorageReader(saved[2]), no_dist=True)
    assert "Invalid checkpoint metadata for step, expected BytesStorageMetadata" in str(caught.value)


def test_our_reader_still_loads_it(saved):
    dest: dict = {k: torch.zeros_like(v) for k, v in full_state().items()}
    dest["step"] = 0
    dcp.load(dest, storage_reader=NVMeReader(saved[4]), no_dist=True)
    assert dest.pop("step") == 11
    assert all(torch.equal(dest[k], v) for k, v in full_state().items())


def test_stock_dcp_load_fails_on_the_missing_metadata_file(saved):
    """torch has no hook: its FileSystemReader unpickles ``.metadata``, which we do not write
    (README, first section, says what to use instead)."""
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"norm": torch.zeros(20_000)}, checkpoint_id=saved[2], no_dist=True)
    assert ".metadata" in str(caught.value)
    assert os.path.isfile(os.path.join(saved[2], ".metadata.HOW_TO_LOAD.txt"))


def test_bytes_of_the_step_item_are_a_torch_save_archive(saved):
    size = HuggingFaceStorageReader(saved[4]).read_metadata().state_dict_metadata["step"].size
    raw = {"step": torch.zeros(size, dtype=torch.uint8)}
    dcp.load(raw, storage_reader=HuggingFaceStorageReader(saved[4]), no_dist=True)
    assert torch.load(io.BytesIO(raw["step"].numpy().tobytes()), weights_only=True) == 11


def test_two_chunks_of_one_fqn_on_a_rank_keep_apart_by_their_offsets():
    from dcp_nvme.format.container import ItemSpec
    from dcp_nvme.format.tables import ChunkRecord, chunk_rows
    from dcp_nvme.save.items import unique_keys

    def item(fqn, offsets):
        record = ChunkRecord(fqn, "tensor", offsets, (2, 4), (8, 4), "float32", "", 0, 32, fqn)
        return ItemSpec(fqn, 32, "F32", (2, 4), offsets), torch.zeros(32, dtype=torch.uint8), record

    keyed = unique_keys([item("a", (0, 0)), item("a", (4, 0)), item("b", (2, 0))])
    assert [(spec.key, record.key) for spec, _, record in keyed] == [("a@0,0",) * 2, ("a@4,0",) * 2, ("b",) * 2]
    # format 4 leaves out the keys that are the fqn; the offsets keys are stored
    assert chunk_rows([r for _, _, r in keyed], fqn_keys=True).column("key").to_pylist() == ["a@0,0", "a@4,0", None]
