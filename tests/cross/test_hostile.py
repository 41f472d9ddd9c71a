"""Checkpoints forged by a hostile author: every name and number in them is refused before use.

Each attack re-seals whatever checksum protects what it edits (tables in the manifest, the
manifest's own crc, a container's header_crc), so only validation stands in the way."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.hostile_kit import (
    chunks_of,
    doc_of,
    files_of,
    peak_rss_mib,
    reseal,
    rewrite_header,
    sample_state,
    save,
    within,
    write_blocks,
    write_index,
)
from torch.distributed.checkpoint.api import CheckpointException

from dcp_nvme import NVMeReader
from dcp_nvme.errors import DCPNVMeError, ManifestError, UnsupportedItemError
from dcp_nvme.format.manifest import read_manifest
from dcp_nvme.format.tables import ChunkRecord
from dcp_nvme.format.validation import check_chunks
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.tools import export_hf, inspect_checkpoint, list_checkpoints, verify_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save(tmp_path / "run" / "step_1", sample_state())


def load_failure(path: Path) -> BaseException:
    """The error a default load of ``path`` fails with (within 30 s): a dcp_nvme error, or
    DCP's wrapping of one raised while it read the metadata."""
    dest = {k: torch.zeros_like(v) for k, v in sample_state().items()}
    with pytest.raises(CheckpointException) as info:
        within(30, lambda: dcp.load(dest, storage_reader=NVMeReader(path), no_dist=True))
    error = next(iter(info.value.failures.values()))
    error = error[0] if isinstance(error, tuple) else error
    assert isinstance(error, DCPNVMeError) or "metadata read failed" in str(error), repr(error)
    return error


def load_error(path: Path) -> str:
    return str(load_failure(path))


def verify_problems(path: Path) -> list[str]:
    report = within(30, lambda: verify_checkpoint(path))
    assert not report.ok
    return [str(p) for p in report.problems]


# --------------------------------------------------------------------------- names


OUTSIDE_NAMES = ["/etc/passwd", "../secret.safetensors", "/dev/zero", "sub/rank_00000.{key}.safetensors",
                 "rank_00000.{key}.safetensors/..", "..", "rank_00000.{other}.safetensors"]


@pytest.mark.parametrize("bad", OUTSIDE_NAMES)
def test_data_file_names_outside_the_checkpoint_are_refused(ckpt: Path, bad: str):
    secret = ckpt.parent / "secret.safetensors"
    secret.write_bytes(ckpt.joinpath(files_of(ckpt)[0].name).read_bytes())  # a valid file outside
    doc = doc_of(ckpt)
    name = bad.format(key=doc["save_key"], other="0" * 8)
    chunks = [replace(c, file=name) for c in chunks_of(ckpt)]
    doc["files"][0]["name"] = name
    write_index(ckpt, chunks, doc)
    with pytest.raises(ManifestError, match="not of the form"):
        read_manifest(LocalStore(ckpt), str(ckpt))
    assert "not of the form" in str(load_error(ckpt))
    assert any("not of the form" in p for p in verify_problems(ckpt))
    assert list_checkpoints(ckpt.parent)[0].state == "corrupt"


@pytest.mark.parametrize("table", ["index", "blocks"])
def test_table_names_outside_the_checkpoint_are_refused(ckpt: Path, table: str):
    doc = doc_of(ckpt)
    doc[table]["name"] = "/dev/zero"
    reseal(ckpt, doc)
    with pytest.raises(ManifestError, match="not of the form"):
        within(10, lambda: read_manifest(LocalStore(ckpt), str(ckpt)))
    assert list_checkpoints(ckpt.parent)[0].state == "corrupt"


def test_drain_never_writes_outside_its_target(ckpt: Path, tmp_path: Path):
    from dcp_nvme.errors import DrainError
    from dcp_nvme.tiers import DrainOptions, drain

    doc = doc_of(ckpt)
    escape = "../../escaped.safetensors"
    real = files_of(ckpt)[0].name
    os.makedirs(tmp_path / "x" / "y", exist_ok=True)
    doc["files"][0]["name"] = escape
    write_index(ckpt, [replace(c, file=escape) for c in chunks_of(ckpt)], doc)
    target = tmp_path / "x" / "y" / "mirror"
    with pytest.raises((DrainError, DCPNVMeError), match="not of the form"):
        within(30, lambda: drain(ckpt, str(target), options=DrainOptions(retries=0)))
    assert not (tmp_path / "x" / "escaped.safetensors").exists()
    assert not list(tmp_path.rglob("escaped.safetensors"))
    assert (ckpt / real).exists()


