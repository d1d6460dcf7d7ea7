"""Placement of one replica's ranks: a ``STRICT_PACK`` placement group, one bundle per rank.

All ranks of a replica share one node (tensor parallelism needs the fast
intra-node link).  A GPU rank takes ``{"GPU": 1}``; a CPU rank takes one
``WORKER_CPU_RESOURCE`` slot, so that tests and CPU-only deployments decide
how many ranks a node hosts.  Bundles ask for no CPU: a rank's threads are
sized by the worker itself, and a 2-core test machine must fit two replicas.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from kvserve.cluster.worker_actor import WORKER_CPU_RESOURCE

logger = logging.getLogger(__name__)

DEFAULT_PLACEMENT_TIMEOUT_S = 60.0


class DeviceKind(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"


class PlacementError(RuntimeError):
    """The cluster has no node with room for every rank of a replica."""


def rank_bundle(device_kind: DeviceKind) -> dict[str, float]:
    """The resources of one rank."""
    if device_kind is DeviceKind.GPU:
        return {"GPU": 1.0}
    return {WORKER_CPU_RESOURCE: 1.0}


async def place_replica(
    replica_id: int,
    tp_size: int,
    device_kind: DeviceKind,
    timeout_s: float | None = DEFAULT_PLACEMENT_TIMEOUT_S,
    *,
    report_every_s: float | None = None,
) -> PlacementGroup:
    """Reserve one node's resources for ``tp_size`` ranks; ``PlacementError`` after ``timeout_s``.

    ``timeout_s=None`` waits as long as it takes, e.g. while an autoscaler
    starts the GPU nodes the group needs.  ``report_every_s``: while it waits, a
    WARNING this often saying for how long and what it needs (a restart waiting
    for a lost node to come back is otherwise silent).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    bundles = replica_bundles(tp_size, device_kind)
    group = placement_group(bundles, strategy="STRICT_PACK", name=f"kvserve-replica-{replica_id}")
    ready = asyncio.ensure_future(group.ready())
    start = time.monotonic()
    try:
        while True:
            left_s = None if timeout_s is None else start + timeout_s - time.monotonic()
            wait_s = min((s for s in (left_s, report_every_s) if s is not None), default=None)
            done, _ = await asyncio.wait({ready}, timeout=None if wait_s is None else max(wait_s, 0.0))
            if done:
                ready.result()
                return group
            if left_s is not None and time.monotonic() - start >= timeout_s:
                raise PlacementError(
                    f"replica {replica_id} could not be placed within {timeout_s:g} s: "
                    f"{describe_shortfall(bundles)}"
                )
            logger.warning(
                "replica %d: still waiting for room after %.0f s: %s", replica_id, time.monotonic() - start,
                describe_shortfall(bundles),
            )
    except BaseException:
        ready.cancel()
        remove_placement_group(group)
        raise


def replica_bundles(tp_size: int, device_kind: DeviceKind) -> list[dict[str, float]]:
    """The bundles of one replica's placement group: one per rank."""
    return [rank_bundle(device_kind) for _ in range(tp_size)]


def describe_shortfall(bundles: list[dict[str, float]]) -> str:
    """What a replica of ``bundles`` needs on one node, against what the cluster's nodes have."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    wanted = ", ".join(f"{amount:g} {name}" for name, amount in sorted(needed.items()))
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    best = {
        name: max((node["Resources"].get(name, 0.0) for node in nodes), default=0.0) for name in needed
    }
    largest = ", ".join(f"{best[name]:g} {name}" for name in sorted(needed))
    available = ray.available_resources()
    free = ", ".join(f"{available.get(name, 0.0):g} {name}" for name in sorted(needed))
    return (
        f"it needs {wanted} on one node (STRICT_PACK); the largest node has {largest} in all, "
        f"and {free} are free cluster-wide"
        + (f" (start CPU nodes with: ray start ... --resources '{{\"{WORKER_CPU_RESOURCE}\": N}}')"
           if WORKER_CPU_RESOURCE in needed else "")
    )
