import os
import sys

import pytest

# tests import their helpers (dist_utils, s3server...) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def cluster(tmp_path):
    """Two simulated nodes of two ranks each (tests/multinode.py); skipped where namespaces are refused."""
    from multinode import Cluster, unshare_unavailable

    reason = unshare_unavailable()
    if reason:
        pytest.skip(reason)
    with Cluster(tmp_path / "cluster", nodes=2, ranks_per_node=2) as c:
        yield c
