import os
import sys

import pytest

# tests import their helpers (dist_utils, s3server...) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))


def _simulated_cluster(tmp_path, nodes: int, ranks_per_node: int):
    """Simulated nodes (tests/multinode.py); skipped where namespaces are refused."""
    from multinode import Cluster, unshare_unavailable

    reason = unshare_unavailable()
    if reason:
        pytest.skip(reason)
    with Cluster(tmp_path / "cluster", nodes=nodes, ranks_per_node=ranks_per_node) as c:
        yield c


@pytest.fixture
def cluster(tmp_path):
    """Two simulated nodes of two ranks each."""
    yield from _simulated_cluster(tmp_path, nodes=2, ranks_per_node=2)


@pytest.fixture
def cluster3(tmp_path):
    """Three simulated nodes of one rank each (a run may ask for more ranks per node)."""
    yield from _simulated_cluster(tmp_path, nodes=3, ranks_per_node=1)
