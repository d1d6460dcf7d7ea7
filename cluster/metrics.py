"""Prometheus metrics of the front end, served at ``GET /metrics`` on the HTTP port.

Request metrics are measured where both front doors meet, on the request
pipeline (``track`` wraps ``Frontend.responses`` for a gRPC call,
``track_choices`` the ``n`` pipelines of one HTTP request): every request
counts once in ``kvserve_requests_total{code}`` with the HTTP status it is
answered with (200, 400, 404, 413, 429, 503; 499 when the client left first,
504 when a gRPC call's deadline passed first (or was within ``frontend.DEADLINE_SLACK_S`` of it: the
client's clock starts first);
the HTTP API counts those it refuses before the pipeline itself), and a
served request adds its prompt and generated tokens, as its ``usage`` counts
them, and its latencies (time to first token, time per output token after
the first, end to end).  The replica gauges are
the scheduler's own figures, read at each scrape (``GetStats``), and so are its
counters (preemptions, prefix-cache queried and hit tokens per replica; routing
decisions by policy and outcome: the chosen replica held all of the prompt a
cache can serve, part of it, or none; a request moved off a failed replica is
routed, and looked up, again), exposed as the counters they are.  A replica
started again after a failure goes on from its predecessor's counters.  For
recovery: ``kvserve_replica_healthy``, the failures and the restart tries that
failed per replica, ``kvserve_replica_step_age_seconds``, how long a
replica's oldest step in flight has run (a hung worker's grows until the step
timeout fails it: alert well below ``--step-timeout``), and
``kvserve_num_requests_waiting_for_replica``, requests held while no replica can
take them (every replica is down; they fail after ``--max-queue-wait``).  The figures
per tenant (``kvserve_tenant_cached_blocks``) are in the exposition only for the
readers that may see them (``kvserve.cluster.access``).

Each ``FrontendMetrics`` has its own registry, so that two servers in one
process (tests) do not share counters.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.cluster.frontend_errors import FrontendError
from kvserve.cluster.messages import ClusterStatsInfo, ReplicaStatsInfo
from kvserve.proto import generate_pb2

__all__ = ["CONTENT_TYPE_LATEST", "FrontendMetrics"]

# Client-closed request (nginx's convention): the call or connection ended before the answer.
CLIENT_LEFT = "499"
# A gRPC call's deadline passed before its answer ended (gRPC's DEADLINE_EXCEEDED, HTTP's
# gateway timeout): the server was too slow for the client, which did not just leave.
DEADLINE_PASSED = "504"
_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# A first token can wait for a replica to come back, up to --max-queue-wait (30 s by default).
_TTFT_BUCKETS_S = _LATENCY_BUCKETS_S + (20.0, 30.0, 60.0)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class FrontendMetrics:
    """The front end's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "kvserve_requests", "Requests answered, by HTTP status code", ["code"], registry=registry
        )
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens of served requests", registry=registry)
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated for served requests", registry=registry
        )
        self.time_to_first_token = Histogram(
            "kvserve_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=_TTFT_BUCKETS_S, registry=registry,
        )
        self.inter_token_latency = Histogram(
            "kvserve_inter_token_latency_seconds", "Time per output token after the first",
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "kvserve_e2e_request_latency_seconds", "From a request's arrival to its last token",
            buckets=_E2E_BUCKETS_S, registry=registry,
        )
        self.num_requests_running = Gauge(
            "kvserve_num_requests_running", "Requests running on a replica", ["replica"], registry=registry
        )
        self.num_requests_waiting = Gauge(
            "kvserve_num_requests_waiting", "Requests waiting on a replica", ["replica"], registry=registry
        )
        self.kv_cache_usage = Gauge(
            "kvserve_kv_cache_usage_ratio", "Fraction of a replica's KV blocks in use", ["replica"],
            registry=registry,
        )
        self.replica_healthy = Gauge(
            "kvserve_replica_healthy", "1 while a replica serves, 0 once it failed", ["replica"], registry=registry
        )
        self.replica_step_age = Gauge(
            "kvserve_replica_step_age_seconds",
            "How long a replica's oldest step in flight has been running, 0 when none is: a hung worker's "
            "grows until the step timeout fails the replica",
            ["replica"], registry=registry,
        )
        self.num_requests_waiting_for_replica = Gauge(
            "kvserve_num_requests_waiting_for_replica",
            "Requests waiting in the scheduler for a replica to come back (none can take them now); "
            "each fails after --max-queue-wait", registry=registry,
        )
        self._scheduler_counters = _SchedulerCounters()
        registry.register(self._scheduler_counters)
        self._tenant_registry = CollectorRegistry()
        self._tenant_registry.register(_TenantFigures(self._scheduler_counters))

    async def track(
        self, responses: AsyncIterator[generate_pb2.GenerateResponse],
        deadline_passed: Callable[[], bool] | None = None,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """``responses``, measured as a request of one choice: one gRPC call's pipeline, closed when this is.
        Closed before its end, it counts as 499, or 504 if ``deadline_passed()`` says the call expired."""
        measure = _RequestMeasure(self, 1)
        try:
            async with aclosing(responses):
                async for response in responses:
                    measure.observe(0, response)
                    yield response
        except FrontendError as exc:
            measure.code = str(exc.http_status)
            raise
        finally:
            if measure.code == CLIENT_LEFT and deadline_passed is not None and deadline_passed():
                measure.code = DEADLINE_PASSED
            self.count_request(measure.code)

    async def track_choices(
        self, choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]], num_choices: int
    ) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
        """``choices`` (each message with its choice's index, ``openai_choices.interleave``), measured as one
        request: counted once, with its prompt once (as its usage counts it) and the tokens of every choice;
        its first token is the first of any choice, its end the end of the last one.  Closed when this is."""
        measure = _RequestMeasure(self, num_choices)
        try:
            async with aclosing(choices):
                async for index, response in choices:
                    measure.observe(index, response)
                    yield index, response
        except FrontendError as exc:
            measure.code = str(exc.http_status)
            raise
        finally:
            self.count_request(measure.code)

    def count_request(self, code: int | str) -> None:
        """One request answered with the HTTP status ``code``; ``track`` counts those it measures."""
        self.requests.labels(code=str(code)).inc()

    def set_replica_stats(self, stats: Sequence[ReplicaStatsInfo]) -> None:
        for s in stats:
            replica = str(s.replica)
            self.num_requests_running.labels(replica=replica).set(s.num_running)
            self.num_requests_waiting.labels(replica=replica).set(s.num_waiting)
            self.kv_cache_usage.labels(replica=replica).set(s.kv_cache_usage)
            self.replica_healthy.labels(replica=replica).set(1 if s.healthy else 0)
            self.replica_step_age.labels(replica=replica).set(s.step_age_s)
        self._scheduler_counters.replica_stats = list(stats)

    def set_cluster_stats(self, stats: ClusterStatsInfo) -> None:
        """The scheduler's cluster-wide figures, as of this scrape."""
        self.num_requests_waiting_for_replica.set(stats.num_waiting_for_replica)
        self._scheduler_counters.routing = (stats.routing_policy, dict(stats.routing_outcomes))

    def exposition(self, *, per_tenant: bool = False) -> bytes:
        """The metrics in Prometheus' text format; those of each tenant only if ``per_tenant`` (a reader
        ``Access.may_read_tenants`` lets see them)."""
        text = generate_latest(self.registry)
        return text + generate_latest(self._tenant_registry) if per_tenant else text


