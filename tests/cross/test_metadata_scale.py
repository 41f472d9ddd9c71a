"""Metadata at many ranks: the scale bench at small N, the work that must not grow with the world
size (file stats, tiling comparisons), the columnar checks agreeing with the row-by-row ones, and
NVMeLoadPlanner planning what DefaultLoadPlanner plans."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_nvme import NVMeLoadPlanner, NVMeReader
from dcp_nvme.errors import ManifestError
from dcp_nvme.format import column_checks, validation
from dcp_nvme.format.columns import ChunkColumns
from dcp_nvme.format.container import default_item_key
from dcp_nvme.format.tables import ChunkRecord, chunks_table, read_chunk_table


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "metadata_scale.py"
    spec = importlib.util.spec_from_file_location("metadata_scale", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["metadata_scale"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


def _save(tmp_path, world: int, layers: int = 1) -> str:
    directory = str(tmp_path / f"w{world}")
    os.makedirs(directory)
    BENCH.run_here("save", world, layers, directory, 0)
    return directory


def _items(plan) -> set:
    return {(i.dest_index.fqn, tuple(i.dest_index.offset), tuple(i.dest_offsets), tuple(i.storage_index.offset),
             tuple(i.storage_offsets), tuple(i.lengths)) for i in plan.items}


def _plan(planner, state, metadata):
    planner.original_state_dict = planner.state_dict = state
    planner.metadata, planner.is_coordinator, planner.mappings = metadata, False, {}
    return planner.create_local_plan()


def test_bench_runs_at_small_n_and_writes_json(tmp_path):
    out = tmp_path / "scale.json"
    assert BENCH.main(["--ranks", "2,8", "--layers", "1", "--in-process", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    tensors = len(BENCH.Model(layers=1).tensors())
    assert [p["ranks"] for p in doc["points"]] == [2, 8]
    for point in doc["points"]:
        assert point["rows"] == point["ranks"] * tensors
        # one rank's plan: the same number of reads with each planner, and with stock DCP's metadata
        assert point["nvme_planner_items"] == point["default_planner_items"] == point["stock_planner_items"]
        assert point["nvme_planner_items"] >= tensors
        assert point["stock_bytes"] > point["index_bytes"] > 0 and point["commit_s"] > 0
    assert doc["fitted"]["commit_cpu_s"] > 0
    assert doc["config"]["backed_memory_gib"] == 0 and doc["config"]["first_touch_s_per_gib"]["fresh"] > 0


def test_bench_backs_memory_before_each_step_when_asked(tmp_path, monkeypatch):
    """--backed-memory: a throw-away process touches that much before every measured step (a
    real save step here), the calibration is a real first touch; a negative amount is refused."""
    BENCH.back_memory(0.01)  # a real process touching 10 MiB
    assert BENCH.first_touch_s_per_gib(4) > 0
    touched = []
    monkeypatch.setattr(BENCH, "back_memory", touched.append)
    directory = tmp_path / "w2"
    directory.mkdir()
    point = BENCH.run_child("save", 2, 1, str(directory), 0, backed_gib=0.25)
    assert touched == [0.25] and point["rows"] == 2 * len(BENCH.Model(layers=1).tensors())
    with pytest.raises(SystemExit, match="backed-memory"):
        BENCH.main(["--ranks", "2", "--backed-memory", "-1"])


def test_read_metadata_stats_no_data_file_and_plans_as_the_default(tmp_path, monkeypatch):
    """The row bound comes from the manifest's declared sizes: reading the metadata of 4 or 32
    ranks makes the same few stat calls (none per container). Both planners plan the same reads
    for a rank's FSDP shards, on our lazy Metadata and on stock DCP's."""
    counts = {}
    real_stat, real_lstat = os.stat, os.lstat
    for world in (4, 32):
        directory = _save(tmp_path, world)
        calls: list = []

        def counted(real, calls=calls):
            return lambda *a, **k: calls.append(a[0]) or real(*a, **k)

        monkeypatch.setattr(os, "stat", counted(real_stat))
        monkeypatch.setattr(os, "lstat", counted(real_lstat))
        metadata = NVMeReader(directory).read_metadata()
        monkeypatch.setattr(os, "stat", real_stat)
        monkeypatch.setattr(os, "lstat", real_lstat)
        assert not [c for c in calls if str(c).endswith(".safetensors")]
        counts[world] = len(calls)
        state = BENCH.local_chunks(BENCH.Model(layers=1), world, world // 2)
        ours = _items(_plan(NVMeLoadPlanner(**BENCH.FLAT), state, metadata))
        assert metadata.state_dict_metadata["model.norm.weight"]._chunks is None  # no chunk list was made
        default = _items(_plan(DefaultLoadPlanner(**BENCH.FLAT), state, metadata))
        assert ours == default and len(ours) == len(state)
        # every planned read finds its row in storage_data (by the hint, and without it)
        for item in _plan(NVMeLoadPlanner(**BENCH.FLAT), state, metadata).items:
            record = metadata.storage_data[item.storage_index]
            assert record.fqn == item.storage_index.fqn and record.offsets == tuple(item.storage_index.offset)
    assert counts[4] == counts[32]


def test_interval_index_plans_a_2d_reshard_as_the_default():
    """Saved as a 4 x 3 grid (uneven, with an empty chunk), loaded as 3 x 2 shards plus an empty
    one: NVMeLoadPlanner over a stock Metadata gives DefaultLoadPlanner's reads."""
    shape = (10, 7)

    def grid(rows, cols):
        return [ChunkStorageMetadata(torch.Size((r0, c0)), torch.Size((r1 - r0, c1 - c0)))
                for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(cols, cols[1:])]

    saved = grid([0, 3, 5, 5, 10], [0, 2, 6, 7])
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(shape), saved)})
    for local in grid([0, 4, 7, 10], [0, 3, 7]) + [ChunkStorageMetadata(torch.Size((10, 0)), torch.Size((0, 7)))]:
        state = {"w": BENCH.FakeShard(torch.Size(shape), local)}
        ours = _items(_plan(NVMeLoadPlanner(**BENCH.FLAT), state, md))
        assert ours == _items(_plan(DefaultLoadPlanner(**BENCH.FLAT), state, md))
        covered = sum(torch.Size(i[5]).numel() for i in ours)
        assert covered == local.sizes.numel()


