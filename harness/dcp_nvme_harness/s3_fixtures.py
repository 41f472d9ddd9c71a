"""pytest fixtures for moto (subprocess) on loopback behind a FaultProxy: the S3 of the tests that
inject faults, take the server down, or count its requests (``proxy.log``). The tests that need
none of that use SeaweedFS (fixtures ``seaweed``, ``seaweed_bucket``, ``seaweed_fs`` in
conftest.py).

Use from a test module or conftest.py::

    from dcp_nvme_harness.s3_fixtures import *  # noqa: F403   (a named import trips ruff F811)

(or ``pytest_plugins = ["dcp_nvme_harness.s3_fixtures"]`` in a conftest.py). Tests are skipped, not failed, when moto/s3fs are not installed.
"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("moto.server", reason="moto[server] not installed")
pytest.importorskip("s3fs", reason="s3fs not installed")

from dcp_nvme_harness.s3server import DUMMY_KEY, DUMMY_SECRET, REGION, S3Server

__all__ = ["s3_server", "s3_bucket", "s3_fs", "new_bucket_name"]


def new_bucket_name(prefix: str = "test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@pytest.fixture(scope="session")
def s3_server():
    """One moto server (behind a FaultProxy) for the session.  A test that stops it,
    takes the proxy down or adds faults need not undo that: ``s3_bucket`` heals it."""
    srv = S3Server()
    srv.start()
    mp = _safety_net(srv.endpoint_url)
    try:
        yield srv
    finally:
        mp.undo()
        _ADMIN.pop(id(srv), None)
        srv.close()


def _safety_net(endpoint_url: str) -> pytest.MonkeyPatch:
    """Any client built WITHOUT our storage options (e.g. DCP re-creating its fsspec
    filesystem from a bare URL) must reach a loopback server, never AWS, and botocore must
    not probe the EC2 metadata address for credentials."""
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_ENDPOINT_URL_S3", endpoint_url)
    mp.setenv("AWS_ACCESS_KEY_ID", DUMMY_KEY)
    mp.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_SECRET)
    mp.setenv("AWS_DEFAULT_REGION", REGION)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        mp.delenv(var, raising=False)
    return mp


def _heal(srv: S3Server) -> None:
    srv.start()  # no-op when running; restarts a stopped moto and brings the proxy up
    if srv.proxy is not None:
        srv.proxy.clear_faults()
        srv.proxy.up()


_ADMIN: dict = {}


def _admin_fs(srv):
    """One s3fs client per server, straight to moto (bypassing faults) or to SeaweedFS, reused
    across tests: building a client costs ~0.2 s (botocore loads the S3 service model)."""
    fs = _ADMIN.get(id(srv))
    if fs is None:
        fs = _ADMIN[id(srv)] = srv.s3fs(direct=True, retries=3)
    return fs


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket name (created via s3fs, directly on moto) for this test.
    Best-effort removal afterwards (objects are held in moto's memory)."""
    _heal(s3_server)
    name = new_bucket_name()
    _admin_fs(s3_server).mkdir(name)
    try:
        yield name
    finally:
        _heal(s3_server)
        try:
            fs = _admin_fs(s3_server)
            fs.invalidate_cache()
            fs.rm(name, recursive=True)
        except Exception:
            pass


@pytest.fixture
def s3_fs(s3_server):
    """An uncached s3fs.S3FileSystem through the proxy, with 1 attempt (fast failures)."""
    _heal(s3_server)
    return s3_server.s3fs(retries=1)
