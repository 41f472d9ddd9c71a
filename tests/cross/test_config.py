import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_nvme.config import IOConfig, check_option, parse_size, resolve_config
from dcp_nvme.errors import InvalidInputError


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


# --------------------------------------------------------------------------- strict validation


@pytest.mark.parametrize("word, expected", [("no", False), ("OFF", False), ("0", False), (" false ", False),
                                            ("yes", True), ("On", True), ("1", True), ("true", True),
                                            (True, True), (False, False), (1, True), (0, False)])
def test_booleans_accept_clear_spellings(word, expected):
    assert check_option("direct_io", word) is expected
    assert resolve_config(direct_io=word).direct_io is expected


@pytest.mark.parametrize("name", ["direct_io", "verify", "overwrite", "allow_pickle"])
@pytest.mark.parametrize("value", ["maybe", "", 2, 1.0, "nope", [], None])
def test_booleans_refuse_anything_else(name, value):
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} from the argument is not valid")):
        check_option(name, value)


@pytest.mark.parametrize("bad, problem", [
    (dict(queue_depth=True), "queue_depth=True from the argument .* expected an integer from 1 to 256"),
    (dict(queue_depth=0), "queue_depth=0 .* must be from 1 to 256"),
    (dict(queue_depth=257), "must be from 1 to 256"),
    (dict(queue_depth=2.0), "expected an integer"),
    (dict(block_size=4096.7), "block_size=4096.7 .* not a size"),
    (dict(block_size=4096.0), "not a size"),
    (dict(block_size=True), "not a size"),
    (dict(block_size="1TiB"), "block_size='1TiB' .* must be from 4 KiB to 256 MiB"),
    (dict(block_size="4096.5"), "not a whole number of bytes"),
    (dict(block_size=1000), "must be from 4 KiB"),
    (dict(block_size=12289), "multiple of 4 KiB"),
    (dict(block_size="8MB"), r"block_size='8MB' .* multiple of 4 KiB \('8MB' is decimal: 8000000 bytes\); did you "
                             r"mean '8MiB'\?"),
    (dict(block_size=-4096), "negative"),
    (dict(engine="spdk"), "engine='spdk' .* expected one of auto, posix, kvikio"),
])
def test_bad_arguments_name_option_value_and_source(bad, problem):
    with pytest.raises(ValueError, match=problem):
        resolve_config(**bad)
    with pytest.raises(ValueError, match=problem):
        IOConfig(**bad)


def test_sizes_accept_unit_strings_and_integers():
    assert resolve_config(block_size="8MiB").block_size == 8 << 20
    assert resolve_config(block_size="1.5MiB").block_size == 3 << 19
    assert IOConfig(block_size="256MiB").block_size == 256 << 20
    assert resolve_config(queue_depth="16").queue_depth == 16


@pytest.mark.parametrize("env, value, problem", [
    ("DCP_NVME_BLOCK_SIZE", "1TiB", "must be from 4 KiB to 256 MiB"),
    ("DCP_NVME_QUEUE_DEPTH", "lots", "expected an integer"),
    ("DCP_NVME_DIRECT_IO", "maybe", "expected True/False"),
    ("DCP_NVME_ENGINE", "spdk", "expected one of"),
])
def test_bad_environment_names_variable_and_value(monkeypatch, env, value, problem):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=f"={value!r} from environment variable {env} is not valid: {problem}"):
        resolve_config()


@pytest.mark.parametrize("best", [{"queue_depth": "many"}, {"block_size": 4096.5}, {"direct_io": "perhaps"},
                                  {"block_size": "1TiB"}])
def test_bad_tune_file_values_are_warned_about_and_ignored(tmp_path, monkeypatch, caplog, best):
    """An out-of-range or garbage value costs only that value (a warning naming the file), never
    every NVMeWriter(): the file's good values still apply."""
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"best": {**best, "node_write_order": "staggered"}}))
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune))
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.config"):
        config = resolve_config()
    (key,) = best
    assert getattr(config, key) == getattr(IOConfig(), key)
    assert config.node_write_order == "staggered"
    assert f"ignoring {key} of tune file {tune}" in caplog.text and "rerun `dcp-nvme tune`" in caplog.text


