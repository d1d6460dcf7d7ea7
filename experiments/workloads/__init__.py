"""Seeded synthetic workloads and trace replay for routing experiments.

Every generator returns ``WorkloadRequest``s sorted by arrival time, and the
same arguments always give the same requests.  Content (prompts, lengths)
never depends on the arrival rate, so a QPS sweep replays one request stream.
"""

from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.registry import WORKLOADS, make_workload
from kvserve.experiments.workloads.tokens import TokenSegments

__all__ = ["WORKLOADS", "TokenSegments", "WorkloadRequest", "make_workload"]
