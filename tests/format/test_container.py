"""The on-disk format module: dtype table, header codec, names."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from dcp_nvme import NVMeReader, NVMeWriter
from dcp_nvme.errors import ManifestError
from dcp_nvme.format.container import (
    DTYPE_ALIASES,
    DTYPE_ITEMSIZE,
    MAX_HEADER,
    NEWER_DTYPES,
    ST_DTYPES,
    build_header,
    check_name,
    dtype_itemsize,
    header_length,
    parse_dtype,
    parse_header,
    save_key_of,
    stored_as,
)


def test_dtype_table_is_safetensors_own():
    """Every name means in safetensors what it means here (fnuz float8 included: safetensors
    0.8 maps F8_E4M3FNUZ / F8_E5M2FNUZ), and nothing safetensors maps is missing."""
    theirs = {name: dtype for name, dtype in safetensors.torch._TYPES.items() if dtype is not None}
    assert {name: dtype for dtype, name in ST_DTYPES.items()} == theirs


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e4m3fn,
                                   torch.bfloat16, torch.complex64])
def test_containers_open_in_safetensors_with_the_real_dtype(tmp_path, dtype):
    tensor = torch.randn(16, 8).to(dtype)
    dcp.save({"t": tensor}, storage_writer=NVMeWriter(tmp_path / "c"), no_dist=True)
    (container,) = (tmp_path / "c").glob("rank_*.safetensors")
    with safe_open(str(container), "pt") as handle:
        got = handle.get_tensor("t")
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    dest = {"t": torch.zeros_like(tensor)}
    dcp.load(dest, storage_reader=NVMeReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(dest["t"].view(torch.uint8), tensor.view(torch.uint8))


def test_dtype_tables_hold_every_torch_dtype():
    """The tools check an index by dtype name without importing torch: the static tables must
    be torch's own, every dtype and every other name of one, of each release the suite runs on."""
    dtypes = {name: value for name in dir(torch) if isinstance(value := getattr(torch, name), torch.dtype)}
    canonical = {str(d).removeprefix("torch."): d.itemsize for d in dtypes.values()}
    installed = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    later = {name for name, release in NEWER_DTYPES.items()
             if tuple(int(p) for p in release.split(".")) > installed}
    assert {name: size for name, size in DTYPE_ITEMSIZE.items() if name not in later} == canonical
    assert not later & set(dtypes)
    assert DTYPE_ALIASES == {name: str(d).removeprefix("torch.") for name, d in dtypes.items()
                             if str(d).removeprefix("torch.") != name}
    for name in dtypes:
        assert dtype_itemsize(name) == parse_dtype(name).itemsize
        assert stored_as(name, (3,), 3 * dtypes[name].itemsize) == stored_as(dtypes[name], (3,), 3 * dtypes[name].itemsize)
    with pytest.raises(ManifestError, match="unknown dtype"):
        dtype_itemsize("nn")


@pytest.mark.parametrize("name,release", sorted(NEWER_DTYPES.items()))
def test_a_dtype_of_a_later_torch_is_sized_by_name_and_refused_by_name(name, release):
    """A dtype a later torch added (an index written there): the tools size it without torch, and
    a torch without it refuses it naming the dtype and the release to load it with."""
    assert dtype_itemsize(name, "tensor 'w'") == DTYPE_ITEMSIZE[name]
    assert stored_as(name, (3,), 3 * DTYPE_ITEMSIZE[name]) == ("U8", (3 * DTYPE_ITEMSIZE[name],))
    if hasattr(torch, name):
        assert parse_dtype(name).itemsize == DTYPE_ITEMSIZE[name]
        return
    with pytest.raises(ManifestError, match=rf"^tensor 'w': dtype '{name}' is new in torch {release} and this is "
                                            rf"torch .*: load it with torch {release} or newer$"):
        parse_dtype(name, "tensor 'w'")