def test_the_shared_sweep_plans_what_each_tensor_sorting_its_own_plans():
    """Tensors of every kind in one index: cut along dim 0 in rank order (their sweep comes from
    the one pass over the columns), along dim 1, on a 2 x 2 grid, with rows out of start order,
    a 1-d one, with an empty chunk last or inside, a scalar. For boxes across each, NVMeLoadPlanner over our
    Metadata plans DefaultLoadPlanner's reads, and every planned read finds its row. (An empty
    chunk inside another's span has sorted starts and falling ends: no shared sweep for it.)"""
    from dcp_nvme.format.manifest import metadata_over
    from dcp_nvme.format.metadata_view import ChunkIndex

    file = "rank_00000.ab.safetensors"
    rows, at = [], [4096]

    def tensor(fqn, shape, boxes):
        for off, size in boxes:
            n = 4 * math.prod(size)
            rows.append(ChunkRecord(fqn, "tensor", off, size, shape, "float32", file, at[0], n,
                                    default_item_key(fqn, off)))
            at[0] += n

    tensor("dim0", (10, 3), [((0, 0), (4, 3)), ((4, 0), (4, 3)), ((8, 0), (2, 3))])
    tensor("dim1", (3, 9), [((0, 0), (3, 5)), ((0, 5), (3, 4))])
    tensor("grid", (4, 4), [((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)])
    tensor("unsorted", (6, 2), [((4, 0), (2, 2)), ((0, 0), (4, 2))])
    tensor("flat", (7,), [((0,), (3,)), ((3,), (4,))])
    tensor("empty_tail", (5, 2), [((0, 0), (3, 2)), ((3, 0), (2, 2)), ((5, 0), (0, 2))])
    tensor("empty_inside", (5, 2), [((0, 0), (3, 2)), ((1, 0), (0, 2)), ((3, 0), (2, 2))])  # ends fall
    tensor("scalar", (), [((), ())])
    cols = _columns(rows)
    column_checks.check_columns(cols, _doc(rows), "index")
    state, storage = metadata_over(cols)
    swept = {fqn for fqn, md in state.items() if md.size and md._sweeps.of(md._group)}
    assert swept == {"dim0", "dim1", "flat", "empty_tail"}
    metadata = Metadata(state, storage_data=storage)
    for fqn, md in state.items():  # each index as a tensor sorting its own would build it
        alone = ChunkIndex.from_chunks(md.chunks, len(md.size))
        index = md.index()
        assert not md.size or [index.dim, index.starts.tolist(), index.reach.tolist()] == \
            [alone.dim, alone.starts.tolist(), alone.reach.tolist()]
        for lo in range(max(md.size, default=1)):
            box = tuple(min(lo, s - 1) for s in md.size), tuple(min(2, s) for s in md.size)
            local = {fqn: BENCH.FakeShard(md.size, ChunkStorageMetadata(torch.Size(box[0]), torch.Size(box[1])))}
            ours = _plan(NVMeLoadPlanner(**BENCH.FLAT), local, metadata)
            assert _items(ours) == _items(_plan(DefaultLoadPlanner(**BENCH.FLAT), local, metadata))
            for item in ours.items:
                assert storage[item.storage_index].offsets == tuple(item.storage_index.offset)


def _rows(k: int, file: str = "rank_00000.ab.safetensors", keys: str = "stored") -> list[ChunkRecord]:
    """k chunks of tensor "t"; their keys stored in the index (``keys="stored"``: not the
    default) or left to the default (``"default"``: the index holds none)."""
    return [ChunkRecord("t", "tensor", (i, 0), (1, 4), (k, 4), "float32", file, 4096 + 16 * i, 16,
                        f"t@{i}" if keys == "stored" else default_item_key("t", (i, 0)))
            for i in range(k)]


def test_tiling_sweep_compares_linearly_in_chunks():
    """The overlap sweep touches each chunk a bounded number of times (it was a copy of the rest
    of the list per chunk): offsets that count their reads, at k and 4k chunks."""
    reads = [0]

    class Counting(tuple):
        def __getitem__(self, i):
            reads[0] += 1
            return tuple.__getitem__(self, i)

    per_k = {}
    for k in (500, 2000):
        reads[0] = 0
        boxes = [(Counting((i, 0)), Counting((1, 4))) for i in range(k)]
        assert validation.first_overlap(boxes, 0) is None
        per_k[k] = reads[0]
    assert per_k[2000] <= 4.5 * per_k[500]
    overlapping = [((0, 0), (2, 4)), ((1, 0), (2, 4))]
    assert validation.first_overlap(overlapping, 0) == ((0, 0), (1, 0))


def _doc(rows, size=1 << 20):
    files = sorted({r.file for r in rows})
    return {"save_key": "ab", "files": [{"name": f, "rank": int(f[5:10]), "size": size} for f in files]}


def _columns(rows):
    return ChunkColumns.from_table(read_chunk_table(chunks_table(rows), "index", len(rows) + 1))


def test_columnar_checks_run_no_row_check_on_a_good_index(monkeypatch):
    called = []
    monkeypatch.setattr(column_checks, "tiling_problem", lambda rows: called.append(rows) or "")
    monkeypatch.setattr(column_checks, "check_row", lambda *a: called.append(a))
    rows = _rows(3000)
    column_checks.check_columns(_columns(rows), _doc(rows), "index")
    assert called == []


BAD = {
    "overlap": lambda rows: rows.__setitem__(5, ChunkRecord("t", "tensor", (4, 0), (2, 4), rows[5].global_shape,
                                                             "float32", rows[5].file, 9000, 32, "t@x")),
    "shared bytes": lambda rows: rows.__setitem__(7, ChunkRecord(*[*vars(rows[7]).values()][:7], rows[6].byte_offset + 8,
                                                                 16, rows[7].key)),
    "twice": lambda rows: rows.__setitem__(9, ChunkRecord(*[*vars(rows[9]).values()][:9], rows[8].key)),
    "hole": lambda rows: rows.pop(3),
    "outside": lambda rows: rows.__setitem__(2, ChunkRecord(*[*vars(rows[2]).values()][:7], (1 << 20) - 8, 16, rows[2].key)),
    "length": lambda rows: rows.__setitem__(4, ChunkRecord(*[*vars(rows[4]).values()][:8], 12, rows[4].key)),
    "dtype": lambda rows: rows.__setitem__(1, ChunkRecord(*[*vars(rows[1]).values()][:5], "float33",
                                                          *[*vars(rows[1]).values()][6:])),
    "shape": lambda rows: rows.__setitem__(6, ChunkRecord(*[*vars(rows[6]).values()][:4], (20, 5),
                                                          *[*vars(rows[6]).values()][5:])),
    "unlisted file": lambda rows: rows.__setitem__(8, ChunkRecord(*[*vars(rows[8]).values()][:6],
                                                                  "rank_00001.ab.safetensors", *[*vars(rows[8]).values()][7:])),
    "empty key": lambda rows: rows.__setitem__(0, ChunkRecord(*[*vars(rows[0]).values()][:9], "")),
    "same chunk twice": lambda rows: rows.__setitem__(9, replace(rows[8], byte_offset=rows[9].byte_offset)),
    "a name spelling a key": lambda rows: rows.append(ChunkRecord(
        "t@3,0", "tensor", (0,), (1,), (1,), "float32", rows[0].file, 9000, 4, "t@3,0")),
}


@pytest.mark.parametrize("keys", ["stored", "default"])
@pytest.mark.parametrize("fault", sorted(BAD))
def test_columnar_checks_raise_what_the_row_checks_raise(fault, keys):
    rows = _rows(2 * column_checks.SMALL_INDEX, keys=keys)  # more rows than are checked row by row
    doc = _doc(rows)
    BAD[fault](rows)
    expected = _error_of(lambda: validation.check_chunks(rows, doc, "index"))
    got = _error_of(lambda: column_checks.check_columns(_columns(rows), doc, "index"))
    assert got == expected
    # only default keys make the name "t@3,0" collide with the chunk of "t" at (3, 0)
    assert expected is not None or (fault, keys) == ("a name spelling a key", "stored")


def _error_of(check) -> str | None:
    try:
        check()
    except ManifestError as exc:
        return str(exc)
    return None


def test_an_index_of_default_keys_stores_none_and_reads_them_back():
    """Format 3: a key equal to ``default_item_key`` is a null in the index; records, the tools'
    parse and a table mixing stored and default keys all give every row its key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dcp_nvme.format.tables import parse_chunks

    rows = _rows(6, keys="default") + [ChunkRecord("b", "bytes", (), (), (), "uint8", "rank_00000.ab.safetensors",
                                                   9000, 5, "b")]
    data = chunks_table(rows)
    assert pq.read_table(pa.BufferReader(data)).column("key").null_count == len(rows)
    assert parse_chunks(data) == rows
    assert _columns(rows).records() == rows
    mixed = rows[:3] + [replace(rows[3], key="custom")] + rows[4:]
    assert pq.read_table(pa.BufferReader(chunks_table(mixed))).column("key").null_count == len(rows) - 1
    assert _columns(mixed).records() == mixed
    column_checks.check_columns(_columns(mixed), _doc(mixed), "index")


def test_commit_keeps_the_ranks_order_when_it_is_the_metadata_order_else_sorts():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from dcp_nvme.errors import SaveError
    from dcp_nvme.format.tables import StoredItem
    from dcp_nvme.save.results import collect

    def row(fqn, start, rank):
        return ChunkRecord(fqn, "tensor", (start,), (2,), (4,), "float32", f"rank_{rank:05d}.ab.safetensors",
                           4096, 8, fqn)

    ranks = [[row("a", 0, 0), row("b", 0, 0)], [row("a", 2, 1), row("b", 2, 1)]]
    results = [[WriteResult(MetadataIndex(r.fqn, r.offsets), 8, StoredItem(r)) for r in rank] for rank in ranks]

    def meta(order):
        return Metadata({fqn: TensorStorageMetadata(TensorProperties(torch.float32), torch.Size((4,)),
                         [ChunkStorageMetadata(torch.Size((s,)), torch.Size((2,))) for s in (0, 2)])
                         for fqn in order})

    from dcp_nvme.format.tables import chunk_rows, rows_blob
    from dcp_nvme.save import results as results_module

    blobs = [[WriteResult(r[0].index, 8, StoredItem(r[0].storage_data.chunk, rows=rows_blob(ranks[i])))]
             + r[1:] for i, r in enumerate(results)]
    fast, _, _ = results_module.collect_rows(meta("ab"), blobs)  # the ranks' rows, concatenated
    assert fast.equals(chunk_rows([r for rank in ranks for r in rank]))
    assert results_module.rows_in_metadata_order(fast, meta("ab"))
    assert not results_module.rows_in_metadata_order(fast, meta("ba"))
    slow, _, _ = results_module.collect_rows(meta("ba"), blobs)  # not the metadata's order: sorted
    assert slow.column("fqn").to_pylist() == ["b", "b", "a", "a"]
    with pytest.raises(SaveError, match="no rank wrote 2 item"):
        results_module.collect_rows(meta("abc"), blobs)
    kept, _, _ = collect(meta("ab"), results)
    assert [(r.fqn, r.offsets) for r in kept] == [("a", (0,)), ("b", (0,)), ("a", (2,)), ("b", (2,))]
    ordered, _, _ = collect(meta("ba"), results)
    assert [(r.fqn, r.offsets) for r in ordered] == [("b", (0,)), ("b", (2,)), ("a", (0,)), ("a", (2,))]
    with pytest.raises(SaveError, match="no rank wrote 2 item"):
        collect(meta("abc"), results)