def test_writer_and_reader_check_their_options_at_construction(tmp_path):
    from dcp_nvme import NVMeReader, NVMeWriter

    with pytest.raises(ValueError, match="overwrite='maybe'"):
        NVMeWriter(tmp_path, overwrite="maybe")
    with pytest.raises(ValueError, match="queue_depth=True"):
        NVMeWriter(tmp_path, queue_depth=True)
    with pytest.raises(ValueError, match="memory_budget='lots'"):
        NVMeReader(tmp_path, memory_budget="lots")
    with pytest.raises(ValueError, match="allow_pickle='sure'"):
        NVMeReader(tmp_path, allow_pickle="sure")
    assert NVMeWriter(tmp_path, overwrite="no", direct_io="no").overwrite is False
    assert NVMeWriter(tmp_path, direct_io="no").config.direct_io is False
    assert NVMeReader(tmp_path, memory_budget="64MiB").memory_budget == 64 << 20


def test_mirror_protocol_is_checked_at_construction(tmp_path):
    import time

    from dcp_nvme import NVMeWriter

    started = time.monotonic()
    with pytest.raises(ValueError, match="mirror='nosuchproto://x' .* fsspec knows no protocol 'nosuchproto'"):
        NVMeWriter(tmp_path, mirror="nosuchproto://x")
    assert time.monotonic() - started < 5  # at once, not after retries
    assert NVMeWriter(tmp_path, mirror="memory://bucket/run").mirror == "memory://bucket/run"
    assert NVMeWriter(tmp_path, mirror=str(tmp_path / "mirror")).mirror == str(tmp_path / "mirror")


