"""A run directory in an object store used on its own (``storage.remote_run``): ``latest`` of its
URL, ``dcp-nvme list|status|inspect|verify`` of it with ``--storage-options``, and a step
restored from it journaled as mirrored there. Against the suite's SeaweedFS."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_nvme import NVMeReader, NVMeWriter, latest
from dcp_nvme.cli import main as cli_main
from dcp_nvme.errors import InvalidInputError
from dcp_nvme.format.manifest import read_manifest
from dcp_nvme.storage.local_dir import LocalStore
from dcp_nvme.tiers import MIRRORED, DrainOptions, drain, drain_state
from dcp_nvme.tiers.journal import JOURNAL
from dcp_nvme.tiers.retention import plan_retention

FAST = DrainOptions(part_size=5 << 20, retries=0, backoff=0.01, max_transfers=3)


def _state(seed: int) -> dict:
    return {"w": torch.full((2000,), float(seed)), "b": torch.arange(10) + seed}


@pytest.fixture(scope="module")
def remote_run(tmp_path_factory, seaweed):
    """Steps 1 and 2 saved here and drained to s3://<bucket>/run/step_N: (run URL, options, local
    run). The first test then damages step 2 in the store; the last restores step 1."""
    from dcp_nvme_harness.s3_fixtures import new_bucket_name

    bucket = new_bucket_name()
    seaweed.admin.mkdir(bucket)
    options = seaweed.storage_options(retries=1)
    run = tmp_path_factory.mktemp("remote") / "run"
    for step in (1, 2):
        local = str(run / f"step_{step}")
        dcp.save(_state(step), storage_writer=NVMeWriter(local), no_dist=True)
        drain(local, f"s3://{bucket}/run/step_{step}", storage_options=options, options=FAST)
    yield f"s3://{bucket}/run", options, run
    seaweed.admin.invalidate_cache()
    seaweed.admin.rm(bucket, recursive=True)


def _out(capsys) -> str:
    return capsys.readouterr().out


@pytest.mark.slow
def test_latest_and_the_tools_take_a_run_url(remote_run, seaweed, capsys):
    url, options, _ = remote_run
    given = ["--storage-options", json.dumps(options)]
    assert latest(url, storage_options=options) == f"{url}/step_2"
    out = {"w": torch.empty(2000), "b": torch.empty(10, dtype=torch.int64)}
    dcp.load(out, storage_reader=NVMeReader(latest(url, storage_options=options), storage_options=options),
             no_dist=True)
    assert torch.equal(out["w"], _state(2)["w"])

    assert cli_main(["list", url, *given, "--json"]) == 0
    rows = json.loads(_out(capsys))
    assert [(r["step"], r["state"], r["tier"]) for r in rows] == [(2, "committed", "remote"), (1, "committed", "remote")]
    assert rows[0]["checkpoint"] == f"{url}/step_2" and rows[0]["ranks"] == 1 and rows[0]["bytes"] > 8000
    assert cli_main(["status", url, *given]) == 0
    assert f"{url}/step_1: remote (committed)" in _out(capsys)
    assert cli_main(["inspect", f"{url}/step_1", *given]) == 0
    assert "w" in _out(capsys)
    assert cli_main(["verify", f"{url}/step_1", *given]) == 0
    assert f"OK {url}/step_1: intact" in _out(capsys)

    # step 2 loses a data file in the store: latest passes over it, saying so; list calls it damaged
    rank_file = read_manifest(LocalStore(str(remote_run[2] / "step_2")), "step_2").file_names[0]
    seaweed.admin.rm(f"{url.removeprefix('s3://')}/step_2/{rank_file}")
    seaweed.admin.invalidate_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest(url, storage_options=options) == f"{url}/step_1"
    assert any(f"{url}/step_2 (step 2) is committed but cannot load" in str(w.message) and rank_file in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert cli_main(["list", url, *given]) == 0
    assert f"step_2: {rank_file} is missing" in _out(capsys)

    assert latest(f"{url}-typo", storage_options=options) is None  # nothing stored there: a fresh start
    assert cli_main(["list", f"{url}-typo", *given]) == 1
    assert f"{url}-typo holds nothing" in capsys.readouterr().err
    assert cli_main(["list", url, "--storage-options", "[1]"]) == 1
    assert "--storage-options is a JSON list, not an object" in capsys.readouterr().err
    assert cli_main(["list", str(remote_run[2]), *given]) == 1  # a local path takes none
    assert "are for a URL" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="storage_options are for a URL run directory"):
        latest(remote_run[2], storage_options=options)


def _agree_on_a_url(rank, world, url, options, expected):
    import dcp_nvme.storage.remote_run as remote_run

    asked, real = [], remote_run.latest_remote
    remote_run.latest_remote = lambda *a: asked.append(a) or real(*a)
    try:
        assert latest(url, storage_options=options, agree=True) == expected
    finally:
        remote_run.latest_remote = real
    assert len(asked) == (1 if rank == 0 else 0), (rank, asked)  # rank 0 asks the store, the others hear it


@pytest.mark.slow  # other processes
def test_ranks_agree_on_a_run_urls_newest_from_one_look(remote_run):
    from dcp_nvme_harness.dist_utils import run_ranks

    url, options, _ = remote_run
    run_ranks(2, _agree_on_a_url, url, options, latest(url, storage_options=options))


def test_options_parse_in_one_place_and_credentials_never_reach_disk():
    from dcp_nvme.config import parse_storage_options, without_credentials

    assert parse_storage_options(None) is None and parse_storage_options(' {"anon": true} ') == {"anon": True}
    with pytest.raises(InvalidInputError, match="--storage-options is not valid JSON") as caught:
        parse_storage_options('{"secret": "s3cr3t",')
    assert "s3cr3t" not in str(caught.value)  # the text may hold a secret: never echoed
    assert without_credentials({"key": "a", "secret": "b", "token": "c", "endpoint_url": "http://h",
                                "client_kwargs": {"region_name": "r", "aws_secret_access_key": "d"},
                                "session_factory": object(), "config_kwargs": {"retries": {"max_attempts": 1}},
                                "client": object()}) == \
        {"endpoint_url": "http://h", "client_kwargs": {"region_name": "r"},
         "config_kwargs": {"retries": {"max_attempts": 1}}}  # a client object cannot go to disk either


@pytest.mark.slow
def test_a_step_restored_from_the_mirror_is_journaled_mirrored(remote_run, tmp_path, capsys):
    """A replacement node restores step 1 from the mirror alone: its journal says mirrored there
    (with the options, never the credentials), so retention may remove it and `dcp-nvme drain`
    confirms it with no --to and no options."""
    url, options, _ = remote_run
    node_run = tmp_path / "node"
    here = str(node_run / "step_1")
    os.makedirs(here)
    out = {"w": torch.empty(2000), "b": torch.empty(10, dtype=torch.int64)}
    dcp.load(out, storage_reader=NVMeReader(here, mirror=url, mirror_options=options), no_dist=True)
    assert torch.equal(out["w"], _state(1)["w"])
    state = drain_state(here)
    assert (state.state, state.target, state.restored_from) == (MIRRORED, f"{url}/step_1", f"{url}/step_1")
    journal = open(os.path.join(here, JOURNAL)).read()
    assert options["key"] not in journal and options["secret"] not in journal
    assert json.loads(journal)["storage_options"]["endpoint_url"] == options["endpoint_url"]

    assert cli_main(["status", here]) == 0
    assert f"mirrored -> {url}/step_1 (restored from it)" in _out(capsys)
    dcp.save(_state(3), storage_writer=NVMeWriter(str(node_run / "step_3")), no_dist=True)
    [old, new] = plan_retention(node_run, 1, storage_options=options)
    assert (old.path, old.keep, old.reason) == (here, False, f"mirrored to {url}/step_1"), old
    assert new.keep
    assert cli_main(["drain", here, "--json", "--no-progress"]) == 0  # the credentials come from the environment
    result = json.loads(_out(capsys))
    assert result["target"] == f"{url}/step_1" and result["bytes_sent"] == 0, result