class _RequestMeasure:
    """One request's latencies and tokens as its messages come (``FrontendMetrics.track``); ``code`` is the
    HTTP status it is counted with: 200 once every choice ended, 499 until then (the client left)."""

    __slots__ = ("metrics", "num_choices", "arrival", "last_token_times", "num_ended", "code")

    def __init__(self, metrics: FrontendMetrics, num_choices: int) -> None:
        self.metrics = metrics
        self.num_choices = num_choices
        self.arrival = time.monotonic()
        self.last_token_times: dict[int, float] = {}  # each choice that has tokens: when its latest came
        self.num_ended = 0
        self.code = CLIENT_LEFT

    def observe(self, index: int, response: generate_pb2.GenerateResponse) -> None:
        """Choice ``index``'s next message."""
        metrics = self.metrics
        num_tokens = len(response.token_ids)
        if num_tokens:
            now = time.monotonic()
            previous = self.last_token_times.get(index)
            if previous is None:
                # NOTE: tokens that came with a choice's first one tell no interval.
                if not self.last_token_times:
                    metrics.time_to_first_token.observe(now - self.arrival)
            else:
                # A message carries the tokens of several steps: each took its share.
                per_token = (now - previous) / num_tokens
                for _ in range(num_tokens):
                    metrics.inter_token_latency.observe(per_token)
            self.last_token_times[index] = now
        if response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self.num_ended += 1
            if self.num_ended == 1:
                metrics.prompt_tokens.inc(response.usage.prompt_tokens)
            metrics.generation_tokens.inc(response.usage.completion_tokens)
            if self.num_ended == self.num_choices:
                self.code = "200"
                metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)


