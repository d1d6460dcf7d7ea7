"""A total outage: while no replica is available and one is starting again, requests wait for it in
the scheduler actor, up to ``max_queue_wait_s``; and an idle replica's liveness check holds up no work.

The scheduler actor runs on fake replicas, without Ray (``test_recovery_restart.Cluster``); a restart
waits until the test lets it through (``back``), and backoff constants are shrunk to milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvserve.cluster import replica_restart
from kvserve.cluster.messages import RequestDelta, RequestSpec
from kvserve.cluster.scheduler_actor import SchedulerActor
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from tests.cluster.test_recovery_restart import TIMEOUT_S, Cluster
from tests.cluster.test_routing import last_deltas

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class OutageCluster(Cluster):
    """A ``Cluster`` whose restarts wait for ``back`` (set by the test once it checked the outage),
    their backoff shrunk to 1 ms."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **config: Any) -> None:
        monkeypatch.setattr(replica_restart, "RESTART_BACKOFF_S", 0.001)
        self.back = asyncio.Event()
        super().__init__(monkeypatch, **config)

    async def _launch(self, replica_id: int, *args: Any, **kwargs: Any) -> SimpleNamespace:
        if self.launches:  # not the first start: a restart
            await self.back.wait()
        return await super()._launch(replica_id, *args, **kwargs)

    async def outage(self) -> None:
        """Start replica 0 and let its worker die while it is idle: it is down until ``back`` is set."""
        await self.actor.start_replica(0, "cpu")
        self.executors[0].died = True
        await self.until(0, healthy=False)
        self.executors[0].died = False  # the restarted workers are sound


def test_a_request_added_while_the_only_replica_is_down_waits_and_is_served_once_it_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> tuple[int | None, int, list[int], RequestDelta]:
        cluster = OutageCluster(monkeypatch)
        await cluster.outage()
        waiting = [(await cluster.actor.cluster_stats()).num_waiting_for_replica]
        added = await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], PARAMS))
        waiting.append((await cluster.actor.cluster_stats()).num_waiting_for_replica)
        while_down = len(await cluster.actor.poll_outputs(0.05))
        cluster.back.set()
        last = (await last_deltas(cluster.actor, {"r"}))["r"]
        waiting.append((await cluster.actor.cluster_stats()).num_waiting_for_replica)
        await cluster.actor.shutdown()
        return added, while_down, waiting, last

    added, while_down, waiting, last = asyncio.run(scenario())
    assert added is None  # it waits: no replica yet
    assert while_down == 0
    assert waiting == [0, 1, 0]  # kvserve_num_requests_waiting_for_replica's figure
    assert (last.error, last.finish_reason, last.replica) == (None, "length", 0)
    assert last.token_ids == [7] * 6 and last.num_output_tokens == 6


def test_a_request_moving_off_the_only_replica_waits_and_goes_on_without_a_gap_or_a_repeat(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> tuple[list[int], RequestDelta]:
        cluster = OutageCluster(monkeypatch)
        await cluster.actor.start_replica(0, "cpu")
        executor = cluster.executors[0]
        execute, num_steps = executor.execute, 0

        async def fails_at_step_3(plan: StepPlan) -> StepResult:
            nonlocal num_steps
            num_steps += 1
            if num_steps == 3:
                raise ReplicaFailedError("replica 0 rank 0 failed at step 3: test")
            return await execute(plan)

        monkeypatch.setattr(executor, "execute", fails_at_step_3)
        await cluster.actor.add_request(RequestSpec("moved", [1, 2, 3], PARAMS))
        await cluster.until(0, healthy=False)
        before: list[int] = []
        while (batch := await cluster.actor.poll_outputs(0.05)):  # its 2 tokens, then nothing while it waits
            before += [t for delta in batch for t in delta.token_ids]
        cluster.back.set()
        last = (await last_deltas(cluster.actor, {"moved"}))["moved"]
        await cluster.actor.shutdown()
        return before, last

    with caplog.at_level(logging.ERROR, logger="kvserve"):
        before, last = asyncio.run(scenario())

    assert before == [7, 7]
    assert (last.error, last.finish_reason, last.replica) == (None, "length", 0)
    # No token lost or repeated: 6 in all, counted as the request's own.
    assert len(before) + len(last.token_ids) == 6 and last.num_output_tokens == 6
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "replica 0 failed: replica 0 rank 0 failed at step 3: test; "
        "0 of its requests moved to other replicas, 1 wait for a replica, 0 failed"
    ]


def test_a_request_that_waited_max_queue_wait_s_for_a_replica_ends_with_an_error_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> tuple[RequestDelta, float]:
        cluster = OutageCluster(monkeypatch, max_queue_wait_s=0.05)
        await cluster.outage()
        added_at = time.monotonic()
        await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], PARAMS))
        last = (await last_deltas(cluster.actor, {"r"}))["r"]
        waited_s = time.monotonic() - added_at
        cluster.back.set()
        await cluster.actor.shutdown()
        return last, waited_s

    last, waited_s = asyncio.run(scenario())
    assert last.error is not None
    assert last.error.startswith("none of the 1 replicas is available; it waited 0.")
    assert last.error.endswith(" s for a replica")
    assert (last.token_ids, last.replica) == ([], None)  # no replica ever served it
    assert 0.05 <= waited_s < 1.0


