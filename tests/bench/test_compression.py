"""``dcp-nvme bench --compress`` pieces: the trained state and the measured rows (tiny sizes)."""

from __future__ import annotations

import json

import pytest
import torch

from dcp_nvme.bench.compression import (
    CompressOptions,
    format_compress_report,
    measure_group,
    stdlib_text,
    train,
)
from dcp_nvme.cli import main as cli_main

TINY = ["--train-steps", "3", "--gap", "1", "--model-dim", "32", "--layers", "1", "--seq", "16", "--batch", "2"]


def test_stdlib_text_is_real_text():
    text = stdlib_text(1 << 16)
    assert len(text) == 1 << 16 and b"def " in text and b"import" in text


def test_tiny_training_run_and_rows():
    options = CompressOptions(steps=3, gap=1, dim=32, layers=1, seq=16, batch=2, codec_threads=2)
    snapshots, facts = train(options)
    assert facts["steps"] == 3 and facts["gap"] == 1
    late, early = snapshots["late"], snapshots["early"]
    assert late["weights_bf16"].dtype == torch.bfloat16 and late["exp_avg_fp32"].dtype == torch.float32
    assert not torch.equal(late["exp_avg_fp32"], early["exp_avg_fp32"])  # two different checkpoints
    data = late["exp_avg_sq_fp32"].view(torch.uint8).numpy().tobytes()
    row = measure_group(data, "float32", 3, 2)
    assert row["bytes"] == len(data) and row["bytegroup_ratio"] > 1 and row["zstd_ratio"] > 0
    base = early["exp_avg_sq_fp32"].view(torch.uint8).numpy().tobytes()
    delta = measure_group(data, "float32", 3, 2, base=base)
    doc = {"training": facts, "levels": [3], "codec_threads": 2,
           "groups": {"exp_avg_sq_fp32": {"3": row}}, "delta": {"exp_avg_sq_fp32": {"3": {**delta, "vs_full": 1.0}}}}
    assert "exp_avg_sq_fp32" in format_compress_report(doc)


def test_bench_compress_levels_and_delta_drain(tmp_path, capsys):
    """The command at a tiny size: every group at each level, and the drains of the later
    checkpoint (off, bytegroup, auto, delta against the earlier one) with their loads."""
    out = tmp_path / "z.json"
    assert cli_main(["bench", "--compress", *TINY, "--levels", "1,3", "--codec-threads", "1",
                     "--drain-to", str(tmp_path / "pfs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["levels"] == [1, 3] and doc["level"] == 1
    for section in ("groups", "delta"):
        for group, levels in doc[section].items():
            assert set(levels) == {"1", "3"}, (section, group)
            for row in levels.values():
                assert row["bytegroup_ratio"] > 0 and row["zstd_ratio"] > 0 and row["bytegroup_decode_MBps"] > 0
    drain = doc["drain"]
    assert drain["level"] == 1
    assert drain["delta_base"]["mode"] == "delta" and "no earlier mirrored" in drain["delta_base"]["base"]
    assert "delta against" in drain["delta"]["base"] and drain["delta"]["ratio"] > 0
    assert "codec" not in drain["off"] and drain["off"]["bytes_sent"] > drain["delta"]["bytes_sent"]
    assert drain["speedup_delta"] > 0 and drain["speedup_bytegroup"] > 0
    for mode in ("bytegroup", "delta"):
        load = drain[mode]["load"]
        assert load["bitwise_equal"] is True and load["decoded_bytes"] > 0 and load["decode_MBps_per_core"] > 0
    mirrored = json.loads((tmp_path / "pfs" / "delta" / "manifest.json").read_text())["compression"]
    assert mirrored["delta"]["base"] == str(tmp_path / "pfs" / "delta_base") and mirrored["level"] == 1
    assert "delta against the earlier checkpoint" in text and "decode alone" in text
    assert text.count("load from the") == 2


@pytest.mark.parametrize("argv", [["--levels", "1,x"], ["--levels", "3,3"], ["--levels", "0"],
                                  ["--level", "1,3"], ["--level", "3", "--levels", "1,3"]])
def test_bench_compress_refuses_bad_levels(argv, capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--compress", *TINY, *argv])
    assert "level" in capsys.readouterr().err


def test_delta_gap_curve_script_measures_every_gap(tmp_path):
    """benchmarks/delta_gaps.py: one training run, the delta ratio at each gap beside the full
    ratio (every round trip checked bit for bit inside measure_group), written as JSON."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "delta_gaps.py"
    spec = importlib.util.spec_from_file_location("delta_gaps", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gaps.json"
    # dim 64: the embedding's moments are 64 KiB, placed by their addresses (smaller tensors go
    # back to back, wherever they live), so fresh copies of them move the container's layout
    doc = module.main(["--steps", "6", "--gaps", "1,3", "--dim", "64", "--layers", "1", "--seq", "16",
                       "--batch", "2", "--drain", "--directory", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text())["configuration"]["gaps"] == [1, 3]
    drained = doc["drain"]  # per tensor, drained: fresh tensors at other offsets code as small
    for gap in (1, 3):
        moved, kept = drained["reallocated"][gap], drained["in_place"][gap]
        assert kept["moved"] == 0 and moved["moved"] > 0 and moved["delta_fraction"] == 1.0
        assert abs(moved["stored_bytes"] / kept["stored_bytes"] - 1) < 0.05 and kept["ratio"] > kept["full_ratio"]
    assert drained["reallocated"][1]["bitwise_equal"] is True
    for row in doc["groups"].values():
        assert row["full"] > 0 and set(row["delta"]) == {1, 3} and all(r > 0 for r in row["delta"].values())
    from dcp_nvme.bench.compression import group_dtype
    from dcp_nvme.tiers import codec

    assert [codec.planes_for(group_dtype(g)) for g in doc["groups"]] == [2, 4, 4]  # byte-grouped
    snapshots = module.train_with_snapshots(6, [1, 3], 32, 1, 16, 2)
    assert set(snapshots) == {0, 1, 3}
    assert not torch.equal(snapshots[0]["weights_bf16"], snapshots[3]["weights_bf16"])  # training moved
    with pytest.raises(SystemExit, match="--gaps"):
        module.parse_gaps("0,2", 6)
    with pytest.raises(SystemExit, match="--gaps"):
        module.parse_gaps("6", 6)
