"""The fixed costs of reading and writing a checkpoint's tables: each footer parsed once per
read, small tables stored without a coder."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeWriter
from dcp_nvme.format import tables
from dcp_nvme.format.manifest import read_files, read_manifest
from dcp_nvme.format.tables import SMALL_TABLE, ChunkRecord, chunks_table, parse_chunks
from dcp_nvme.storage.local_dir import LocalStore


def test_each_table_footer_is_parsed_once(tmp_path, monkeypatch):
    path = tmp_path / "c"
    dcp.save({"w": torch.randn(1000), "step": 3}, storage_writer=NVMeWriter(path), no_dist=True)
    parsed = []
    real = pq.ParquetFile
    monkeypatch.setattr(tables.pq, "ParquetFile", lambda *a, **kw: parsed.append(1) or real(*a, **kw))
    store = LocalStore(path)
    manifest = read_manifest(store, str(path))
    assert len(parsed) == 1  # the index: its row count, its bounds and its read share one parse
    read_files(store, manifest, str(path))
    assert len(parsed) == 2  # the blocks table likewise


def _rows(count: int) -> list[ChunkRecord]:
    return [ChunkRecord(f"model.t{i:06d}", "tensor", (0,), (256,), (256,), "float32",
                        "rank_00000.ab.safetensors", 4096 + 1024 * i, 1024, f"model.t{i:06d}") for i in range(count)]


@pytest.mark.parametrize("count,coded", [(9, False), (2000, True)])
def test_small_tables_are_stored_without_a_coder(count, coded):
    data = chunks_table(_rows(count))
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    kinds = {meta.row_group(g).column(c).compression for g in range(meta.num_row_groups)
             for c in range(meta.num_columns)}
    assert kinds == ({"ZSTD"} if coded else {"UNCOMPRESSED"}), (count, kinds, SMALL_TABLE)
    assert parse_chunks(data, max_rows=count) == _rows(count)  # read back alike either way


def test_a_small_index_is_checked_row_by_row_and_a_large_one_by_the_screens(monkeypatch):
    from dcp_nvme.format import column_checks
    from dcp_nvme.format.columns import ChunkColumns
    from dcp_nvme.format.tables import read_chunk_table

    screened = []
    real = column_checks._Screen
    monkeypatch.setattr(column_checks, "_Screen", lambda *a: screened.append(1) or real(*a))
    for count, screens in ((column_checks.SMALL_INDEX, 0), (column_checks.SMALL_INDEX + 1, 1)):
        rows = _rows(count)
        doc = {"save_key": "ab", "files": [{"name": "rank_00000.ab.safetensors", "rank": 0, "size": 1 << 24}]}
        cols = ChunkColumns.from_table(read_chunk_table(chunks_table(rows), "index", count))
        column_checks.check_columns(cols, doc, "index")
        assert len(screened) == screens
        bad = _rows(count)
        bad[3] = ChunkRecord(*[*vars(bad[3]).values()][:8], 12, bad[3].key)  # a length that is not 256 x 4
        cols = ChunkColumns.from_table(read_chunk_table(chunks_table(bad), "index", count))
        with pytest.raises(Exception, match="model.t000003"):
            column_checks.check_columns(cols, doc, "index")
        screened.clear()
