"""``kvserve.client``: the Python client of a kvserve server (see ``kvserve.cluster.client``)."""

from kvserve.cluster.client import (
    AsyncClient,
    Client,
    Completion,
    CompletionDelta,
    ReplicaStats,
    RequestError,
    SamplingKwargs,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "CompletionDelta",
    "ReplicaStats",
    "RequestError",
    "SamplingKwargs",
    "Usage",
]
