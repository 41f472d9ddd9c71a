"""``dcp-nvme bench --compress`` pieces: the trained state and the measured rows (tiny sizes)."""

from __future__ import annotations

import torch

from dcp_nvme.bench.compression import (
    CompressOptions,
    format_compress_report,
    measure_group,
    stdlib_text,
    train,
)


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
    row = measure_group(data, "float32", options)
    assert row["bytes"] == len(data) and row["bytegroup_ratio"] > 1 and row["zstd_ratio"] > 0
    base = early["exp_avg_sq_fp32"].view(torch.uint8).numpy().tobytes()
    delta = measure_group(data, "float32", options, base=base)
    doc = {"training": facts, "level": 3, "codec_threads": 2,
           "groups": {"exp_avg_sq_fp32": row}, "delta": {"exp_avg_sq_fp32": {**delta, "vs_full": 1.0}}}
    assert "exp_avg_sq_fp32" in format_compress_report(doc)