def test_every_dtype_torch_makes_round_trips_bitwise(tmp_path):
    """Each dtype of the installed torch that it can make, view as bytes and save with DCP is saved
    and loaded back bit for bit, one container for all."""
    state = {}
    for name in sorted(DTYPE_ITEMSIZE):
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        try:
            value = torch.arange(32, dtype=torch.uint8).view(dtype).reshape(2, -1)
            # DCP's planner sizes an item with finfo/iinfo: qint and bits dtypes fail there in stock torch
            if dtype != torch.bool:
                (torch.finfo if dtype.is_floating_point or dtype.is_complex else torch.iinfo)(dtype)
        except (RuntimeError, TypeError):
            continue
        state[name] = value
    assert {"bfloat16", "complex32", "complex128", "float8_e8m0fnu", "float4_e2m1fn_x2", "int64"} <= set(state)
    if hasattr(torch, "bcomplex32"):
        assert "bcomplex32" in state
    dcp.save(state, storage_writer=NVMeWriter(tmp_path / "c"), no_dist=True)
    dest = {name: torch.zeros(32, dtype=torch.uint8).view(value.dtype).reshape(2, -1) for name, value in state.items()}
    dcp.load(dest, storage_reader=NVMeReader(tmp_path / "c"), no_dist=True)
    for name, value in state.items():
        assert dest[name].dtype == value.dtype and torch.equal(dest[name].view(torch.uint8),
                                                                value.view(torch.uint8)), name


def test_dtypes_safetensors_lacks_are_raw_bytes():
    assert stored_as(torch.complex32, (4, 2), 32) == ("U8", (32,))
    assert stored_as(torch.float8_e8m0fnu, (3,), 3) == ("U8", (3,))
    assert stored_as(torch.float32, (4, 2), 32) == ("F32", (4, 2))


@pytest.mark.parametrize("alignment", [8, 4096])
def test_header_round_trips_and_aligns(alignment):
    items = [("a", "F32", (2, 3), 24), ("b", "U8", (5,), 5), ("e", "BF16", (0,), 0)]
    header, offsets = build_header(items, {"format": "x"}, alignment)
    assert len(header) % alignment == 0 and offsets == [0, 24, 29]
    metadata, parsed, data_start = parse_header(header, "f")
    assert metadata == {"format": "x"} and data_start == len(header)
    assert [(i.key, i.st_dtype, i.shape, i.start, i.end) for i in parsed] == [
        ("a", "F32", (2, 3), 0, 24), ("b", "U8", (5,), 24, 29), ("e", "BF16", (0,), 29, 29)]
    assert safetensors.torch.load(header + bytes(29))["a"].shape == (2, 3)  # safetensors agrees


def _header(entries: dict) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text + bytes(64)


@pytest.mark.parametrize("entry, words", [
    ({"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}, "malformed"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "malformed"),
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "malformed"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}, "malformed"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "is not the 4 bytes"),
    ({"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}, "malformed"),
    ("text", "malformed"),
])
def test_bad_header_entries_are_named(entry, words):
    with pytest.raises(ManifestError, match=f"f: item 'x'.*{words}|{words}"):
        parse_header(_header({"x": entry}), "f")


def test_overlapping_header_items_are_refused():
    entries = {"x": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
               "y": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}}
    with pytest.raises(ManifestError, match="overlaps"):
        parse_header(_header(entries), "f")


def test_header_length_is_capped_and_checked_against_the_file():
    assert header_length(struct.pack("<Q", 100), 200, "f") == 100
    with pytest.raises(ManifestError, match="more than the"):
        header_length(struct.pack("<Q", MAX_HEADER + 1), 1 << 40, "f")
    with pytest.raises(ManifestError, match="but the file has"):
        header_length(struct.pack("<Q", 1000), 500, "f")
    with pytest.raises(ManifestError, match="too short"):
        header_length(b"\x01\x02", 2, "f")


@pytest.mark.parametrize("name, kind", [
    ("rank_00003.ab12.safetensors", "data"), ("rank_123456.ab12.safetensors", "data"),
    ("index.ab12.parquet", "index"), ("blocks.ab12.parquet", "blocks")])
def test_names_of_our_form_pass(name, kind):
    assert check_name(name, kind, "ab12", "w") == name
    assert save_key_of(name) == "ab12"


@pytest.mark.parametrize("name, kind", [
    ("/etc/passwd", "data"), ("../rank_00000.ab12.safetensors", "data"), ("rank_00000.ab12.safetensors/", "data"),
    ("rank_00000.cd34.safetensors", "data"), ("index.ab12.parquet", "blocks"), ("..", "index"),
    ("rank_0.ab12.safetensors", "data"), ("rank_00000.ab12.safetensors\x00", "data"), (7, "data"),
    ("/abs/index.ab12.parquet", "index"), ("blocks.ab12.parquet.tmp", "blocks")])
def test_names_outside_our_form_are_refused(name, kind):
    with pytest.raises(ManifestError, match="w: "):
        check_name(name, kind, "ab12", "w")