def test_fifo_as_data_file_fails_load_instead_of_hanging(ckpt: Path):
    name = files_of(ckpt)[0].name
    os.unlink(ckpt / name)
    os.mkfifo(ckpt / name)
    assert "FIFO" in str(load_error(ckpt))
    assert any("FIFO" in p for p in verify_problems(ckpt))
    entry = within(30, lambda: list_checkpoints(ckpt.parent))[0]
    assert entry.state == "damaged" and "FIFO" in entry.reason


@pytest.mark.parametrize("table", ["index", "blocks"])
def test_fifo_as_table_fails_list_and_inspect_instead_of_hanging(ckpt: Path, table: str):
    name = doc_of(ckpt)[table]["name"]
    os.unlink(ckpt / name)
    os.mkfifo(ckpt / name)
    entry = within(30, lambda: list_checkpoints(ckpt.parent))[0]
    inspected = within(30, lambda: inspect_checkpoint(ckpt))
    if table == "index":
        assert entry.state == "corrupt" and "FIFO" in entry.reason
        assert inspected.state == "corrupt" and "FIFO" in inspected.reason
    assert any("FIFO" in p for p in verify_problems(ckpt))


def test_symlink_to_dev_zero_under_a_valid_name_is_refused(ckpt: Path):
    name = doc_of(ckpt)["index"]["name"]
    os.unlink(ckpt / name)
    os.symlink("/dev/zero", ckpt / name)
    entry = within(30, lambda: list_checkpoints(ckpt.parent))[0]
    assert entry.state == "corrupt" and "symbolic link" in entry.reason


# --------------------------------------------------------------------------- numbers


def test_sparse_rank_file_claiming_a_huge_header_is_refused_with_bounded_memory(tmp_path: Path):
    path = tmp_path / "partial"
    path.mkdir()
    name = "rank_00000.0badc0de.safetensors"
    with open(path / name, "wb") as handle:  # 1.1 GiB sparse, the header "fills" it
        handle.write((1_100_000_000).to_bytes(8, "little"))
        handle.truncate(1_100_000_100)
    code = ("from dcp_nvme.tools import inspect_checkpoint\n"
            f"r = inspect_checkpoint({str(path)!r})\nprint('ERR', r.partial[{name!r}]['error'])")
    peak, out = peak_rss_mib(code)
    assert "more than the 100000000 allowed" in out
    small = tmp_path / "small"
    small.mkdir()
    (small / name).write_bytes((16).to_bytes(8, "little") + b"{}" + b" " * 14)
    baseline, out = peak_rss_mib("from dcp_nvme.tools import inspect_checkpoint\n"
                                 f"print(inspect_checkpoint({str(small)!r}).partial)")
    assert "'items': 0" in out
    assert peak < baseline + 64, (peak, baseline)


def test_index_bomb_is_refused_before_it_is_materialised(ckpt: Path):
    chunks = chunks_of(ckpt)
    bomb = [replace(chunks[0], key=f"k{i}", fqn=f"t{i}") for i in range(200_000)]
    write_index(ckpt, bomb)
    assert (ckpt / doc_of(ckpt)["index"]["name"]).stat().st_size < 2_000_000  # small on disk
    code = ("from dcp_nvme.tools import list_checkpoints\n"
            f"e = list_checkpoints({str(ckpt.parent)!r})[0]\nprint('STATE', e.state, e.reason)")
    peak, out = peak_rss_mib(code)
    assert "STATE corrupt" in out and "declares 200000 rows" in out
    verify_peak, out = peak_rss_mib("from dcp_nvme.tools import verify_checkpoint\n"
                                    f"print('PROBLEMS', verify_checkpoint({str(ckpt)!r}).problems)")
    assert "declares 200000 rows" in out
    baseline, _ = peak_rss_mib("from dcp_nvme.tools import list_checkpoints\n"
                               f"list_checkpoints({str(ckpt.parent)!r})")
    assert peak < baseline + 32 and verify_peak < baseline + 32, (peak, verify_peak, baseline)


@pytest.mark.parametrize("block", [0, -4096, 1 << 40, 100, 262145, 16 << 20])
def test_insane_checksum_block_is_refused_by_verify_and_load(ckpt: Path, block: int):
    write_blocks(ckpt, [replace(f, checksum_block=block) for f in files_of(ckpt)])
    problems = verify_problems(ckpt)
    assert any("checksum_block" in p for p in problems), problems
    assert "checksum_block" in str(load_error(ckpt))  # never a silently unverified load


@pytest.mark.parametrize("start", [1 << 40, 4, -1])
def test_data_start_outside_the_file_is_refused(ckpt: Path, start: int):
    write_blocks(ckpt, [replace(f, data_start=start) for f in files_of(ckpt)])
    assert any("data_start" in p for p in verify_problems(ckpt))
    assert "data_start" in str(load_error(ckpt))


