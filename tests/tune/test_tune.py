"""dcp-nvme tune: a real sweep at a tiny size, its file, and resolve_config using it."""

from __future__ import annotations

import json
import os

import pytest

from dcp_nvme.cli import main
from dcp_nvme.config import TUNE_FILE_ENV, IOConfig, default_tune_file, resolve_config
from dcp_nvme.tune.probe import engine_probe, pick_best, pick_host_engine, pick_read_mode


def _point(qd, bs, direct, write, read):
    return {"queue_depth": qd, "block_size": bs, "direct_io": direct, "write_gbps": write, "read_gbps": read}


def test_pick_best_prefers_balanced_then_smaller_window():
    points = [_point(8, 8 << 20, True, 3.0, 0.3), _point(4, 1 << 20, True, 1.5, 1.4),
              _point(16, 16 << 20, False, 1.52, 1.42)]
    best = pick_best(points)
    # the geometric mean rules out the write-only point; the two balanced ones are within 3 %,
    # and the smaller write window (4 x 1 MiB) wins the tie
    assert (best["queue_depth"], best["block_size"], best["direct_io"]) == (4, 1 << 20, True)
    assert pick_best([_point(2, 4096, False, 1.0, 2.0)])["block_size"] == 4096
    with pytest.raises(ValueError):
        pick_best([])


def test_tune_writes_a_file_resolve_config_uses(tmp_path, monkeypatch, capsys):
    tune_file = tmp_path / "conf" / "tune.json"
    monkeypatch.setenv(TUNE_FILE_ENV, str(tune_file))
    for name in ("QUEUE_DEPTH", "BLOCK_SIZE", "DIRECT_IO"):
        monkeypatch.delenv(f"DCP_NVME_{name}", raising=False)
    assert default_tune_file() == tune_file
    disk = tmp_path / "disk"
    disk.mkdir()
    status = main(["tune", "--dir", str(disk), "--size", "2MiB", "--queue-depths", "1,3",
                   "--block-sizes", "256KiB,1MiB", "--direct", "both", "--no-progress"])
    assert status == 0
    out = capsys.readouterr().out
    assert "<- best" in out and str(tune_file) in out
    doc = json.loads(tune_file.read_text())
    assert len(doc["points"]) == 2 * 2 * 2
    assert {(p["queue_depth"], p["block_size"], p["direct_io"]) for p in doc["points"]} == {
        (q, b, d) for q in (1, 3) for b in (256 << 10, 1 << 20) for d in (True, False)}
    for point in doc["points"]:
        assert point["bytes"] == 2 << 20 and point["write_gbps"] > 0 and point["read_gbps"] > 0
        assert point["write_io"]["bytes"] == 2 << 20 and 1 <= point["write_io"]["max_inflight"] <= point["queue_depth"]
    assert doc["machine"]["directory"] == str(disk) and doc["machine"]["cpu_count"]
    best = doc["best"]
    assert {k: v for k, v in best.items() if k not in ("read_mode", "host_engine")} == pick_best(doc["points"])
    assert best["host_engine"] == pick_host_engine(doc["host_engines"])
    assert doc["host_engines"]["posix"]["cpu_seconds_per_gb"] > 0
    assert f"host_engine={best['host_engine']}" in out
    modes = doc["read_modes"]  # both read modes measured on the same file, the winner stored
    assert modes["direct"] > 0 and modes["buffered"] > 0
    assert best["read_mode"] == pick_read_mode(modes)
    assert f"read_mode={best['read_mode']}" in out
    assert os.listdir(disk) == []  # every probe file and the work directory are gone

    config = resolve_config()
    assert (config.queue_depth, config.block_size, config.direct_io, config.read_mode,
            config.host_engine) == (best["queue_depth"], best["block_size"], best["direct_io"],
                                    best["read_mode"], best["host_engine"])
    # explicit arguments and the environment still win over the tune file
    assert resolve_config(queue_depth=7).queue_depth == 7
    monkeypatch.setenv("DCP_NVME_BLOCK_SIZE", "2MiB")
    assert resolve_config().block_size == 2 << 20


def test_tune_output_elsewhere_leaves_the_default_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(TUNE_FILE_ENV, str(tmp_path / "default.json"))
    target = tmp_path / "elsewhere.json"
    assert main(["tune", "--dir", str(tmp_path), "--size", "1MiB", "--queue-depths", "2",
                 "--block-sizes", "1MiB", "--direct", "on", "--output", str(target), "--no-progress"]) == 0
    assert f"DCP_NVME_TUNE_FILE={target}" in capsys.readouterr().out
    assert json.loads(target.read_text())["best"]["queue_depth"] == 2
    assert not (tmp_path / "default.json").exists()


def test_tune_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--dir", str(tmp_path), "--block-sizes", "1000"])
    assert exc.value.code == 2
    assert "multiples of 4096" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--dir", str(tmp_path), "--queue-depths", "0,2"])
    assert main(["tune", "--dir", str(tmp_path), "--repeat", "0"]) == 1
    assert "--repeat must be at least 1" in capsys.readouterr().err


def test_engine_probe_reads_back_what_it_wrote(tmp_path):
    import torch

    from dcp_nvme.engines.host_io import aligned_buffer

    buffer = aligned_buffer(3 << 20, pin=False)
    pattern = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    buffer.copy_(pattern)
    result = engine_probe(str(tmp_path), 3 << 20, IOConfig(queue_depth=2, block_size=1 << 20), buffer=buffer,
                          keep=True)
    assert result.write_io["bytes"] == 3 << 20 and result.read_io["bytes"] == 3 << 20
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("probe-")]
    data = path.read_bytes()
    assert len(data) == 4096 + (3 << 20) and data[:4096] == bytes(4096)
    assert data[4096:] == pattern.numpy().tobytes()
    assert torch.equal(buffer, pattern)  # read back into the buffer unchanged
