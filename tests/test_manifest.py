import pytest
import torch

from dcp_nvme.errors import ManifestError
from dcp_nvme.manifest import (
    ChunkRecord,
    FileRecord,
    chunks_table,
    decode_json,
    encode_json,
    files_table,
    parse_chunks,
    parse_dtype,
    parse_files,
    save_key_of,
)


def test_planner_data_round_trips_tuples_and_ints():
    data = {"model.layers.0.weight": ("model", "layers", 0, "weight"), "x": [1, (2, "a")], "n": None}
    encoded = encode_json(data)
    assert decode_json(encoded) == data
    assert isinstance(decode_json(encoded)["model.layers.0.weight"], tuple)


@pytest.mark.parametrize("bad", [{1: "int key"}, {"k": object()}, {"k": {1, 2}}])
def test_planner_data_that_needs_pickle_is_an_error(bad):
    with pytest.raises(ValueError):
        encode_json(bad)


def test_tables_round_trip():
    chunks = [
        ChunkRecord("a", "tensor", (0, 4), (2, 4), (2, 8), "bfloat16", "rank_00000.ab.safetensors", 4096, 16, "a@0,4"),
        ChunkRecord("b", "bytes", (), (), (), "uint8", "rank_00000.ab.safetensors", 4112, 7, "b"),
    ]
    assert parse_chunks(chunks_table(chunks)) == chunks
    files = [FileRecord("rank_00000.ab.safetensors", 0, 4119, 4096, 1 << 20, 123, (4294967295, 1))]
    assert parse_files(files_table(files)) == {files[0].name: files[0]}


def test_garbage_table_is_a_manifest_error():
    with pytest.raises(ManifestError, match="not a readable Parquet"):
        parse_chunks(b"definitely not parquet")


def test_dtype_names_never_eval():
    assert parse_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    with pytest.raises(ManifestError):
        parse_dtype("__import__('os').system('true')")
    with pytest.raises(ManifestError):
        parse_dtype("nn")  # an attribute of torch that is not a dtype


def test_save_key_of_recognises_only_our_files():
    assert save_key_of("rank_00003.deadbeef.safetensors") == "deadbeef"
    assert save_key_of("index.deadbeef.parquet") == "deadbeef"
    assert save_key_of("manifest.json") is None
    assert save_key_of("model.safetensors") is None