class _SchedulerCounters:
    """A collector of the scheduler's counters, as last read: they are counted there, not here."""

    def __init__(self) -> None:
        self.replica_stats: list[ReplicaStatsInfo] = []
        self.routing: tuple[str, dict[str, int]] | None = None

    def collect(self):
        families = {
            "kvserve_preemptions": ("Requests preempted (recomputed later) on a replica", "num_preemptions"),
            "kvserve_prefix_cache_queries_tokens": (
                "Tokens looked up in a replica's prefix cache: prompts, and the outputs so far of requests "
                "computed again (preempted, or moved off a failed replica)", "prefix_cache_queried_tokens",
            ),
            "kvserve_prefix_cache_hits_tokens": (
                "Prompt tokens found in a replica's prefix cache", "prefix_cache_hit_tokens",
            ),
            "kvserve_replica_failures": (
                "Times a replica failed and was taken out of service (it is then started again): "
                "an outage shorter than the scrape interval shows here, not in kvserve_replica_healthy",
                "num_failures",
            ),
            "kvserve_replica_restart_failures": (
                "Tries to start a failed replica again that failed (it keeps trying, with backoff)",
                "num_restart_failures",
            ),
        }
        for name, (documentation, field) in families.items():
            family = CounterMetricFamily(name, documentation, labels=["replica"])
            for s in self.replica_stats:
                family.add_metric([str(s.replica)], getattr(s, field))
            yield family
        routing = CounterMetricFamily(
            "kvserve_routing_decisions", "Requests routed, by policy and by how much of the prompt the chosen "
            "replica held (hit: all a cache can serve, partial, miss); a request moved off a failed replica "
            "is routed again", labels=["policy", "outcome"],
        )
        if self.routing is not None:
            policy, outcomes = self.routing
            for outcome in ("hit", "partial", "miss"):
                routing.add_metric([policy, outcome], outcomes.get(outcome, 0))
        yield routing


class _TenantFigures:
    """A collector of the figures per tenant, from the scheduler's counters as last read: in a
    registry of their own, as only some readers may see them (``kvserve.cluster.access``)."""

    def __init__(self, counters: _SchedulerCounters) -> None:
        self.counters = counters

    def collect(self):
        tenants = GaugeMetricFamily(
            "kvserve_tenant_cached_blocks", "KV blocks a tenant's requests cached on a replica, in use or free "
            "(with --tenant-cache-share; a tenant over that share of the replica's blocks is evicted first)",
            labels=["replica", "tenant"],
        )
        for s in self.counters.replica_stats:
            for tenant, num_blocks in sorted(s.cached_blocks_by_tenant.items()):
                tenants.add_metric([str(s.replica), tenant], num_blocks)
        yield tenants
