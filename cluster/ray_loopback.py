"""Keeping a single-machine Ray cluster on 127.0.0.1.

On Linux, Ray replaces "127.0.0.1" with the host's routable address wherever
it resolves an address (``ray.init(_node_ip_address="127.0.0.1")`` included),
so a local instance listens on the network and a driver cannot reach nodes
started with ``node_ip_address="127.0.0.1"``.  Ray keeps loopback addresses
only when told the machine is not part of a multi-host cluster, with the
environment variable set here.
"""

from __future__ import annotations

import os
import sys

_SINGLE_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> None:
    """Make this process, and every Ray process it starts, bind and connect to 127.0.0.1.

    Call it before ``ray.init`` (or ``ray.cluster_utils.Cluster``) in a
    process that runs a single-machine cluster; never on a multi-host one.
    """
    os.environ[_SINGLE_HOST_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        # NOTE: Ray reads the variable once, at import; it was imported already.
        constants.ENABLE_RAY_CLUSTER = False