def test_negative_block_cannot_turn_verification_off(ckpt: Path):
    record = files_of(ckpt)[0]
    a = next(c for c in chunks_of(ckpt) if c.fqn == "a")
    with open(ckpt / record.name, "r+b") as handle:  # corrupt a byte of "a"
        handle.seek(a.byte_offset)
        byte = handle.read(1)
        handle.seek(a.byte_offset)
        handle.write(bytes([byte[0] ^ 1]))
    write_blocks(ckpt, [replace(record, checksum_block=-1, crcs=())])
    assert isinstance(load_failure(ckpt), ManifestError)


def _lie(ckpt: Path, fqn: str, **changes) -> None:
    write_index(ckpt, [replace(c, **changes) if c.fqn == fqn else c for c in chunks_of(ckpt)])


def test_dtype_lie_is_caught_by_load_and_verify(ckpt: Path):
    _lie(ckpt, "i", dtype="float32")  # same bytes, reinterpreted: only the header can tell
    assert "disagree" in str(load_error(ckpt)) and "'i'" in str(load_error(ckpt))
    problems = verify_problems(ckpt)
    assert any("'i'" in p and "I32" in p for p in problems), problems


def test_shape_longer_than_its_bytes_is_caught(ckpt: Path):
    a = next(c for c in chunks_of(ckpt) if c.fqn == "a")
    _lie(ckpt, "a", sizes=(128, 32), global_shape=(128, 32), length=a.length * 2)
    error = str(load_error(ckpt))
    assert "share bytes" in error or "outside" in error
    assert verify_problems(ckpt)


def test_shape_lie_with_its_true_length_is_caught(ckpt: Path):
    _lie(ckpt, "a", sizes=(128, 32), global_shape=(128, 32))
    assert "is not [128, 32] x 4 bytes" in str(load_error(ckpt))


def test_swapped_offsets_are_caught_by_the_header(ckpt: Path):
    chunks = chunks_of(ckpt)
    a = next(c for c in chunks if c.fqn == "a")
    b = next(c for c in chunks if c.fqn == "b")
    write_index(ckpt, [replace(c, byte_offset=b.byte_offset) if c.fqn == "a" else
                       replace(c, byte_offset=a.byte_offset) if c.fqn == "b" else c for c in chunks])
    error = str(load_error(ckpt))
    assert "disagree" in error and "safetensors header says bytes" in error
    assert any("safetensors header says bytes" in p for p in verify_problems(ckpt))


def test_overlapping_chunks_are_refused(ckpt: Path):
    b = next(c for c in chunks_of(ckpt) if c.fqn == "b")
    _lie(ckpt, "a", byte_offset=b.byte_offset + 4)
    assert "share bytes" in str(load_error(ckpt))


def test_consistent_header_and_index_lie_still_cannot_reach_outside(ckpt: Path):
    """Header and index re-forged together: the data region bounds still hold."""
    record = files_of(ckpt)[0]
    chunks = chunks_of(ckpt)
    _lie(ckpt, "h", byte_offset=record.size - 10)
    assert "outside" in str(load_error(ckpt)) or "share bytes" in str(load_error(ckpt))
    del chunks


def test_forged_header_is_caught_even_with_its_crc_resealed(ckpt: Path):
    def swap(header: dict) -> None:
        header["i"]["dtype"] = "F32"

    rewrite_header(ckpt, files_of(ckpt)[0].name, swap)
    assert "disagree" in str(load_error(ckpt))
    assert any("'i'" in p for p in verify_problems(ckpt))


def test_tensor_with_a_hole_is_refused_so_export_cannot_write_uninitialised_memory(tmp_path: Path):
    from torch.distributed.checkpoint.planner import SavePlan  # noqa: F401  (DCP present)

    ckpt = save(tmp_path / "c", {"w": torch.randn(8, 4)})
    (chunk,) = chunks_of(ckpt)
    # the forged index says "w" is 16 x 4 stored as two chunks, the second the first again
    twin = replace(chunk, key="w@8,0", offsets=(8, 0), byte_offset=chunk.byte_offset)
    write_index(ckpt, [replace(chunk, global_shape=(16, 4)), replace(twin, global_shape=(16, 4))])
    with pytest.raises(ManifestError, match="share bytes"):
        export_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # and a hole without shared bytes: the tiling check
    write_index(ckpt, [replace(chunk, global_shape=(16, 4))])
    with pytest.raises(ManifestError, match="hold 32 of 64 elements"):
        export_hf(ckpt, tmp_path / "out")


