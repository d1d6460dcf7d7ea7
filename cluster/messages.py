"""Dataclasses crossing the front end ↔ scheduler actor boundary (over Ray).

The front end tokenizes and validates; the scheduler actor routes, schedules
and streams back ``OutputBatch``es of ``RequestDelta``s, one ``poll_outputs``
call per batch of steps (never one remote call per token).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A validated, tokenized request, ready to be routed.

    ``tenant``: the name of the authenticated caller's tenant (``None`` without an auth
    token file); its requests' cached blocks count against its share of the cache
    (``tenant_cache_share``).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """New tokens of one request since its previous delta.

    The last delta of a request has ``finish_reason`` set ("stop", "length",
    "abort") or ``error`` set (its replica failed: the front end answers
    ``UNAVAILABLE``); only the last one carries the usage counts
    (``num_prompt_tokens``, ``num_cached_tokens``, ``num_output_tokens``).
    ``logprobs`` parallels ``token_ids`` when the request asked for them, else it is ``None``.
    ``prompt_logprobs`` is set on the one delta that carries the request's first output token, when
    it asked for them (``SamplingParams.prompt_logprobs``): one entry per prompt token, the first
    ``None`` (nothing predicts it; ``kvserve.scheduler.prompt_logprobs.first_output_prompt_logprobs``).
    """

    req_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # The replica that served the request; None when none did (the server lost its scheduler).
    replica: int | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def __reduce__(self) -> tuple[type[RequestDelta], tuple[object, ...]]:
        # NOTE: one delta per request per poll crosses Ray: pickling the fields
        # as a tuple is several times faster than a slotted dataclass's
        # default __getstate__/__setstate__.
        return (
            RequestDelta,
            (
                self.req_id,
                self.token_ids,
                self.finish_reason,
                self.error,
                self.num_prompt_tokens,
                self.num_cached_tokens,
                self.num_output_tokens,
                self.replica,
                self.logprobs,
                self.prompt_logprobs,
            ),
        )


@dataclass(frozen=True, slots=True)
class OutputBatch:
    """What one ``poll_outputs`` returns: a delta per request, as columns.

    A request still running has its new tokens at index ``i`` of the parallel
    lists ``req_ids``, ``token_ids`` and ``replicas``, and, if it asked for
    them, their logprobs in ``logprobs`` under its id (and its prompt's, with its first token, in
    ``prompt_logprobs``); a request that ended is
    one whole ``RequestDelta`` in ``last_deltas`` (its last tokens included).
    Each request appears once.  Iterating yields every delta.

    NOTE: a poll carries hundreds of requests: Ray pickles a few lists in tens
    of microseconds, the same deltas as objects in about a millisecond.
    """

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    replicas: list[int | None] = field(default_factory=list)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    last_deltas: list[RequestDelta] = field(default_factory=list)
    # How many replicas were healthy when the batch was taken (None: not reported).
    num_healthy_replicas: int | None = None

    @classmethod
    def from_deltas(cls, deltas: Iterable[RequestDelta], *, num_healthy_replicas: int | None = None) -> OutputBatch:
        batch = cls(num_healthy_replicas=num_healthy_replicas)
        for delta in deltas:
            if delta.is_last:
                batch.last_deltas.append(delta)
            else:
                batch.req_ids.append(delta.req_id)
                batch.token_ids.append(delta.token_ids)
                batch.replicas.append(delta.replica)
                if delta.logprobs is not None:
                    batch.logprobs[delta.req_id] = delta.logprobs
                if delta.prompt_logprobs is not None:
                    batch.prompt_logprobs[delta.req_id] = delta.prompt_logprobs
        return batch

    def __len__(self) -> int:
        return len(self.req_ids) + len(self.last_deltas)

    def __iter__(self) -> Iterator[RequestDelta]:
        logprobs, prompt_logprobs = self.logprobs, self.prompt_logprobs
        for req_id, token_ids, replica in zip(self.req_ids, self.token_ids, self.replicas, strict=True):
            yield RequestDelta(
                req_id, token_ids, replica=replica, logprobs=logprobs.get(req_id),
                prompt_logprobs=prompt_logprobs.get(req_id),
            )
        yield from self.last_deltas


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the front end needs to know of the served model (``simulated``: its replicas have no model)."""

    model_dir: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_replicas: int
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class ClusterStatsInfo:
    """The scheduler's cluster-wide figures: the routing policy, the requests it routed by outcome
    (hit / partial / miss), and how many requests wait for a replica to come back (none can take
    them now: see ``replica_wait_queue``)."""

    routing_policy: str
    routing_outcomes: dict[str, int]
    num_waiting_for_replica: int


@dataclass(frozen=True, slots=True)
class ReplicaStatsInfo:
    replica: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_kv_blocks: int
    healthy: bool
    # Counters since the cluster started (a restarted replica goes on from its predecessor's):
    # preempted requests, prompt tokens looked up in its prefix cache and found there, and the
    # times it failed (and was started again: an outage between two scrapes of /metrics shows here),
    # and the tries to start it again that failed.
    num_preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_failures: int = 0
    num_restart_failures: int = 0
    # How long its oldest step in flight has been running (0.0 when none is): a hung worker's grows
    # until the step timeout fails the replica.
    step_age_s: float = 0.0
    # With a tenant_cache_share: each tenant's cached blocks on it (those that have any); else empty.
    cached_blocks_by_tenant: dict[str, int] = field(default_factory=dict)
