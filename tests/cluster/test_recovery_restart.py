"""Recovery of failed replicas: restarts that never give up, backoff across crash loops, the step
timeout's way from the config to every launch, and the metrics an operator alerts on.

The scheduler actor runs on fake replicas, without Ray; backoff constants are shrunk to milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.cluster import replica_restart
from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.messages import ReplicaStatsInfo, RequestSpec
from kvserve.cluster.metrics import FrontendMetrics
from kvserve.cluster.replica_restart import RestartBackoff, relaunch
from kvserve.cluster.scheduler_actor import SchedulerActor
from kvserve.scheduler.engine_config import ParallelConfig
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

TIMEOUT_S = 10.0


class Executor:
    """Samples token 7 for every row; a step waits while ``hold`` is clear.  ``died``: its workers are
    gone (its handle's ``check_alive`` says so)."""

    num_kv_blocks = 64

    def __init__(self) -> None:
        self.died = False
        self.hold = asyncio.Event()
        self.hold.set()
        self.num_steps_waiting = 0

    async def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps_waiting += 1
        try:
            await self.hold.wait()
        finally:
            self.num_steps_waiting -= 1
        return StepResult(plan.step_id, [7] * plan.num_sampled)

    async def launch(self, plan: StepPlan) -> SimpleNamespace:
        step = asyncio.ensure_future(self.execute(plan))
        return SimpleNamespace(result=lambda: step)

    async def shutdown(self) -> None:
        pass


class Cluster:
    """A scheduler actor of ``num_replicas`` fake replicas; ``failing_launches[r]`` launches of replica
    ``r`` fail before one starts; ``launches`` records each launch's keyword arguments."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, num_replicas: int = 1, **config: Any) -> None:
        self.executors = [Executor() for _ in range(num_replicas)]
        self.failing_launches = [0] * num_replicas
        self.launches: list[dict[str, Any]] = []
        monkeypatch.setattr("kvserve.cluster.scheduler_actor.launch_replica", self._launch)
        monkeypatch.setattr("kvserve.cluster.scheduler_actor.IDLE_CHECK_S", 0.01)
        self.actor = SchedulerActor(
            ClusterConfig.from_kwargs("m", parallel=ParallelConfig(num_replicas=num_replicas), block_size=8, **config),
            SimpleNamespace(model_dir="m", model_id="m", vocab_size=100, max_model_len=256, eos_token_ids=()),
        )

    async def _launch(self, replica_id: int, *args: Any, **kwargs: Any) -> SimpleNamespace:
        self.launches.append(kwargs)
        if self.failing_launches[replica_id]:
            self.failing_launches[replica_id] -= 1
            raise ReplicaFailedError(f"replica {replica_id} failed to start: no node")
        executor = self.executors[replica_id]

        async def check_alive() -> None:
            if executor.died:
                raise ReplicaFailedError(f"replica {replica_id} rank 0's worker died: test")

        async def shutdown() -> None:
            pass

        return SimpleNamespace(executor=executor, placement_group=None, shutdown=shutdown, check_alive=check_alive)

    async def stats(self, replica_id: int = 0) -> ReplicaStatsInfo:
        return (await self.actor.get_stats())[replica_id]

    async def until(self, replica_id: int, healthy: bool) -> ReplicaStatsInfo:
        async with asyncio.timeout(TIMEOUT_S):
            while (stats := await self.stats(replica_id)).healthy is not healthy:
                await asyncio.sleep(0.001)
        return stats


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restart delays of 1, 2, 4 then 8 ms at most; warnings for the first 2 failed tries."""
    monkeypatch.setattr(replica_restart, "RESTART_BACKOFF_S", 0.001)
    monkeypatch.setattr(replica_restart, "MAX_RESTART_BACKOFF_S", 0.008)
    monkeypatch.setattr(replica_restart, "MAX_RESTART_TRIES", 2)


# -- restarts ------------------------------------------------------------------------------------


def test_a_replica_is_started_again_past_max_restart_tries_once_a_launch_succeeds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fast_backoff: None
) -> None:
    async def scenario() -> tuple[ReplicaStatsInfo, ReplicaStatsInfo]:
        cluster = Cluster(monkeypatch)
        await cluster.actor.start_replica(0, "cpu")
        cluster.failing_launches[0] = 6  # three times MAX_RESTART_TRIES: a node that stays down a while
        cluster.executors[0].died = True
        down = await cluster.until(0, healthy=False)
        cluster.executors[0].died = False
        back = await cluster.until(0, healthy=True)
        await cluster.actor.shutdown()
        return down, back

    with caplog.at_level(logging.INFO, logger="kvserve.cluster"):
        down, back = asyncio.run(scenario())

    assert (down.num_failures, back.num_failures, back.num_restart_failures) == (1, 1, 6)
    failed_tries = [r.levelno for r in caplog.records if "to start again failed" in r.getMessage()]
    # A warning per try until MAX_RESTART_TRIES, one error then, and the tries go on quietly.
    assert failed_tries == [logging.WARNING, logging.ERROR] + [logging.INFO] * 4
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "still down" in r.getMessage()]
    assert "it keeps trying" in error and "every 0.008 s at most" in error