def test_check_chunks_finds_overlap_in_tensor_space():
    doc = {"save_key": "ab", "files": [{"name": "rank_00000.ab.safetensors", "size": 10_000, "rank": 0}]}
    file = "rank_00000.ab.safetensors"
    rows = [ChunkRecord("w", "tensor", (0, 0), (4, 4), (4, 8), "float32", file, 4096, 64, "w"),
            ChunkRecord("w", "tensor", (0, 2), (4, 4), (4, 8), "float32", file, 4160, 64, "w@0,2")]
    with pytest.raises(ManifestError, match="overlap"):
        check_chunks(rows, doc, "t")
    rows[1] = replace(rows[1], offsets=(0, 4), key="w@0,4")
    check_chunks(rows, doc, "t")  # the two halves tile it


def test_manifest_numbers_are_checked(ckpt: Path):
    original = doc_of(ckpt)
    for field, value, words in [("world_size", 0, "world_size"), ("world_size", 10**9, "world_size"),
                                ("save_key", "../x", "save_key"), ("files", {"a": 1}, "files")]:
        doc = json.loads(json.dumps(original))
        doc[field] = value
        reseal(ckpt, doc)
        with pytest.raises(ManifestError, match=words):
            read_manifest(LocalStore(ckpt), str(ckpt))
    doc = json.loads(json.dumps(original))
    doc["index"]["size"] = 1 << 40
    reseal(ckpt, doc)
    with pytest.raises(ManifestError, match="size"):
        read_manifest(LocalStore(ckpt), str(ckpt))


def test_intact_checkpoint_still_loads_and_verifies(ckpt: Path):
    state = sample_state()
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=NVMeReader(ckpt), no_dist=True)
    assert all(torch.equal(dest[k], state[k]) for k in state)
    assert verify_checkpoint(ckpt).ok
    json.dumps(inspect_checkpoint(ckpt).to_dict())


@pytest.mark.parametrize("special", ["fifo", "zero"])
def test_special_manifest_fails_every_tool_instead_of_hanging(ckpt: Path, special: str):
    os.unlink(ckpt / "manifest.json")
    if special == "fifo":
        os.mkfifo(ckpt / "manifest.json")
    else:
        os.symlink("/dev/zero", ckpt / "manifest.json")
    words = "FIFO" if special == "fifo" else "symbolic link"
    entry = within(30, lambda: list_checkpoints(ckpt.parent))[0]
    assert entry.state == "corrupt" and words in entry.reason
    assert within(30, lambda: inspect_checkpoint(ckpt)).state == "corrupt"
    assert any(words in p for p in verify_problems(ckpt))
    assert words in load_error(ckpt)


def test_fifo_data_file_fails_a_drain_instead_of_hanging(ckpt: Path, tmp_path: Path):
    from dcp_nvme.tiers import DrainOptions, drain

    name = files_of(ckpt)[0].name
    os.unlink(ckpt / name)
    os.mkfifo(ckpt / name)
    with pytest.raises(Exception, match="FIFO"):
        within(30, lambda: drain(ckpt, str(tmp_path / "mirror"), options=DrainOptions(retries=0)))


def test_fsspec_store_opens_regular_files_only(ckpt: Path):
    import fsspec

    from dcp_nvme.storage.fsspec_dir import FsspecStore

    os.mkfifo(ckpt / "rank_00001.00000000.safetensors")
    store = FsspecStore(str(ckpt), fs=fsspec.filesystem("file"))
    with pytest.raises(ManifestError, match="not a regular file"):
        within(10, lambda: store.read("rank_00001.00000000.safetensors"))
    with pytest.raises(ManifestError, match="more than the 10"):
        store.read("manifest.json", max_size=10)
    with pytest.raises(ManifestError, match="not a file name inside"):
        store.path("../manifest.json")


# --------------------------------------------------------------------------- names a save cannot store


@pytest.mark.parametrize("name", ["", "__metadata__", "__pad__.0"])
@pytest.mark.parametrize("value", [torch.arange(4.0), 7], ids=["tensor", "object"])
def test_a_name_the_container_cannot_hold_fails_the_save_before_any_byte(tmp_path: Path, name: str, value):
    """A save that committed such a name could never be loaded: it is refused in write_data,
    before the container is written, so DCP fails the save and nothing is committed."""
    path = tmp_path / "c"
    with pytest.raises(CheckpointException) as info:
        save(path, {name: value, "w": torch.ones(3)})
    error = next(iter(info.value.failures.values()))
    error = error[0] if isinstance(error, tuple) else error
    assert isinstance(error, UnsupportedItemError), repr(error)
    assert repr(name) in str(error) and "rename" in str(error)
    assert not (path / "manifest.json").exists()
    assert not list(path.glob("*.safetensors")) and not list(path.glob("*.tmp-*"))
    save(path, {"renamed": value, "w": torch.ones(3)})  # the lock was released: a fixed save commits
    assert (path / "manifest.json").exists()