def test_overwrite_no_keeps_the_committed_checkpoint(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_nvme import NVMeReader, NVMeWriter

    dcp.save({"w": torch.ones(4)}, storage_writer=NVMeWriter(tmp_path, direct_io="off"), no_dist=True)
    with pytest.raises(CheckpointException, match="Checkpoint already exists at .* overwrite=False"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=NVMeWriter(tmp_path, overwrite="no", direct_io="no"),
                 no_dist=True)
    loaded = {"w": torch.empty(4)}
    dcp.load(loaded, storage_reader=NVMeReader(tmp_path, direct_io=False), no_dist=True)
    assert torch.equal(loaded["w"], torch.ones(4))


@pytest.mark.parametrize("reader_block", ["128KiB", "4KiB", "12KiB", "1MiB"])
def test_reader_block_size_is_independent_of_the_writers_checksum_block(tmp_path, monkeypatch, reader_block):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_nvme import NVMeReader, NVMeWriter
    from dcp_nvme.format.manifest import read_files, read_manifest
    from dcp_nvme.storage.local_dir import LocalStore

    torch.manual_seed(0)
    state = {"big": torch.randn(300_000), "rows": torch.randn(64, 1000)}  # 1.2 MB: several 256 KiB blocks
    dcp.save(state, storage_writer=NVMeWriter(tmp_path, direct_io=False), no_dist=True)
    files = read_files(LocalStore(tmp_path), read_manifest(LocalStore(tmp_path), str(tmp_path)), str(tmp_path))
    assert {f.checksum_block for f in files.values()} == {256 << 10}
    monkeypatch.setenv("DCP_NVME_BLOCK_SIZE", reader_block)
    reader = NVMeReader(tmp_path, direct_io=False)
    assert reader.config.block_size == check_option("block_size", reader_block)
    loaded = {"big": torch.zeros(300_000), "rows": torch.zeros(64, 1000)}
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


# --------------------------------------------------------------------------- hostile values


@pytest.mark.parametrize("env, value", [
    ("DCP_NVME_QUEUE_DEPTH", "²"), ("DCP_NVME_QUEUE_DEPTH", "¹⁰"), ("DCP_NVME_QUEUE_DEPTH", "٣"),
    ("DCP_NVME_QUEUE_DEPTH", "9" * 5000), ("DCP_NVME_NODE_QUEUE_DEPTH", "²"),
    ("DCP_NVME_BLOCK_SIZE", "٨MiB"), ("DCP_NVME_BLOCK_SIZE", "9" * 5000),
    ("DCP_NVME_BLOCK_SIZE", "1." + "0" * 5000 + "MiB"), ("DCP_NVME_ENGINE", "x" * 5000),
])
def test_environment_numbers_are_short_ascii_and_named(monkeypatch, env, value):
    """Unicode digits (str.isdigit is true, int() may refuse or accept them) and values of
    thousands of characters are refused by a clear error naming the variable, of bounded length."""
    monkeypatch.setenv(env, value)
    with pytest.raises(InvalidInputError, match=f"from environment variable {env} is not valid") as info:
        resolve_config()
    assert len(str(info.value)) < 400


def _sparse_3gib(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(3 << 30)


HOSTILE_TUNE_FILES = {
    "deep": lambda path: path.write_bytes(b"[" * 200_000),
    "huge": _sparse_3gib,
    "fifo": lambda path: os.mkfifo(path),
    "dev-zero": lambda path: os.symlink("/dev/zero", path),
}


@pytest.mark.parametrize("kind", list(HOSTILE_TUNE_FILES))
def test_a_hostile_tune_file_is_ignored_with_a_warning_in_bounded_memory(tmp_path, kind):
    """As a corrupt tune file: a warning naming the file, and the defaults; read no further than
    its size cap, without following it into a FIFO or device (run under a 512 MiB address-space
    limit, so reading it whole fails the test instead of the machine)."""
    tune = tmp_path / "tune.json"
    HOSTILE_TUNE_FILES[kind](tune)
    code = ("import logging, resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))\n"
            "logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
            "from dcp_nvme.config import IOConfig, resolve_config\n"
            "print('DEFAULTS', resolve_config() == IOConfig())\n")
    env = {**os.environ, "DCP_NVME_TUNE_FILE": str(tune), "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DEFAULTS True" in proc.stdout and f"ignoring tune file {tune}" in proc.stdout, proc.stdout


def test_misspelt_environment_variable_is_named_with_the_closest_real_one(monkeypatch, caplog):
    from dcp_nvme import config

    monkeypatch.setattr(config, "_WARNED_ENV", set())
    monkeypatch.setenv("DCP_NVME_QUEUE_DEPHT", "4")
    monkeypatch.setenv("DCP_NVME_BLOK_SIZE", "1MiB")
    monkeypatch.setenv("DCP_NVME_QUEUE_DEPTH", "3")  # a real one: no warning
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.config"):
        assert resolve_config().queue_depth == 3
        resolve_config()  # once per process and name
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert any("DCP_NVME_QUEUE_DEPHT is not a dcp_nvme setting" in w and "did you mean DCP_NVME_QUEUE_DEPTH?" in w
               for w in warned)
    assert any("DCP_NVME_BLOK_SIZE" in w and "did you mean DCP_NVME_BLOCK_SIZE?" in w for w in warned)
    assert config.warn_unknown_env({"DCP_NVME_ZZZZZZZZZZZZ": "1"}) == [
        "dcp_nvme: environment variable DCP_NVME_ZZZZZZZZZZZZ is not a dcp_nvme setting and is ignored; "
        "the variables read are " + ", ".join(config.known_env_names())]


PER_CLUSTER_ENV = {"DCP_NVME_QUEUE_DEPTH", "DCP_NVME_BLOCK_SIZE", "DCP_NVME_DIRECT_IO", "DCP_NVME_ENGINE",
                   "DCP_NVME_NODE_QUEUE_DEPTH", "DCP_NVME_TUNE_FILE", "DCP_NVME_REPLICA_STRIDE",
                   "DCP_NVME_EXIT_WAIT"}


def test_every_variable_the_package_reads_is_known_to_the_misspelling_warning():
    """The product reads only the 8 variables an operator sets per cluster; a DCP_NVME_* name in
    the code that warn_unknown_env does not know would be read and warned about as misspelt at
    once."""
    from dcp_nvme.config import known_env_names, warn_unknown_env

    assert set(known_env_names()) == PER_CLUSTER_ENV and len(known_env_names()) == 8
    root = Path(__file__).parents[2]
    sources = [*(root / "dcp_nvme").rglob("*.py"), root / "scripts" / "dev.sh"]
    for path in sources:
        found = set(re.findall(r"DCP_NVME_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
        assert found <= PER_CLUSTER_ENV, (path, sorted(found - PER_CLUSTER_ENV))
    assert warn_unknown_env({name: "1" for name in PER_CLUSTER_ENV}) == []


RETIRED_ENV = {"DCP_NVME_VERIFY": "0", "DCP_NVME_READ_MODE": "buffered", "DCP_NVME_HOST_ENGINE": "uring",
               "DCP_NVME_NODE_WRITE_ORDER": "staggered", "DCP_NVME_REPLICAS": "2",
               "DCP_NVME_REPLICA_BANDWIDTH": "1MB", "DCP_NVME_PEERS": "1", "DCP_NVME_KVIKIO_PROBE_TIMEOUT": "0.1",
               "DCP_NVME_NODE_INDEX": "off", "DCP_NVME_DEMO_DIR": "/nonexistent", "DCP_NVME_S3_BENCH": "1",
               "DCP_NVME_PEER_ADDR": "10.0.0.1"}
"""Variables development versions read, retired before the first release."""


def test_a_retired_variable_is_warned_about_as_any_unknown_one_and_not_used(tmp_path, monkeypatch, caplog):
    """Nothing released read them, so no table of what replaced them: each is a DCP_NVME_* name no
    option reads, warned about once like a misspelt one, and it changes nothing."""
    from dcp_nvme import NVMeReader, NVMeWriter, config
    from dcp_nvme.engines import kvikio
    from dcp_nvme.load import node_index

    monkeypatch.setattr(config, "_WARNED_ENV", set())
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tmp_path / "absent.json"))
    for name, value in RETIRED_ENV.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="dcp_nvme.config"):
        writer, reader = NVMeWriter(tmp_path / "w"), NVMeReader(tmp_path / "r")
        NVMeReader(tmp_path / "r")  # once per process and name
    warned = [r.getMessage() for r in caplog.records if r.name == "dcp_nvme.config"]
    known = config.known_env_names()
    hints = {name: f"did you mean {config.closest(name, known)}?" if config.closest(name, known)
             else f"the variables read are {', '.join(known)}" for name in RETIRED_ENV}
    assert sorted(warned) == sorted(f"dcp_nvme: environment variable {name} is not a dcp_nvme setting and is "
                                    f"ignored; {hint}" for name, hint in hints.items())
    assert not hasattr(config, "REMOVED_ENV")
    assert (reader.config.verify, reader.config.read_mode, reader.config.host_engine) == (True, "auto", "posix")
    assert (writer.config.node_write_order, writer.replicas, writer.replica_bandwidth) == ("together", 0, None)
    assert reader.peers is False and kvikio.PROBE_TIMEOUT == 60 and node_index.ENABLED is True


def test_the_tune_file_is_read_once_per_version_and_named_once(tmp_path, monkeypatch, caplog):
    """Writers and readers built every step do not re-read the file; a changed file is re-read;
    the log says once which file's values are used, and which values."""
    from dcp_nvme import config

    monkeypatch.setattr(config, "TUNE_RACY_NS", 0)  # the file was just written: trust its timestamps
    reads = []
    real = config._read_tune_file
    monkeypatch.setattr(config, "_read_tune_file", lambda path: reads.append(path) or real(path))
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"best": {"queue_depth": 16, "block_size": 4 << 20}}))
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune))
    with caplog.at_level(logging.INFO, logger="dcp_nvme.config"):
        for _ in range(3):
            assert resolve_config() == IOConfig(queue_depth=16, block_size=4 << 20)
        assert reads == [tune]
        tune.write_text(json.dumps({"best": {"queue_depth": 4}}))  # changed: read again
        assert resolve_config() == resolve_config() == IOConfig(queue_depth=4)
        assert reads == [tune, tune]
    used = [r.getMessage() for r in caplog.records if "using the settings" in r.getMessage()]
    assert used == [f"dcp_nvme: using the settings `dcp-nvme tune` measured, from {tune}: queue_depth=16, "
                    "block_size=4MiB (an argument or DCP_NVME_* variable overrides each)",
                    f"dcp_nvme: using the settings `dcp-nvme tune` measured, from {tune}: queue_depth=4 "
                    "(an argument or DCP_NVME_* variable overrides each)"]
    assert all(r.levelno == logging.INFO for r in caplog.records if "using the settings" in r.getMessage())


