"""Every dcp_nvme error survives the trip between ranks: DCP gathers a failed rank's exception to
every rank by pickling it, so each class must unpickle with its message and attributes (the
default reduce calls ``__init__`` with the message alone, and raised TypeError on every rank)."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.ports import reserve_port
from dcp_nvme_harness.warm import warm_python

import dcp_nvme.errors
from dcp_nvme import NVMeWriter
from dcp_nvme.format.container import MANIFEST

REPO = Path(__file__).resolve().parents[2]


def _error_classes() -> list[type[dcp_nvme.errors.DCPNVMeError]]:
    return [c for c in vars(dcp_nvme.errors).values()
            if inspect.isclass(c) and issubclass(c, dcp_nvme.errors.DCPNVMeError)]


def _example(cls: type[Exception]) -> Exception:
    """An instance of ``cls`` from its own signature: each parameter a distinct value of its type."""
    args: list[object] = []
    kwargs: dict[str, object] = {}
    own = next((c.__init__ for c in cls.__mro__ if "__init__" in vars(c) and issubclass(c, dcp_nvme.errors.DCPNVMeError)),
               None)  # else the built-in base's: the message alone
    params = list(inspect.signature(own).parameters.values())[1:] if own else []
    for i, param in enumerate(params):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value: object = {"int": 1000 + i, "bool": True}.get(str(param.annotation), f"{param.name} {i}")
        if param.kind == param.KEYWORD_ONLY:
            kwargs[param.name] = value
        else:
            args.append(value)
    if not args and not kwargs:
        args = [f"{cls.__name__} says what to do"]
    return cls(*args, **kwargs)


def test_the_error_classes_are_all_found():
    names = {c.__name__ for c in _error_classes()}
    assert {"ChecksumMismatchError", "TableError", "DrainError", "LockFileError", "StorageError"} <= names


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_message_and_attributes(cls):
    error = _example(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)
    if isinstance(error, OSError):
        assert (back.errno, back.strerror) == (error.errno, error.strerror)


def test_a_storage_error_keeps_its_errno():
    back = pickle.loads(pickle.dumps(dcp_nvme.errors.StorageError(28, "cannot write x: No space left on device")))
    assert back.errno == 28 and "cannot write x" in str(back)


LOAD = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from dcp_nvme import NVMeReader
    dist.init_process_group("gloo")
    records = []
    for path in sys.argv[2:]:
        dest = {"alpha": torch.zeros(300_000), "beta": torch.zeros(500, 300)}
        try:
            dcp.load(dest, storage_reader=NVMeReader(path))
            said = {"error": None}
        except BaseException as exc:  # DCP's CheckpointException is one
            failures = getattr(exc, "failures", {})
            said = {"error": type(exc).__name__, "message": str(exc),
                    "failures": {str(r): type(f[0] if isinstance(f, tuple) else f).__name__
                                 for r, f in failures.items()}}
        records.append({"rank": dist.get_rank(), "path": path, **said})
    with open(os.path.join(sys.argv[1], f"rank_{dist.get_rank()}.json"), "w") as out:  # not one stdout
        json.dump(records, out)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_ranks_under_torchrun_see_the_checksum_and_table_errors(tmp_path):
    """One launch of two ranks loads a checkpoint with a flipped data byte and one with a damaged
    blocks table: every rank names the file, the bytes and the item (it was a TypeError)."""
    state = {"alpha": torch.randn(300_000), "beta": torch.randn(500, 300)}
    flipped, table = tmp_path / "flipped", tmp_path / "table"
    for path in (flipped, table):
        dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    doc = json.loads((flipped / MANIFEST).read_text())
    data = sorted(f["name"] for f in doc["files"])[0]
    blocks = json.loads((table / MANIFEST).read_text())["blocks"]["name"]
    for path, name, offset in ((flipped, data, 4096 + 1234), (table, blocks, 50)):
        with open(path / name, "r+b") as handle:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0x40]))
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = warm_python().run(["-m", "dcp_nvme_harness.launch", "--nnodes", "1", "--nproc-per-node", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(reserve_port()),
                              "--max-restarts", "0", script, tmp_path, flipped, table], env=env, timeout=150)
    records = [r for f in sorted(tmp_path.glob("rank_*.json")) for r in json.loads(f.read_text())]
    said = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0 and len(records) == 4, said
    for record in records:
        assert record["error"] and "TypeError" not in record["message"], record
        if record["path"] == str(flipped):
            assert set(record["failures"].values()) <= {"ChecksumMismatchError"}, record
            assert "checksum mismatch" in record["message"] and data in record["message"], record
            assert " bytes [" in record["message"] and "(item " in record["message"], record
        else:
            assert "TableError" in record["failures"].values() or record["error"] == "TableError", record
            assert blocks in record["message"] and "does not match manifest.json" in record["message"], record
