import os
import sys

import pytest

# tests import their helpers (dist_utils, s3server...) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))


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
