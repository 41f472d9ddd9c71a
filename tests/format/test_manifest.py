import pytest
import torch

from dcp_nvme.errors import ManifestError
from dcp_nvme.format.container import parse_dtype, save_key_of
from dcp_nvme.format.manifest import decode_json, encode_json
from dcp_nvme.format.tables import (
    ChunkRecord,
    FileRecord,
    chunks_table,
    files_table,
    parse_chunks,
    parse_files,
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


def _chunk(i: int) -> ChunkRecord:
    return ChunkRecord(f"t{i}", "tensor", (0,), (4,), (4,), "float32", "rank_00000.ab.safetensors",
                       4096 + 16 * i, 16, f"t{i}")


def test_row_count_is_checked_from_the_footer_before_reading():
    data = chunks_table([_chunk(i) for i in range(50)])
    assert len(parse_chunks(data, max_rows=50)) == 50
    with pytest.raises(ManifestError, match="declares 50 rows, more than the 49"):
        parse_chunks(data, max_rows=49)


def test_table_with_wrong_types_or_nulls_is_refused():
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = pq.read_table(pa.BufferReader(chunks_table([_chunk(0)])))
    sink = pa.BufferOutputStream()
    pq.write_table(good.set_column(good.schema.get_field_index("length"), "length", pa.array(["16"])), sink)
    with pytest.raises(ManifestError, match="column length is string"):
        parse_chunks(sink.getvalue().to_pybytes())
    sink = pa.BufferOutputStream()
    offsets = pa.array([[None]], type=pa.list_(pa.int64()))
    pq.write_table(good.set_column(good.schema.get_field_index("chunk_offsets"), "chunk_offsets", offsets), sink)
    with pytest.raises(ManifestError, match="chunk_offsets has 1 empty"):
        parse_chunks(sink.getvalue().to_pybytes())


def test_crc_count_is_bounded_before_reading():
    files = [FileRecord("rank_00000.ab.safetensors", 0, 4096 + 4096 * 300, 4096, 4096, 1, (7,) * 300)]
    assert parse_files(files_table(files), max_rows=1, max_crcs=300)
    with pytest.raises(ManifestError, match="crcs declares 300 values"):
        parse_files(files_table(files), max_rows=1, max_crcs=299)