def test_with_max_queue_wait_s_0_a_request_fails_at_once_while_no_replica_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> None:
        cluster = OutageCluster(monkeypatch, max_queue_wait_s=0)
        await cluster.outage()
        with pytest.raises(RuntimeError, match="none of the 1 replicas is available"):
            await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], PARAMS))
        cluster.back.set()
        await cluster.actor.shutdown()

    asyncio.run(scenario())


def test_an_aborted_waiting_request_gets_its_abort_delta_and_is_never_routed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> tuple[RequestDelta, int, tuple[int, int], RequestDelta]:
        cluster = OutageCluster(monkeypatch)
        await cluster.outage()
        await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], PARAMS))
        await cluster.actor.abort_requests(["r"])
        aborted = (await last_deltas(cluster.actor, {"r"}))["r"]
        cluster.back.set()
        back = await cluster.until(0, healthy=True)
        after_back = len(await cluster.actor.poll_outputs(0.05))
        # Its id is free again: a client's retry is served.
        await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], PARAMS))
        again = (await last_deltas(cluster.actor, {"r"}))["r"]
        await cluster.actor.shutdown()
        return aborted, after_back, (back.num_running, back.num_waiting), again

    aborted, after_back, queues, again = asyncio.run(scenario())
    assert (aborted.finish_reason, aborted.error, aborted.token_ids) == ("abort", None, [])
    assert after_back == 0
    assert queues == (0, 0)
    assert (again.error, again.token_ids) == (None, [7] * 6)


def test_shutdown_ends_the_requests_waiting_for_a_replica_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> list[RequestDelta]:
        cluster = OutageCluster(monkeypatch)
        await cluster.outage()
        for req_id in ("a", "b"):
            await cluster.actor.add_request(RequestSpec(req_id, [1, 2, 3], PARAMS))
        await cluster.actor.shutdown()
        return list(await cluster.actor.poll_outputs(0.0))

    deltas = asyncio.run(scenario())
    assert sorted((delta.req_id, delta.error) for delta in deltas) == [
        ("a", "the cluster is shutting down"), ("b", "the cluster is shutting down")
    ]


# -- an idle replica's liveness check ------------------------------------------------------------


class HangingCheckCluster(Cluster):
    """A ``Cluster`` whose replicas' liveness checks hang, as a ping of a hung worker waits ~10 s."""

    num_checks = 0

    async def _launch(self, replica_id: int, *args: Any, **kwargs: Any) -> SimpleNamespace:
        handle = await super()._launch(replica_id, *args, **kwargs)

        async def check_alive() -> None:
            self.num_checks += 1
            await asyncio.sleep(10 * TIMEOUT_S)

        handle.check_alive = check_alive
        return handle


def test_a_request_added_while_an_idle_check_hangs_is_stepped_at_once_and_checks_do_not_pile_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> tuple[float, RequestDelta, int]:
        cluster = HangingCheckCluster(monkeypatch)  # an idle check every 10 ms
        await cluster.actor.start_replica(0, "cpu")
        async with asyncio.timeout(TIMEOUT_S):
            while not cluster.num_checks:
                await asyncio.sleep(0.001)
        added_at = time.monotonic()
        await cluster.actor.add_request(RequestSpec("r", [1, 2, 3], PARAMS))
        last = (await last_deltas(cluster.actor, {"r"}))["r"]
        served_s = time.monotonic() - added_at
        await asyncio.sleep(0.1)  # idle again for several check intervals, the first check still pending
        num_checks = cluster.num_checks
        await cluster.actor.shutdown()
        return served_s, last, num_checks

    served_s, last, num_checks = asyncio.run(scenario())
    assert (last.error, last.token_ids) == (None, [7] * 6)
    assert served_s < 1.0
    assert num_checks == 1


def test_requests_that_waited_are_routed_in_arrival_order_a_moved_one_before_newer_ones() -> None:
    # A request moving off a failed replica starts waiting after newer ones that arrived meanwhile;
    # when a replica is back it goes first, as it arrived first.
    from kvserve.cluster.replica_wait_queue import ReplicaWaitQueue
    from kvserve.scheduler.request import Request

    async def scenario() -> list[str]:
        routed: list[str] = []
        queue = ReplicaWaitQueue(30.0, route=lambda request: routed.append(request.req_id) or 0,
                                 end=lambda entry, error: None)
        queue.add(Request("newer", [1, 2, 3], PARAMS, arrival_time=2.0), "no replica is available")
        queue.add(Request("moved", [1, 2, 3], PARAMS, arrival_time=1.0), "replica 1 failed", replica=1)
        queue.add(Request("newest", [1, 2, 3], PARAMS, arrival_time=3.0), "no replica is available")
        queue.route_all()
        assert len(queue) == 0
        queue.end_all("the cluster is shutting down")  # stops its timer
        return routed

    assert asyncio.run(scenario()) == ["moved", "newer", "newest"]
