"""Waits with an end: a drain failure that no retry can fix fails at once (no credentials,
credentials refused, a bucket that does not exist, an endpoint that never answers), while a
transient one keeps its retries; the exit's wait for drains is bounded and says what it waits
for; a node-local drain gives up on a node that stopped draining."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_nvme_harness.s3_fixtures import *  # noqa: F403  (fixtures s3_server, s3_bucket, s3_fs)

from dcp_nvme import NVMeWriter
from dcp_nvme.tiers import FAILED, DrainError, DrainOptions, drain, drain_state

ONE_RETRY = DrainOptions(part_size=5 << 20, retries=1, backoff=2.0)
"""A retried failure would show as a second attempt, 2 s later."""


def _save(path) -> str:
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, storage_writer=NVMeWriter(str(path)), no_dist=True)
    return str(path)


def _fails_at_once(local: str, url: str, cause: str, **kw) -> None:
    with pytest.raises(DrainError) as info:
        drain(local, url, options=ONE_RETRY, **kw)
    state = drain_state(local)
    assert state.state == FAILED and state.attempts == 1, state
    assert cause in info.value.cause and cause in state.cause, info.value.cause


def test_no_credentials_fails_at_once_and_says_how_to_give_them(tmp_path, s3_server, s3_bucket, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    options = s3_server.storage_options(retries=1)
    del options["key"], options["secret"]
    local = _save(tmp_path / "step_1")
    _fails_at_once(local, f"s3://{s3_bucket}/step_1", "no credentials", storage_options=options)
    assert "AWS_ACCESS_KEY_ID" in drain_state(local).cause


def test_access_denied_fails_at_once(tmp_path, s3_server, s3_bucket, s3_fs):
    local = _save(tmp_path / "step_2")
    with s3_server.proxy.fault("error", status=403, code="AccessDenied"):
        _fails_at_once(local, f"s3://{s3_bucket}/step_2", "access denied", filesystem=s3_fs)


def test_dead_endpoint_fails_after_its_connection_retries_only(tmp_path, s3_server, s3_bucket, s3_fs):
    local = _save(tmp_path / "step_3")
    s3_server.proxy.down()  # connections refused (s3_bucket brings it back up)
    _fails_at_once(local, f"s3://{s3_bucket}/step_3", "remote unreachable", filesystem=s3_fs)


@pytest.mark.slow
def test_the_exit_waits_a_bounded_time_and_says_for_what(tmp_path, monkeypatch, caplog):
    """A drain that does not end (held at its first piece) keeps the exit waiting only
    DCP_NVME_EXIT_WAIT seconds, and the log names the checkpoint, the target, the state and the
    setting, before and after."""
    from dcp_nvme.tiers import Drainer, background
    from dcp_nvme.tiers.drainer import set_drain_hook

    local, mirror = _save(tmp_path / "step_5"), str(tmp_path / "mirror" / "step_5")
    held, release = threading.Event(), threading.Event()

    def hold(point, info):
        if point == "piece-sent":
            held.set()
            release.wait(60)

    previous = set_drain_hook(hold)
    drainer = Drainer(DrainOptions(retries=0))
    try:
        future = drainer.submit(local, mirror)
        assert held.wait(30)
        monkeypatch.setenv("DCP_NVME_EXIT_WAIT", "1")
        exiting = threading.Thread(target=background._wait_at_exit, daemon=True)
        began = time.monotonic()
        exiting.start()
        exiting.join(15)
        assert not exiting.is_alive(), "the exit still waits"
        assert time.monotonic() - began < 10
    finally:
        release.set()
        set_drain_hook(previous)
    future.result(30)
    drainer.close()
    said = [r.getMessage() for r in caplog.records if r.name == "dcp_nvme.tiers.background"]
    assert any("waits up to 1 s (DCP_NVME_EXIT_WAIT)" in m and f"{local} -> {mirror}" in m and "draining" in m
               for m in said), said
    assert any("exits without waiting longer than 1 s" in m and local in m and "dcp-nvme drain" in m
               for m in said), said


def test_a_bad_exit_wait_names_the_variable():
    from dcp_nvme.config import InvalidInputError, exit_wait

    assert exit_wait({}) == 600 and exit_wait({"DCP_NVME_EXIT_WAIT": "0"}) == 0
    with pytest.raises(InvalidInputError, match="'soon' from environment variable DCP_NVME_EXIT_WAIT"):
        exit_wait({"DCP_NVME_EXIT_WAIT": "soon"})


class _Journal:
    def __init__(self) -> None:
        self.causes: list[str] = []

    def update(self, **fields) -> None:
        self.causes.append(fields.get("cause", ""))


class _NodeLocalSave:
    """What ``wait_for_every_node`` reads of a node-local save drained by node 0 of nodes 0 and 1."""

    save_key, nodes_here, manifest_bytes = "k1", ["0"], b"{}"
    files = {"rank_00000.k1.safetensors": SimpleNamespace(size=10)}

    class manifest:  # noqa: N801
        @staticmethod
        def files_by_node():
            return {"0": ["rank_00000.k1.safetensors"], "1": ["rank_00001.k1.safetensors"]}


@pytest.mark.slow
def test_a_node_that_stops_beating_is_given_up_on_by_name(tmp_path):
    """Node 1's drain beats on the target for 2 s (longer than the silence limit), then its
    process dies. Node 0, its own files sent, waits while node 1 beats and gives up on it, by
    name, once its heartbeat has been silent for node_silence seconds, not after node_wait."""
    from dcp_nvme.tiers.sinks import LocalSink
    from dcp_nvme.tiers.target import Heartbeat, wait_for_every_node
    from dcp_nvme.tiers.transfer import NodeSilent

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    options = DrainOptions(node_wait=60, node_silence=0.8)
    other = Heartbeat(LocalSink(str(mirror)), "k1", ["1"], interval=0.1)
    threading.Timer(2.0, other.stop).start()  # node 1 dies
    journal = _Journal()
    began = time.monotonic()
    with pytest.raises(NodeSilent, match=r"node\(s\) 1 did not drain their files of save k1 and wrote no "
                                         r"heartbeat there for 1 s \(node_silence\)"):
        wait_for_every_node(LocalSink(str(mirror)), _NodeLocalSave(), options, journal)
    waited = time.monotonic() - began
    assert 2.0 <= waited < 10, waited
    assert "waiting for node(s) 1 to drain their files" in journal.causes[0]
    assert (mirror / ".drain-node.k1.0").exists()
