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
from kvserve.scheduler.logprobs import TokenLogprobs

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "CompletionDelta",
    "ReplicaStats",
    "RequestError",
    "SamplingKwargs",
    "TokenLogprobs",
    "Usage",
]