def test_a_tune_file_rewritten_within_a_timestamp_tick_is_read_again(tmp_path, monkeypatch):
    """Same size, same inode, maybe the same mtime: a file modified near its last read is
    re-read rather than trusted."""
    tune = tmp_path / "tune.json"
    monkeypatch.setenv("DCP_NVME_TUNE_FILE", str(tune))
    tune.write_text(json.dumps({"best": {"read_mode": "buffered"}}))
    assert resolve_config().read_mode == "buffered"
    tune.write_text(json.dumps({"best": {"read_mode": "direct"}}).replace("}}", " }}"))
    assert resolve_config().read_mode == "direct"


def test_each_io_option_is_declared_once_on_its_field(tmp_path):
    """An IOConfig field carries its check, whether DCP_NVME_<FIELD> sets it and whether the tune
    file does: the environment, the tune file and the checks read them from there."""
    from dataclasses import fields

    from dcp_nvme import config

    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"best": {f.name: f.default for f in fields(config.IOConfig)}}))
    stored = config._read_tune_values(tune)
    for f in fields(config.IOConfig):
        assert (config.ENV_PREFIX + f.name.upper() in config.known_env_names()) is f.metadata["env"], f.name
        assert (f.name in stored) is f.metadata["tuned"], f.name
        assert config.check_option(f.name, f.default) == f.default
        with pytest.raises(InvalidInputError, match=f"^{f.name}=.* from tune file"):
            f.metadata["check"](f.name, "?", "tune file")