def test_the_restart_delay_doubles_after_each_failed_try_up_to_its_cap(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fast_backoff: None
) -> None:
    failures = iter(range(6))

    async def launch() -> SimpleNamespace:
        if next(failures, None) is not None:
            raise ReplicaFailedError("no node")
        return SimpleNamespace()

    with caplog.at_level(logging.INFO, logger="kvserve.cluster.replica_restart"):
        relaunched = asyncio.run(relaunch(3, launch, lambda: False, first_delay_s=0.001))

    assert relaunched is not None and (relaunched.attempt, relaunched.delay_s) == (7, 0.008)
    next_delays = [r.getMessage().split("next")[1] for r in caplog.records if "failed" in r.getMessage()]
    assert next_delays == [" try in 0.002 s", " in 0.004 s, then every 0.008 s at most, until it starts"] + [
        " try in 0.008 s"
    ] * 4


def test_shutdown_cancels_a_restart_waiting_for_its_next_try_at_once(
    monkeypatch: pytest.MonkeyPatch, fast_backoff: None
) -> None:
    monkeypatch.setattr(replica_restart, "MAX_RESTART_BACKOFF_S", 3600.0)

    async def scenario() -> tuple[float, int]:
        cluster = Cluster(monkeypatch)
        await cluster.actor.start_replica(0, "cpu")
        cluster.actor._replicas[0].backoff.last_delay_s = 1800.0  # crash-looping: its next try is an hour away
        cluster.executors[0].died = True
        await cluster.until(0, healthy=False)
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await cluster.actor.shutdown()
        return loop.time() - start, (await cluster.stats()).num_restart_failures

    shutdown_s, num_restart_failures = asyncio.run(scenario())
    assert shutdown_s < 1.0
    assert num_restart_failures == 0


def test_backoff_starts_from_the_base_unless_the_replica_failed_soon_after_it_came_back() -> None:
    base, cap, stable = replica_restart.RESTART_BACKOFF_S, replica_restart.MAX_RESTART_BACKOFF_S, 60.0
    assert replica_restart.STABLE_SERVICE_S == stable
    assert RestartBackoff().first_delay_s(served_s=0.0) == base  # never restarted: no crash loop yet
    assert RestartBackoff(last_delay_s=2.0).first_delay_s(served_s=stable - 1) == 4.0
    assert RestartBackoff(last_delay_s=cap).first_delay_s(served_s=0.0) == cap
    assert RestartBackoff(last_delay_s=cap).first_delay_s(served_s=stable) == base


def test_a_crash_looping_replica_waits_longer_each_time_and_a_stable_one_from_the_base_again(
    monkeypatch: pytest.MonkeyPatch, fast_backoff: None
) -> None:
    monkeypatch.setattr(replica_restart, "STABLE_SERVICE_S", 0.2)
    first_delays: list[float] = []

    async def recorded(*args: Any, first_delay_s: float, **kwargs: Any) -> Any:
        first_delays.append(first_delay_s)
        return await relaunch(*args, first_delay_s=first_delay_s, **kwargs)

    monkeypatch.setattr(replica_restart, "relaunch", recorded)

    async def scenario() -> None:
        cluster = Cluster(monkeypatch)
        await cluster.actor.start_replica(0, "cpu")
        cluster.executors[0].died = True  # and so does every replacement: it fails as soon as it is back
        async with asyncio.timeout(TIMEOUT_S):
            while len(first_delays) < 5:
                await asyncio.sleep(0.001)
        cluster.executors[0].died = False
        await cluster.until(0, healthy=True)
        await asyncio.sleep(0.3)  # serves longer than STABLE_SERVICE_S
        cluster.executors[0].died = True
        await cluster.until(0, healthy=False)
        cluster.executors[0].died = False
        await cluster.until(0, healthy=True)
        await cluster.actor.shutdown()

    asyncio.run(scenario())
    # Each restart's first try waits twice as long as the one that brought it back (capped)...
    assert first_delays[:5] == [0.001, 0.002, 0.004, 0.008, 0.008]
    # ... until it serves STABLE_SERVICE_S: its next failure starts from the base again.
    assert first_delays[-1] == 0.001


