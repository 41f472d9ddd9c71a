"""Dropping NVMeWriter/NVMeReader in where FileSystemWriter/FileSystemReader were: the path as
DCP's checkpoint_id only, the stock classes' arguments, URLs, and the overwrite refusal."""

from __future__ import annotations

import inspect
import os
import warnings
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat

from dcp_nvme import CheckpointExistsError, DCPNVMeError, NVMeReader, NVMeWriter
from dcp_nvme.errors import InvalidInputError, UnknownOptionError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(value: float) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) + value, "b": torch.full((7,), value).to(torch.bfloat16)}


def _load(reader: NVMeReader, checkpoint_id=None) -> dict:
    dest = {"w": torch.zeros(1000), "b": torch.zeros(7, dtype=torch.bfloat16)}
    dcp.load(dest, checkpoint_id=checkpoint_id, storage_reader=reader)
    return dest


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_path_given_only_as_checkpoint_id(tmp_path):
    writer, reader = NVMeWriter(), NVMeReader()  # one of each, reused for every step, as with the stock classes
    for step in (1, 2):
        dcp.save(_state(step), checkpoint_id=tmp_path / f"step_{step}", storage_writer=writer)
        assert writer.checkpoint_id == str(tmp_path / f"step_{step}")
    for step in (1, 2):
        assert _same(_load(reader, tmp_path / f"step_{step}"), _state(step))
        assert reader.read_metadata().storage_meta.checkpoint_id == str(tmp_path / f"step_{step}")
    with pytest.raises(CheckpointException, match=r"NVMeWriter has no checkpoint directory.*checkpoint_id="):
        dcp.save(_state(3), storage_writer=NVMeWriter())
    with pytest.raises(CheckpointException, match=r"NVMeReader has no checkpoint directory.*checkpoint_id="):
        _load(NVMeReader())


def test_validate_checkpoint_id(tmp_path):
    for ok in (str(tmp_path / "c"), tmp_path / "c", f"file://{tmp_path}/c", "relative/dir"):
        assert NVMeWriter.validate_checkpoint_id(ok) and NVMeReader.validate_checkpoint_id(ok), ok
    assert not NVMeWriter.validate_checkpoint_id("s3://bucket/step_1")  # the writer saves locally
    assert NVMeReader.validate_checkpoint_id("s3://bucket/step_1")  # the reader reads over fsspec
    assert not NVMeWriter.validate_checkpoint_id(7) and not NVMeReader.validate_checkpoint_id(None)


STOCK_DEFAULTS = {name: p.default for name, p in inspect.signature(FileSystemWriter.__init__).parameters.items()
                  if p.default is not inspect.Parameter.empty}


def _label(value) -> str:
    return value.name if isinstance(value, SerializationFormat) else "list" if isinstance(value, list) else repr(value)


def test_every_filesystemwriter_argument_is_accepted_or_refused_by_name(tmp_path):
    """Each of FileSystemWriter's arguments, at its stock default and at another value: accepted,
    or refused with a dcp_nvme error naming the option of ours that does that job."""
    assert {"thread_count", "sync_files", "single_file_per_rank", "per_thread_copy_ahead",
            "cache_staged_state_dict", "overwrite"} <= set(STOCK_DEFAULTS)
    others = {"single_file_per_rank": False, "sync_files": False, "thread_count": 8, "per_thread_copy_ahead": 1,
              "cache_staged_state_dict": True, "overwrite": False, "_extensions": [object()],
              "serialization_format": SerializationFormat.SAFETENSORS}
    outcomes = {}
    for name, default in STOCK_DEFAULTS.items():
        for value in (default, others[name]):
            try:
                NVMeWriter(tmp_path / "c", **{name: value})
                outcomes[name, _label(value)] = "accepted"
            except InvalidInputError as exc:
                assert f"{name}=" in str(exc) and "FileSystemWriter option" in str(exc)
                outcomes[name, _label(value)] = str(exc).rsplit(": ", 1)[-1]
    said = "\n".join(f"{k}: {v}" for k, v in outcomes.items())
    for name, value in (("single_file_per_rank", True), ("sync_files", True), ("cache_staged_state_dict", False),
                        ("overwrite", True), ("overwrite", False), ("_extensions", None)):
        assert outcomes[name, repr(value)] == "accepted", said
    assert outcomes["serialization_format", "SAFETENSORS"] == "accepted"
    assert "queue_depth=N" in outcomes["thread_count", "1"]
    assert "block_size=" in outcomes["per_thread_copy_ahead", "10000000"]
    assert "NVMeStager" in outcomes["cache_staged_state_dict", "True"]
    assert "NVMeStager" in outcomes["sync_files", "False"]
    assert "--to torch" in outcomes["serialization_format", "TORCH_SAVE"]
    assert "compress=" in outcomes["_extensions", "list"]