def test_the_writer_and_the_reader_name_the_io_keywords_iofig_gives_each(tmp_path):
    """IOConfig's fields say which of NVMeWriter and NVMeReader take them as keywords: each one's
    signature and docstring name exactly those, and each keyword reaches its IOConfig."""
    from dataclasses import fields

    from dcp_nvme import NVMeReader, NVMeWriter, config

    io = {f.name for f in fields(config.IOConfig)}
    assert config.SHARED_IO == tuple(n for n in config.WRITER_IO if n in config.READER_IO)
    for cls, names in ((NVMeWriter, config.WRITER_IO), (NVMeReader, config.READER_IO)):
        assert set(config.options_of(cls)) & io == set(names), cls.__name__
        documented = {n for n in names if re.search(rf"\b{n}\b[^\n]*:", cls.__doc__ or "")}
        assert documented == set(names), (cls.__name__, set(names) - documented)
    assert f"{', '.join(config.SHARED_IO)}: as for NVMeWriter" in NVMeReader.__doc__
    given = {"queue_depth": 3, "block_size": "1MiB", "direct_io": False, "engine": "posix", "verify": False,
             "node_queue_depth": 6, "read_mode": "buffered", "node_write_order": "staggered"}
    for made in (NVMeWriter(tmp_path / "w", **{n: given[n] for n in config.WRITER_IO}),
                 NVMeReader(tmp_path / "r", **{n: given[n] for n in config.READER_IO})):
        names = config.WRITER_IO if isinstance(made, NVMeWriter) else config.READER_IO
        assert {n: getattr(made.config, n) for n in names} == {n: check_option(n, given[n]) for n in names}
