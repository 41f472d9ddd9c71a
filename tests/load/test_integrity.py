"""Corruption and truncation are caught on load and named precisely."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.hostile_kit import doc_of, reseal
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import ChecksumMismatchError, NVMeReader, NVMeWriter
from dcp_nvme.errors import ManifestError
from dcp_nvme.format.container import MANIFEST
from dcp_nvme.format.manifest import read_manifest
from dcp_nvme.storage.local_dir import LocalStore


@pytest.fixture
def checkpoint(tmp_path):
    state = {"alpha": torch.randn(300_000), "beta": torch.randn(500, 300), "gamma": torch.arange(10)}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=NVMeWriter(path), no_dist=True)
    return path, state


def _dest(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _chunk(path, fqn):
    return next(c for c in read_manifest(LocalStore(path), str(path)).chunks if c.fqn == fqn)


def _flip(path, name, offset):
    with open(path / name, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))


def test_flipped_byte_names_file_item_and_range(checkpoint):
    path, state = checkpoint
    beta = _chunk(path, "beta")
    _flip(path, beta.file, beta.byte_offset + 1234)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_dest(state), storage_reader=NVMeReader(path), no_dist=True)
    message = str(info.value)
    assert "checksum mismatch" in message and beta.file in message and "beta" in message
    error = next(f[0] for f in info.value.failures.values())
    assert isinstance(error, ChecksumMismatchError)
    assert error.start <= beta.byte_offset + 1234 < error.end


def test_corruption_in_an_item_not_loaded_does_not_fail_a_partial_load(checkpoint):
    path, state = checkpoint
    alpha = _chunk(path, "alpha")
    _flip(path, alpha.file, alpha.byte_offset + 100)
    dest = {"gamma": torch.zeros(10, dtype=torch.int64)}
    dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True)
    assert torch.equal(dest["gamma"], state["gamma"])


def test_verify_off_reads_corrupt_bytes_silently(checkpoint):
    path, state = checkpoint
    gamma = _chunk(path, "gamma")
    _flip(path, gamma.file, gamma.byte_offset)
    dest = _dest(state)
    dcp.load(dest, storage_reader=NVMeReader(path, verify=False), no_dist=True)
    assert not torch.equal(dest["gamma"], state["gamma"])  # which is why verify is on by default


def test_truncated_container_is_reported(checkpoint):
    path, state = checkpoint
    beta = _chunk(path, "beta")
    os.truncate(path / beta.file, beta.byte_offset + 100)
    with pytest.raises(CheckpointException, match="truncated"):
        dcp.load(_dest(state), storage_reader=NVMeReader(path), no_dist=True)


@pytest.mark.parametrize("table", ["index", "blocks"])
def test_corrupt_tables_are_refused(checkpoint, table):
    path, state = checkpoint
    doc = json.loads((path / MANIFEST).read_text())
    _flip(path, doc[table]["name"], 50)
    with pytest.raises((ManifestError, CheckpointException), match="corrupt"):
        dcp.load(_dest(state), storage_reader=NVMeReader(path), no_dist=True)


def test_garbled_manifest_is_refused(checkpoint):
    path, _ = checkpoint
    (path / MANIFEST).write_text('{"format": "dcp_nvme", "format_ver')
    with pytest.raises(ManifestError, match="not valid JSON"):
        NVMeReader(path).read_metadata()


def _with_format_version(path, version) -> None:
    """The checkpoint's manifest rewritten with ``version``, resealed (its own crc still holds)."""
    doc = doc_of(path)
    doc["format_version"] = version
    reseal(path, doc)


def test_newer_format_version_asks_for_an_upgrade(checkpoint):
    path, _ = checkpoint
    _with_format_version(path, 99)
    with pytest.raises(ManifestError, match="upgrade dcp_nvme"):
        NVMeReader(path).read_metadata()


@pytest.mark.parametrize("version", [0, -1, True, "2", 2.0, None])
def test_nonsense_format_version_is_refused(checkpoint, version):
    path, _ = checkpoint
    _with_format_version(path, version)
    with pytest.raises(ManifestError, match="format version .* damaged"):
        NVMeReader(path).read_metadata()


def test_format_version_1_checkpoints_still_load(checkpoint):
    """Version 2 only added padding entries; a version-1 manifest (no pads) loads as before."""
    path, state = checkpoint
    _with_format_version(path, 1)
    dest = _dest(state)
    dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True)
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_no_pickle_on_the_load_path(checkpoint, monkeypatch):
    """The storage layer never unpickles: loading tensors works with pickle disabled."""
    import pickle

    path, state = checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("pickle.loads called on the load path")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    reader = NVMeReader(path)
    metadata = reader.read_metadata()
    assert set(metadata.state_dict_metadata) == set(state)
    dest = _dest(state)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_edited_manifest_fails_its_own_checksum(checkpoint):
    path, _ = checkpoint
    doc = json.loads((path / MANIFEST).read_text())
    doc["config"]["queue_depth"] += 1  # a field nothing else cross-checks
    (path / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="fails its own checksum"):
        NVMeReader(path).read_metadata()