def test_unknown_and_positional_arguments_are_dcp_nvme_errors(tmp_path):
    with pytest.raises(UnknownOptionError, match=r"no option queue_dept=4; did you mean queue_depth\?"):
        NVMeWriter(tmp_path / "c", queue_dept=4)
    with pytest.raises(UnknownOptionError, match=r"no option alow_pickle=True; did you mean allow_pickle\?"):
        NVMeReader(tmp_path / "c", alow_pickle=True)
    with pytest.raises(UnknownOptionError, match=r"sync_files=False.*by keyword"):
        NVMeWriter(tmp_path / "c", True, False)
    with pytest.raises(InvalidInputError, match="reads no stream extensions"):
        NVMeReader(tmp_path / "c", _extension_registry=object())
    assert NVMeReader(tmp_path / "c", _extension_registry=None).path == str(tmp_path / "c")
    assert set(inspect.signature(FileSystemReader.__init__).parameters) == {"self", "path", "_extension_registry"}


def test_a_url_is_never_a_local_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInputError, match=r"not to s3://bucket/run/step_5.*mirror='s3://bucket/run/step_5'"):
        NVMeWriter("s3://bucket/run/step_5")
    with pytest.raises(InvalidInputError, match="mirror="):
        dcp.save(_state(1), checkpoint_id="s3://bucket/run/step_6", storage_writer=NVMeWriter())
    with pytest.raises(InvalidInputError, match="fsspec knows no protocol 'nosuch'"):
        NVMeReader("nosuch://bucket/x")
    assert os.listdir(tmp_path) == []  # no ./s3:/bucket/... made
    # the reader serves a URL through fsspec, also as checkpoint_id
    dcp.save(_state(4), storage_writer=NVMeWriter(tmp_path / "c"))
    fs = fsspec.filesystem("memory")
    for path in Path(tmp_path / "c").iterdir():
        fs.pipe_file(f"/dropin-{os.getpid()}/{path.name}", path.read_bytes())
    try:
        assert _same(_load(NVMeReader(), f"memory:///dropin-{os.getpid()}"), _state(4))
    finally:
        fs.rm(f"/dropin-{os.getpid()}", recursive=True)


def test_overwrite_refusal_is_one_line_in_the_stock_wording(tmp_path, monkeypatch):
    dcp.save(_state(1), storage_writer=NVMeWriter(tmp_path / "c"))
    for attempt in (lambda: NVMeWriter(tmp_path / "c"),
                    lambda: dcp.save(_state(2), checkpoint_id=tmp_path / "c", storage_writer=NVMeWriter())):
        with pytest.raises(CheckpointException) as info:  # what code written for the stock writer catches
            attempt()
        exc = info.value
        assert isinstance(exc, CheckpointExistsError) and isinstance(exc, DCPNVMeError)
        assert str(exc) == (f"Checkpoint already exists at {tmp_path / 'c'} and overwrite=False: pass "
                            "overwrite=True to replace it (it stays loadable until the new one commits) or "
                            "save elsewhere")
        assert [type(e).__name__ for e, _ in exc.failures.values()] == ["CheckpointExistsError"]
    # in a group of ranks the coordinator refuses while planning: DCP wraps it, same sentence last
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(3), storage_writer=NVMeWriter(tmp_path / "c"), no_dist=True)
    assert str(info.value).strip().splitlines()[-1].startswith(
        "dcp_nvme.errors.CheckpointExistsError: Checkpoint already exists at ")
    monkeypatch.delenv("WORLD_SIZE")
    assert _same(_load(NVMeReader(tmp_path / "c")), _state(1))  # untouched
    dcp.save(_state(5), storage_writer=NVMeWriter(tmp_path / "c", overwrite=True))
    assert _same(_load(NVMeReader(tmp_path / "c")), _state(5))


def test_a_location_that_is_not_a_path_is_refused_by_name():
    with pytest.raises(InvalidInputError, match="^a checkpoint location must be a path or URL, not int 5$"):
        NVMeReader(5)
    with pytest.raises(InvalidInputError, match="^a checkpoint directory must be a path, not int 5$"):
        NVMeWriter(5)
