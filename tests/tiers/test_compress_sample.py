"""Where ``compress="auto"`` samples a checkpoint (pure planning) and that its measure reflects
the whole checkpoint, not only the start of its largest file."""

from __future__ import annotations

import pytest
import torch
from test_compress import FAST, assert_same, load, save

from dcp_nvme import NVMeReader
from dcp_nvme.format.tables import FileRecord
from dcp_nvme.tiers import DrainOptions, codec, drain
from dcp_nvme.tiers.compress_sample import SAMPLE, SamplePick, measure, pays, plan_sample
from dcp_nvme.tiers.encoder import Encoder
from dcp_nvme.tiers.source import DrainSource

MiB = 1 << 20
BLOCK = 256 << 10


def record(name: str, data: int, data_start: int = 4096, block: int = BLOCK) -> FileRecord:
    return FileRecord(name, 0, data_start + data, data_start, block, 0, ())


def assert_well_formed(picks: list[SamplePick], records: list[FileRecord], budget: int = SAMPLE) -> None:
    by_name = {r.name: r for r in records}
    for pick in picks:
        r = by_name[pick.file]
        assert r.data_start <= pick.offset and pick.offset + pick.length <= r.size, pick  # in its data
        assert (pick.offset - r.data_start) % r.checksum_block == 0, pick  # verifiable on its own
        assert pick.length % r.checksum_block == 0 or pick.offset + pick.length == r.size, pick
    assert len(set(picks)) == len(picks)
    assert sum(p.length for p in picks) <= max(budget, max((p.length for p in picks), default=0))


def test_windows_cover_the_files_in_proportion_to_their_sizes():
    records = [record("r0", 48 * MiB, data_start=1000), record("empty", 0), record("r1", 16 * MiB)]
    picks = plan_sample(records)
    assert_well_formed(picks, records)
    assert [p.length for p in picks] == [MiB] * 8
    # centred on the middles of 8 equal stretches of the 64 MiB (4, 12, ... 60 MiB): 6 in r0's
    # 48 MiB, 2 in r1's 16 MiB, the empty file none; offsets on r0's/r1's blocks past their headers
    half = MiB // 2
    assert picks == [SamplePick("r0", 1000 + (8 * i + 4) * MiB - half, MiB) for i in range(6)] + \
        [SamplePick("r1", 4096 + (8 * i + 4) * MiB - half, MiB) for i in range(2)]
    assert plan_sample(records) == picks  # deterministic


def test_small_checkpoints_get_fewer_windows_and_tiny_files_whole():
    assert plan_sample([]) == [] and plan_sample([record("e", 0)]) == []
    tiny = [record("t", 5000, data_start=777)]
    assert plan_sample(tiny) == [SamplePick("t", 777, 5000)]  # all its data, to the end of the file
    small = [record("a", 3 * MiB + 100), record("b", 100), record("c", 2 * MiB, block=2 * MiB)]
    assert plan_sample(small) == [  # under the budget: every byte of data, in windows
        SamplePick("a", 4096, MiB), SamplePick("a", 4096 + MiB, MiB), SamplePick("a", 4096 + 2 * MiB, MiB),
        SamplePick("a", 4096 + 3 * MiB, 100), SamplePick("b", 4096, 100), SamplePick("c", 4096, 2 * MiB)]
    assert_well_formed(plan_sample(small), small)


def test_blocks_larger_than_the_window_set_the_window():
    records = [record("big", 64 * MiB, block=4 * MiB)]
    picks = plan_sample(records)
    assert_well_formed(picks, records)
    # centred on 16 and 48 MiB, started on the block at or before 14 and 46 MiB
    assert picks == [SamplePick("big", 4096 + 12 * MiB, 4 * MiB), SamplePick("big", 4096 + 44 * MiB, 4 * MiB)]
    assert plan_sample(records, budget=MiB) == [SamplePick("big", 4096 + 28 * MiB, 4 * MiB)]  # one, mid-file


def test_auto_measures_the_whole_checkpoint_not_its_first_bytes(tmp_path):
    g = torch.Generator().manual_seed(3)
    # the rank file starts with 10 MiB of noise (all a first-bytes sample sees), then 54 MiB that
    # code to almost nothing: as a file starting with one kind of tensor and mostly another
    sd = {"a_noise": torch.randint(0, 256, (10 * MiB,), generator=g, dtype=torch.uint8),
          "b_flat": torch.zeros(54 * MiB, dtype=torch.uint8)}
    local = save(tmp_path / "step_1", sd)
    source = DrainSource(local)
    (name,) = source.manifest.file_names
    first = min((c for c in source.manifest.chunks if c.kind == "tensor"), key=lambda c: c.byte_offset)
    assert first.fqn == "a_noise"  # the premise: noise at the start of the file
    record_ = source.files[name]
    encoder = Encoder(2, codec.DEFAULT_LEVEL)
    try:
        head = measure(source, encoder, [SamplePick(name, record_.data_start, SAMPLE)])  # the old sample
        spread = measure(source, encoder)
    finally:
        encoder.close()
    assert head.ratio < 1.01 and not pays(head, 1e6)[0]  # the first bytes alone: send plain
    result = drain(local, str(tmp_path / "m"), options=DrainOptions(**FAST, compress="auto", link_rate=1e6))
    assert result.compression["codec"] == codec.CODEC and "beats" in result.compression["decision"]
    whole = result.compression["ratio"]
    assert whole > 5  # 64 MiB stored as about 10
    assert 0.5 * whole < spread.ratio < 2 * whole  # the sample's ratio is the whole file's
    assert result.compression["measured_ratio"] == pytest.approx(spread.ratio)  # what auto decided on
    assert_same(load(NVMeReader(str(tmp_path / "m")), sd), sd)
