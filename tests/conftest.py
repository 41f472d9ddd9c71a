import pytest


@pytest.fixture
def torch_safe_globals_of_torch_only():
    """torch's weights-only allowlist with only what torch itself registered: Megatron-Core adds
    io.BytesIO, argparse.Namespace, numpy and more at import, for the rest of the process, so a
    test that expects torch's own refusals would pass or fail by which tests its worker ran."""
    import torch

    saved = torch.serialization.get_safe_globals()
    own = [g for g in saved if str(getattr(g[0] if isinstance(g, tuple) else g, "__module__", "")).startswith("torch")]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(own)
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(saved)


@pytest.fixture(scope="session")
def lan():
    """This worker's private network (harness/dcp_nvme_harness/netns.py): 1 Gbit/s links; the simulated clusters'
    nodes and the object store's node (``seaweed_node``) join it. Skipped where refused."""
    from dcp_nvme_harness.netns import Network, network_unavailable

    reason = network_unavailable()
    if reason:
        pytest.skip(reason)
    with Network(rate="1gbit", delay_ms=0.2) as net:
        yield net


@pytest.fixture(scope="module")
def _clusters(tmp_path_factory, lan):
    """The simulated clusters of a module's tests, by shape: a cluster's nodes keep their servers
    (the interpreter each node's launches fork from) from one test to the next, and each test gets
    them emptied (``Cluster.reset``). Skipped where namespaces are refused."""
    from dcp_nvme_harness.multinode import Cluster, unshare_unavailable

    reason = unshare_unavailable()
    if reason:
        pytest.skip(reason)
    made: dict[tuple[int, int], Cluster] = {}

    def get(nodes: int, ranks_per_node: int) -> Cluster:
        cluster = made.get((nodes, ranks_per_node))
        if cluster is None:
            root = tmp_path_factory.mktemp(f"cluster{nodes}x{ranks_per_node}") / "cluster"
            cluster = made[nodes, ranks_per_node] = Cluster(root, nodes=nodes, ranks_per_node=ranks_per_node, network=lan)
        else:
            cluster.reset()
        return cluster

    try:
        yield get
    finally:
        for cluster in made.values():
            cluster.close()


@pytest.fixture
def cluster(_clusters):
    """Two simulated nodes of two ranks each (harness/dcp_nvme_harness/multinode.py), on the worker's
    private network, empty."""
    return _clusters(2, 2)


@pytest.fixture
def cluster3(_clusters):
    """Three simulated nodes of one rank each (a run may ask for more ranks per node), empty."""
    return _clusters(3, 1)


# -- SeaweedFS: the S3 tier of the tests that inject no fault (moto's fixtures, harness/dcp_nvme_harness/s3_fixtures.py,
# serve those that do). Here, not in s3_fixtures: a session fixture that test modules import is
# a fixture of each module, started once per module.


@pytest.fixture(scope="session")
def seaweed(request, tmp_path_factory):
    """One SeaweedFS (harness/dcp_nvme_harness/seaweed.py) for the worker: on its own node of ``lan`` where namespaces
    work (the simulated nodes reach it over their links: ``storage_options(node=True)``), else on
    the host's loopback. ``endpoint_url`` / ``storage_options()`` / ``s3fs()`` serve the test process."""
    pytest.importorskip("s3fs", reason="s3fs not installed")
    from dcp_nvme_harness.netns import network_unavailable
    from dcp_nvme_harness.s3_fixtures import _safety_net
    from dcp_nvme_harness.seaweed import SeaweedFS, seaweed_unavailable

    reason = seaweed_unavailable()
    if reason:
        pytest.skip(reason)
    net = request.getfixturevalue("lan") if network_unavailable() is None else None
    srv = SeaweedFS(tmp_path_factory.mktemp("seaweed") / "data", network=net)
    srv.start()
    mp = _safety_net(srv.endpoint_url)
    srv.admin = srv.s3fs(retries=3)  # one client for the fixtures: building one costs ~0.2 s
    try:
        yield srv
    finally:
        mp.undo()
        srv.close()


@pytest.fixture
def seaweed_bucket(seaweed):
    """A fresh, empty bucket on ``seaweed`` for this test, removed afterwards (best effort)."""
    from dcp_nvme_harness.s3_fixtures import new_bucket_name

    name = new_bucket_name()
    seaweed.admin.mkdir(name)
    try:
        yield name
    finally:
        try:
            seaweed.admin.invalidate_cache()
            seaweed.admin.rm(name, recursive=True)
        except Exception:
            pass


@pytest.fixture
def seaweed_fs(seaweed):
    """An uncached s3fs.S3FileSystem on ``seaweed`` from the test process, with 1 attempt."""
    return seaweed.s3fs(retries=1)
