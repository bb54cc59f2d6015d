"""One real two-node Ray cluster on this machine for the Ray tests (tests/fixtures/ray_cluster.py).

The tests need Ray (`pip install 'runlm[ray]'`, which `make test-slow` installs) and take a while
(starting the nodes, one model load per actor), so they are slow-marked and skip where Ray is missing."""
from __future__ import annotations

import pytest

from tests.fixtures.ray_cluster import RayCluster


@pytest.fixture(scope="session")
def ray_cluster():
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'runlm[ray]' (make test-slow does)")
    cluster = RayCluster(cpus_per_node=1).start()
    yield cluster
    cluster.stop()
