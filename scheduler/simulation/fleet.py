"""What a fleet simulation takes and gives: the fleet, each request in, each request's record out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel


class SimulatedRequest(Protocol):
    """One request of a workload (``kvserve.experiments.workloads.WorkloadRequest`` is one).

    ``output_token_ids``, when given, are the tokens the simulated model
    samples (a multi-turn workload puts them in the next turn's prompt);
    otherwise tokens are synthetic.  ``output_len`` tokens are generated,
    EOS ignored.
    """

    @property
    def arrival_time(self) -> float: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_len(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def output_token_ids(self) -> Sequence[int] | None: ...


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The simulated fleet: ``num_replicas`` identical replicas."""

    num_replicas: int
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    cost_model: StepCostModel
    vocab_size: int = 32_000

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {self.num_replicas!r}")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {self.vocab_size}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request; times in virtual seconds."""

    index: int
    arrival_time: float
    first_token_time: float
    finish_time: float
    replica_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time

