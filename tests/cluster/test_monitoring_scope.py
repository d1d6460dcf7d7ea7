"""--monitoring-tenant: only the named tenants' tokens read the cluster-wide figures (GetStats, /metrics),
and the figures of each tenant (which tenants there are, what each caches).

Any tenant's token could read every replica's load and the cluster's request counts.  The front
end runs in process over the fake scheduler of test_frontend_streaming; HTTP through the real app.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from kvserve.cli import main
from kvserve.cluster.auth import TokenTable
from kvserve.cluster.frontend import Frontend
from kvserve.cluster.messages import ClusterStatsInfo, ReplicaStatsInfo
from kvserve.cluster.openai_api import create_app
from kvserve.proto import generate_pb2
from tests.cluster.test_frontend_streaming import MODEL_INFO, Aborted, FakeContext, FakeScheduler, _Remote

OPS, TEAM_B = "ops-token-0123456789", "team-b-token-0123456789"
TOKENS = TokenTable({OPS: "ops", TEAM_B: "team-b"})
STATS = [ReplicaStatsInfo(0, 1, 2, 0.5, 0.25, 64, True, num_failures=1, cached_blocks_by_tenant={"ops": 3, "team-b": 5})]
TENANT_FIGURES = 'kvserve_tenant_cached_blocks{replica="0",tenant="team-b"} 5.0'


class StatsScheduler(FakeScheduler):
    def __init__(self) -> None:
        super().__init__()

        async def get_stats() -> list[ReplicaStatsInfo]:
            return STATS

        async def cluster_stats() -> ClusterStatsInfo:
            return ClusterStatsInfo("round_robin", {"miss": 3}, num_waiting_for_replica=2)

        self.get_stats = _Remote(get_stats)
        self.cluster_stats = _Remote(cluster_stats)


class MetadataContext(FakeContext):
    def __init__(self, token: str | None) -> None:
        self._metadata = () if token is None else (("authorization", f"Bearer {token}"),)

    def invocation_metadata(self):
        return self._metadata


def with_frontend(scenario, monitoring_tenants: frozenset[str]):
    async def run():
        frontend = Frontend(
            StatsScheduler(), MODEL_INFO, None, max_concurrent_requests=4, tokens=TOKENS,
            monitoring_tenants=monitoring_tenants,
        )
        frontend.start()
        try:
            return await scenario(frontend)
        finally:
            await frontend.stop()

    return asyncio.run(run())


def test_get_stats_answers_only_the_monitoring_tenants() -> None:
    async def scenario(frontend: Frontend):
        ops = await frontend.GetStats(generate_pb2.GetStatsRequest(), MetadataContext(OPS))
        with pytest.raises(Aborted) as refused:
            await frontend.GetStats(generate_pb2.GetStatsRequest(), MetadataContext(TEAM_B))
        return ops, refused.value

    ops, refused = with_frontend(scenario, frozenset({"ops"}))
    assert [(s.num_running, s.num_failures) for s in ops.replicas] == [(1, 1)]
    assert refused.code == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant 'team-b' may not read the cluster's monitoring figures" in str(refused)


def test_metrics_answer_only_the_monitoring_tenants_over_http() -> None:
    async def scenario(frontend: Frontend):
        app = create_app(frontend, max_body_bytes=1 << 20, max_choices=4)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            return [
                await client.get("/metrics", headers={} if token is None else {"Authorization": f"Bearer {token}"})
                for token in (OPS, TEAM_B, None)
            ]

    ops, team_b, anonymous = with_frontend(scenario, frozenset({"ops"}))
    assert ops.status_code == 200 and 'kvserve_replica_failures_total{replica="0"} 1.0' in ops.text
    assert TENANT_FIGURES in ops.text
    assert "kvserve_num_requests_waiting_for_replica 2.0" in ops.text
    assert 'kvserve_routing_decisions_total{outcome="miss",policy="round_robin"} 3.0' in ops.text
    assert team_b.status_code == 403 and team_b.json()["error"]["type"] == "permission_error"
    assert anonymous.status_code == 401


def test_without_monitoring_tenants_every_tenant_reads_them() -> None:
    async def scenario(frontend: Frontend):
        return await frontend.GetStats(generate_pb2.GetStatsRequest(), MetadataContext(TEAM_B))

    assert len(with_frontend(scenario, frozenset()).replicas) == 1


def test_serve_refuses_a_monitoring_tenant_the_token_file_does_not_have_or_no_token_file(capsys, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{OPS} ops\n{TEAM_B} team-b\n")
    tokens.chmod(0o600)
    assert main(["serve", "--auth-token-file", str(tokens), "--monitoring-tenant", "opz"]) == 2
    assert "--monitoring-tenant: no token of the auth token file is of tenant 'opz'; its tenants: ops, team-b" in (
        capsys.readouterr().err
    )
    assert main(["serve", "--monitoring-tenant", "ops"]) == 2
    assert "--monitoring-tenant needs an auth token file" in capsys.readouterr().err


def test_time_to_first_token_buckets_reach_past_the_longest_wait_for_a_replica() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.cluster.config import ClusterConfig
    from kvserve.cluster.metrics import FrontendMetrics

    metrics = FrontendMetrics()
    metrics.time_to_first_token.observe(25.0)  # waited out most of a total outage
    family = next(
        f for f in text_string_to_metric_families(metrics.exposition().decode())
        if f.name == "kvserve_time_to_first_token_seconds"
    )
    bounds = {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    default_wait_s = ClusterConfig.from_kwargs("/models/m").max_queue_wait_s
    assert max(b for b in bounds if b != float("inf")) >= default_wait_s
    assert bounds[30.0] == 1 and bounds[20.0] == 0


def test_without_monitoring_tenants_every_tenant_reads_the_cluster_figures_but_no_ones_per_tenant() -> None:
    # They told any tenant the others' names and how much each caches, prompt after prompt.
    async def scenario(frontend: Frontend):
        app = create_app(frontend, max_body_bytes=1 << 20, max_choices=4)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            return await client.get("/metrics", headers={"Authorization": f"Bearer {TEAM_B}"})

    metrics = with_frontend(scenario, frozenset())
    assert metrics.status_code == 200 and 'kvserve_replica_failures_total{replica="0"} 1.0' in metrics.text
    assert "kvserve_tenant_cached_blocks" not in metrics.text