# -- the step timeout and the step-age gauge -----------------------------------------------------


def test_the_step_timeout_goes_from_the_config_to_every_launch_and_restart(
    monkeypatch: pytest.MonkeyPatch, fast_backoff: None
) -> None:
    async def scenario() -> list[dict[str, Any]]:
        cluster = Cluster(monkeypatch, step_timeout_s=7.5)
        await cluster.actor.start_replica(0, "cpu")
        cluster.failing_launches[0] = 1
        cluster.executors[0].died = True
        await cluster.until(0, healthy=False)
        cluster.executors[0].died = False
        await cluster.until(0, healthy=True)
        await cluster.actor.shutdown()
        return cluster.launches

    launches = asyncio.run(scenario())
    assert [launch["step_timeout_s"] for launch in launches] == [7.5, 7.5, 7.5]  # start, failed try, restart


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_replicas_step_age_grows_while_its_worker_hangs_and_is_0_once_it_answers(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    async def scenario() -> tuple[float, float, float, float]:
        cluster = Cluster(monkeypatch, async_scheduling=async_scheduling)
        await cluster.actor.start_replica(0, "cpu")
        idle = (await cluster.stats()).step_age_s
        executor = cluster.executors[0]
        executor.hold.clear()  # the worker hangs
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], params))
        async with asyncio.timeout(TIMEOUT_S):
            while not executor.num_steps_waiting:
                await asyncio.sleep(0.001)
        early = (await cluster.stats()).step_age_s
        await asyncio.sleep(0.05)
        hung = (await cluster.stats()).step_age_s
        executor.hold.set()
        async with asyncio.timeout(TIMEOUT_S):
            while not any(delta.is_last for delta in await cluster.actor.poll_outputs(TIMEOUT_S)):
                pass
            # NOTE: with async scheduling a step launched before the request ended may still be in flight.
            while (done := (await cluster.stats()).step_age_s) != 0.0:
                await asyncio.sleep(0.001)
        await cluster.actor.shutdown()
        return idle, early, hung, done

    idle, early, hung, done = asyncio.run(scenario())
    assert idle == 0.0
    assert 0.0 < early < hung
    assert hung >= 0.05
    assert done == 0.0


def test_metrics_export_the_step_age_and_the_failed_restart_tries_per_replica() -> None:
    metrics = FrontendMetrics()
    metrics.set_replica_stats([
        ReplicaStatsInfo(0, 1, 0, 0.5, 0.0, 64, True, step_age_s=3.5),
        ReplicaStatsInfo(1, 0, 0, 0.0, 0.0, 64, False, num_failures=1, num_restart_failures=4),
    ])
    text = metrics.exposition().decode()
    assert 'kvserve_replica_step_age_seconds{replica="0"} 3.5' in text
    assert 'kvserve_replica_step_age_seconds{replica="1"} 0.0' in text
    assert 'kvserve_replica_restart_failures_total{replica="0"} 0.0' in text
    assert 'kvserve_replica_restart_failures_total{replica="1"} 4.0' in text


# -- one error line per failure ------------------------------------------------------------------


def test_a_failure_is_one_error_line_with_its_cause_and_its_requests_fate(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fast_backoff: None
) -> None:
    async def failing_execute(plan: StepPlan) -> StepResult:
        raise ReplicaFailedError("replica 0 rank 0 failed at step 1: UNAVAILABLE: the rank ended its step stream")

    async def scenario() -> None:
        cluster = Cluster(monkeypatch, num_replicas=2, routing="round_robin")
        for replica_id in range(2):
            await cluster.actor.start_replica(replica_id, "cpu")
        monkeypatch.setattr(cluster.executors[0], "execute", failing_execute)
        # Which node was lost: GrpcReplicaExecutor's rank addresses.
        monkeypatch.setattr(cluster.executors[0], "addresses", ["10.0.0.5:40001", "10.0.0.5:40002"], raising=False)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], params))  # round robin: replica 0
        async with asyncio.timeout(TIMEOUT_S):
            while not any(delta.is_last for delta in await cluster.actor.poll_outputs(TIMEOUT_S)):
                pass
        await cluster.actor.shutdown()

    with caplog.at_level(logging.DEBUG, logger="kvserve"):
        asyncio.run(scenario())

    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        "replica 0 failed: replica 0 rank 0 failed at step 1: UNAVAILABLE: the rank ended its step stream "
        "(its ranks ran on 10.0.0.5); 1 of its requests moved to other replicas, 0 failed"
    ]
