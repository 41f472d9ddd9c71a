import json

import pytest

from dcp_nvme.config import IOConfig, parse_size, resolve_config


def test_parse_size_units():
    assert parse_size("8MiB") == parse_size("8M") == 8 << 20
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("eight megs")


def test_defaults_and_checksum_block():
    config = IOConfig()
    assert (config.queue_depth, config.block_size, config.direct_io) == (8, 8 << 20, True)
    assert config.checksum_block == 256 << 10
    assert IOConfig(block_size=12288).checksum_block == 4096  # gcd keeps requests whole blocks


@pytest.mark.parametrize("bad", [dict(queue_depth=0), dict(block_size=1000), dict(engine="spdk")])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        IOConfig(**bad)


def test_precedence_explicit_over_env_over_tune_file(tmp_path, monkeypatch):
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"best": {"queue_depth": 3, "block_size": 1 << 20, "direct_io": False}}))
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune))
    assert resolve_config() == IOConfig(queue_depth=3, block_size=1 << 20, direct_io=False)
    monkeypatch.setenv("DCP_NVME_QUEUE_DEPTH", "5")
    monkeypatch.setenv("DCP_NVME_BLOCK_SIZE", "2MiB")
    assert resolve_config().queue_depth == 5
    assert resolve_config().block_size == 2 << 20
    assert resolve_config(queue_depth=7).queue_depth == 7


def test_bad_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("DCP_NVME_DIRECT_IO", "maybe")
    with pytest.raises(ValueError, match="DCP_NVME_DIRECT_IO"):
        resolve_config()


def test_corrupt_tune_file_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    tune = tmp_path / "tune.json"
    tune.write_text("{not json")
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune))
    assert resolve_config() == IOConfig()
    assert "ignoring tune file" in caplog.text
