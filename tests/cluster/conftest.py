"""One Ray cluster of two simulated nodes, shared by every test under tests/cluster.

Use it by naming the fixture: ``def test_x(ray_cluster): ...``.  The driver
is connected (namespace ``kvserve``) for the whole session; each node offers
1 CPU and 2 ``WORKER_CPU_RESOURCE`` slots, so a TP-2 CPU replica fits on
either node.  Everything binds to 127.0.0.1 and token authentication is on (``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# NOTE: loopback and token authentication are set for the whole session in tests/conftest.py,
# before any test module imports Ray (which reads them once, at import).

LOOPBACK = "127.0.0.1"
NUM_NODES = 2
WORKER_SLOTS_PER_NODE = 2


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """A running ``ray.cluster_utils.Cluster`` (head + 1 worker node) with the driver connected."""
    import ray
    from ray._raylet import AuthenticationMode, get_authentication_mode
    from ray.cluster_utils import Cluster

    from kvserve.cluster.launcher import join_ray
    from kvserve.cluster.worker_actor import WORKER_CPU_RESOURCE

    node_args = dict(num_cpus=1, resources={WORKER_CPU_RESOURCE: WORKER_SLOTS_PER_NODE}, node_ip_address=LOOPBACK)
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    try:
        for _ in range(NUM_NODES - 1):
            cluster.add_node(**node_args)
        # As `kvserve serve --address HOST:PORT` joins a cluster.
        join_ray(cluster.address)
        if get_authentication_mode() != AuthenticationMode.TOKEN:
            pytest.fail("the test cluster runs without token authentication")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
