"""Routing in the cluster: the policy by name (config, CLI), the scheduler actor's router, live routing.

The actor's tests run it on fake replicas, without Ray; one live test starts 2
real replicas on the session's Ray cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from kvserve.cli import build_parser, main
from kvserve.cluster.config import ClusterConfig
from kvserve.scheduler.engine_config import ParallelConfig
from kvserve.cluster.launcher import ClusterHandle, start_cluster
from kvserve.cluster.messages import ReplicaStatsInfo, RequestDelta, RequestSpec
from kvserve.cluster.log_format import show_logs
from kvserve.cluster.scheduler_actor import SchedulerActor
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy
from kvserve.scheduler.routing.policies import DEFAULT_POLICY, POLICIES
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from kvserve.worker.tiny_model import create_tiny_model

BLOCK_SIZE = 8
# Small steps, so that a prompt's uncached tokens cost several of them.
MAX_NUM_BATCHED_TOKENS = 64
TIMEOUT_S = 60.0

# -- configuration ------------------------------------------------------------------


def test_config_routes_with_the_default_policy_unless_told() -> None:
    config = ClusterConfig.from_kwargs("m")

    assert config.routing == DEFAULT_POLICY == "cost_ttft"
    assert config.routing_args == {}


def test_config_accepts_every_registered_policy_with_its_arguments() -> None:
    for name in POLICIES:
        assert ClusterConfig.from_kwargs("m", routing=name).routing_policy().name == name
    policy = ClusterConfig.from_kwargs("m", routing="cache_aware", routing_args={"cache_threshold": 0.5}).routing_policy()
    assert policy.cache_threshold == 0.5


def test_cost_ttft_prices_steps_with_the_clusters_token_budget_unless_told() -> None:
    config = ClusterConfig.from_kwargs("m", max_num_batched_tokens=512)
    told = ClusterConfig.from_kwargs("m", max_num_batched_tokens=512, routing_args={"max_num_batched_tokens": 4096})

    assert isinstance(policy := config.routing_policy(), CostTTFTPolicy)
    assert policy.max_num_batched_tokens == 512
    assert told.routing_policy().max_num_batched_tokens == 4096


def test_config_rejects_an_unknown_routing_policy_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"routing: unknown routing policy 'random': choose from cache_aware, .*round_robin"):
        ClusterConfig.from_kwargs("m", routing="random")


@pytest.mark.parametrize(
    "routing, routing_args, message",
    [
        ("cost_ttft", {"no_such_arg": 1}, "routing_args: bad arguments for routing policy 'cost_ttft'.*no_such_arg"),
        ("cache_aware", {"cache_threshold": 2.0}, "routing_args: cache_threshold must be a finite number >= 0 and <= 1"),
        ("round_robin", {"seed": 3}, "routing_args: bad arguments for routing policy 'round_robin'"),
        ("least_loaded", ["seed"], "routing_args must be a dict"),
    ],
)
def test_config_rejects_a_bad_routing_argument_at_construction(routing, routing_args, message) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_kwargs("m", routing=routing, routing_args=routing_args)


def test_config_keeps_its_own_copy_of_the_routing_arguments() -> None:
    routing_args = {"cache_threshold": 0.5}
    config = ClusterConfig.from_kwargs("m", routing="cache_aware", routing_args=routing_args)
    routing_args["cache_threshold"] = 7.0

    assert config.routing_args == {"cache_threshold": 0.5}


# -- the command line -----------------------------------------------------------------


def test_serve_rejects_an_unknown_routing_policy(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--routing", "random"])

    assert exit_info.value.code == 2
    assert "argument --routing: unknown routing policy 'random'" in capsys.readouterr().err


def test_serve_reads_routing_arguments_as_literals() -> None:
    args = build_parser().parse_args(
        ["serve", "--routing", "cache_aware", "--routing-arg", "cache_threshold=0.5", "--routing-arg", "x= None"]
    )

    assert args.routing == "cache_aware"
    assert args.routing_args == [("cache_threshold", 0.5), ("x", None)]
    assert build_parser().parse_args(["serve"]).routing == DEFAULT_POLICY


@pytest.mark.parametrize(
    "args, message",
    [
        (["--routing-arg", "cache_threshold"], "expected KEY=VALUE"),
        (
            ["--routing", "cache_aware", "--routing-arg", "cache_threshold=2"],
            "cache_threshold must be a finite number >= 0 and <= 1",
        ),
        (["--routing-arg", "load_slack=1", "--routing-arg", "load_slack=2"], "given more than once"),
    ],
)
def test_serve_rejects_a_bad_routing_argument_before_starting_anything(capsys, args, message) -> None:
    try:
        status = main(["serve", *args])
    except SystemExit as exit_info:  # argparse's own errors
        status = exit_info.code
    assert status == 2
    assert message in capsys.readouterr().err


# -- the scheduler actor's router, on fake replicas (no Ray, no model) -------------------------


class FakeExecutor:
    """Samples token 7 for every row; raises ``ReplicaFailedError`` once told to fail.

    ``died``: its workers are gone (its handle's ``check_alive`` says so) without a step failing.
    """

    num_kv_blocks = 128

    def __init__(self) -> None:
        self.failed = False
        self.died = False

    async def execute(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0)
        if self.failed:
            raise ReplicaFailedError("the worker died")
        return StepResult(plan.step_id, [7] * plan.num_sampled)

    async def shutdown(self) -> None:
        pass


def fake_actor(
    monkeypatch: pytest.MonkeyPatch, routing: str, **config: Any
) -> tuple[SchedulerActor, list[FakeExecutor]]:
    executors = [FakeExecutor(), FakeExecutor()]

    async def launch_replica(replica_id: int, *args, **kwargs) -> SimpleNamespace:
        async def shutdown() -> None:
            pass

        async def check_alive() -> None:
            if executors[replica_id].died:
                raise ReplicaFailedError(f"replica {replica_id} rank 0's worker died: test")

        return SimpleNamespace(
            executor=executors[replica_id], placement_group=None, shutdown=shutdown, check_alive=check_alive
        )

    monkeypatch.setattr("kvserve.cluster.scheduler_actor.launch_replica", launch_replica)
    config = ClusterConfig.from_kwargs(
        "m",
        parallel=ParallelConfig(num_replicas=2),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        routing=routing,
        **config,
    )
    model = SimpleNamespace(model_dir="m", model_id="m", vocab_size=1000, max_model_len=1024, eos_token_ids=())
    return SchedulerActor(config, model), executors


async def run_to_the_end(actor: SchedulerActor, req_id: str, prompt: list[int]) -> RequestDelta:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    await actor.add_request(RequestSpec(req_id, prompt, params))
    while True:
        for delta in await actor.poll_outputs(TIMEOUT_S):
            if delta.req_id == req_id and delta.is_last:
                return delta


def test_the_actor_routes_to_started_replicas_only(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        actor, _ = fake_actor(monkeypatch, "round_robin")
        with pytest.raises(RuntimeError, match="none of the 2 replicas is available"):
            await actor.add_request(RequestSpec("early", [1, 2, 3], SamplingParams()))
        await actor.start_replica(1, "cpu")
        replicas = [(await run_to_the_end(actor, f"r{k}", [1, 2, 3])).replica for k in range(3)]
        await actor.shutdown()
        assert replicas == [1, 1, 1]

    asyncio.run(scenario())


def test_the_actor_sends_a_shared_prefix_to_its_cache_and_forgets_a_failed_replicas_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = list(range(5, 5 + 10 * BLOCK_SIZE))

    async def scenario() -> None:
        actor, executors = fake_actor(monkeypatch, "cost_ttft")
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        first = await run_to_the_end(actor, "first", prefix + [1])
        second = await run_to_the_end(actor, "second", prefix + [2, 3])
        assert second.replica == first.replica
        assert second.num_cached_tokens == 10 * BLOCK_SIZE
        index = actor._router.index  # what the router knows of the replicas' caches
        assert index.num_blocks(first.replica) > 0
        # The other replica serves another prompt: an empty replica would take a copy of the prefix,
        # now shared (the second request's match ended where the third's does).
        other = await run_to_the_end(actor, "other", list(range(900, 900 + 4 * BLOCK_SIZE)) + [1])
        assert other.replica == 1 - first.replica

        executors[first.replica].failed = True
        moved = await run_to_the_end(actor, "moved", prefix + [4])
        # Its step failed on the prefix's replica; it moved to the other, which computed the prefix.
        assert (moved.replica, moved.error) == (1 - first.replica, None)
        assert index.num_blocks(first.replica) == 0
        elsewhere = await run_to_the_end(actor, "elsewhere", prefix + [5])
        await actor.shutdown()
        assert (elsewhere.replica, elsewhere.num_cached_tokens) == (1 - first.replica, 10 * BLOCK_SIZE)

    asyncio.run(scenario())


def test_a_request_s_tenant_owns_the_blocks_it_caches_on_its_replica_also_after_moving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvserve.cluster.replica_restart.RESTART_BACKOFF_S", 0.01)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def scenario() -> list[dict[str, int]]:
        actor, executors = fake_actor(monkeypatch, "round_robin", tenant_cache_share=0.5)
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        executors[0].failed = True  # round robin: replica 0, whose step fails; the request moves
        await actor.add_request(RequestSpec("a", list(range(1, 1 + 3 * BLOCK_SIZE + 1)), params, tenant="alice"))
        last = (await last_deltas(actor, {"a"}))["a"]
        assert (last.replica, last.error) == (1, None)
        pools = [actor._replicas[r].scheduler.kv_cache_manager.block_pool for r in range(2)]
        cached = [pool.cached_blocks_by_tenant() for pool in pools]
        await actor.shutdown()
        return cached

    assert asyncio.run(scenario()) == [{}, {"alice": 3}]


async def last_deltas(actor: SchedulerActor, req_ids: set[str]) -> dict[str, RequestDelta]:
    """Every request's last delta, with every token the request got."""
    last: dict[str, RequestDelta] = {}
    tokens: dict[str, list[int]] = {}
    async with asyncio.timeout(TIMEOUT_S):
        while set(last) != req_ids:
            for delta in await actor.poll_outputs(TIMEOUT_S):
                tokens.setdefault(delta.req_id, []).extend(delta.token_ids)
                if delta.is_last:
                    last[delta.req_id] = dataclasses.replace(delta, token_ids=tokens[delta.req_id])
    return last


def test_every_request_of_a_failed_replica_moves_to_the_other_and_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prompts of a whole step's budget: a replica computes one per step, the rest wait.
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def scenario() -> dict[str, RequestDelta]:
        actor, executors = fake_actor(monkeypatch, "round_robin")
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        executors[0].failed = True
        # Nothing awaits in between: all six are queued before any step runs.
        for k in range(6):
            prompt = [100 * k + i + 1 for i in range(MAX_NUM_BATCHED_TOKENS)]
            await actor.add_request(RequestSpec(f"r{k}", prompt, params))
        deltas = await last_deltas(actor, {f"r{k}" for k in range(6)})
        stats = await actor.get_stats()
        await actor.shutdown()
        assert [s.healthy for s in stats] == [False, True]
        assert (stats[1].num_running, stats[1].num_waiting) == (0, 0)
        return deltas

    deltas = asyncio.run(scenario())
    # Round robin sent r0, r2, r4 to replica 0; its first step (r0's prompt) failed; all moved.
    for req_id, delta in deltas.items():
        assert (delta.error, delta.replica, delta.token_ids) == (None, 1, [7, 7]), req_id
        assert delta.finish_reason == "length"


def test_a_stream_moved_mid_way_goes_on_from_its_last_token_and_the_replica_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvserve.cluster.replica_restart.RESTART_BACKOFF_S", 0.01)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[list[int], RequestDelta, list[bool], RequestDelta]:
        actor, executors = fake_actor(monkeypatch, "round_robin")
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        await actor.add_request(RequestSpec("moved", [1, 2, 3], params))
        tokens: list[int] = []
        while len(tokens) < 2:  # two tokens from replica 0, then it fails
            for delta in await actor.poll_outputs(TIMEOUT_S):
                tokens.extend(delta.token_ids)
        executors[0].failed = True
        last = (await last_deltas(actor, {"moved"}))["moved"]
        executors[0].failed = False  # the restarted workers are sound
        for _ in range(200):
            healthy = [s.healthy for s in await actor.get_stats()]
            if all(healthy):
                break
            await asyncio.sleep(0.01)
        after = await run_to_the_end(actor, "after", [4, 5, 6])
        await actor.shutdown()
        return tokens, last, healthy, after

    tokens, last, healthy, after = asyncio.run(scenario())
    assert last.error is None and last.finish_reason == "length" and last.replica == 1
    # No token lost or repeated: 6 in all, counted as the request's own.
    assert len(tokens) + len(last.token_ids) >= 6 and last.num_output_tokens == 6
    assert last.num_prompt_tokens == 3
    assert healthy == [True, True]
    assert after.error is None


def test_a_replica_started_again_says_so_and_keeps_its_prefix_cache_counters_and_hit_rate(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An operator saw the failure as an error; the end of the incident is a warning, not a silent INFO.
    monkeypatch.setattr("kvserve.cluster.replica_restart.RESTART_BACKOFF_S", 0.01)
    monkeypatch.setattr("kvserve.cluster.scheduler_actor.IDLE_CHECK_S", 0.05)
    prefix = list(range(5, 5 + 4 * BLOCK_SIZE))

    async def scenario() -> tuple[list[int], ReplicaStatsInfo, list[ReplicaStatsInfo]]:
        actor, executors = fake_actor(monkeypatch, "round_robin")
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        replicas = [(await run_to_the_end(actor, req_id, prefix + [k])).replica for k, req_id in enumerate("abc")]
        [before, _] = await actor.get_stats()
        executors[0].died = True
        while (await actor.get_stats())[0].healthy:  # found dead by an idle check
            await asyncio.sleep(0.01)
        executors[0].died = False  # the restarted workers are sound
        for _ in range(200):
            after = await actor.get_stats()
            if all(s.healthy for s in after):
                break
            await asyncio.sleep(0.01)
        await actor.shutdown()
        return replicas, before, after

    with caplog.at_level(logging.INFO, logger="kvserve.cluster"):
        replicas, before, after = asyncio.run(scenario())

    assert replicas == [0, 1, 0]  # round robin: c found a's prefix on replica 0
    hit_rate = (4 * BLOCK_SIZE) / (2 * (4 * BLOCK_SIZE + 1))
    assert before.prefix_cache_hit_rate == pytest.approx(hit_rate)
    assert after[0].healthy
    assert (after[0].prefix_cache_queried_tokens, after[0].prefix_cache_hit_tokens) == (
        before.prefix_cache_queried_tokens, before.prefix_cache_hit_tokens
    )
    assert after[0].prefix_cache_hit_rate == pytest.approx(hit_rate)
    # Counted once, and only for the replica that failed: /metrics shows the outage after it ended.
    assert (before.num_failures, after[0].num_failures, after[1].num_failures) == (0, 1, 0)
    back = [r for r in caplog.records if "replica 0 is back in service (try 1, " in r.getMessage()]
    assert [r.levelno for r in back] == [logging.WARNING]


def test_the_actor_tells_which_starting_replicas_are_placed_and_loading_their_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A replica loading a large model for minutes was reported as if it waited for resources.
    loaded = asyncio.Event()

    async def launch_replica(replica_id: int, *args, on_placed, **kwargs) -> SimpleNamespace:
        on_placed()
        await loaded.wait()

        async def shutdown() -> None:
            pass

        return SimpleNamespace(executor=FakeExecutor(), placement_group=None, shutdown=shutdown)

    async def scenario() -> tuple[list[int], list[int]]:
        actor, _ = fake_actor(monkeypatch, "round_robin")
        monkeypatch.setattr("kvserve.cluster.scheduler_actor.launch_replica", launch_replica)
        starting = asyncio.create_task(actor.start_replica(1, "cpu"))
        while not await actor.placed_replicas():
            await asyncio.sleep(0)
        while_loading = await actor.placed_replicas()
        loaded.set()
        await starting
        once_started = await actor.placed_replicas()
        await actor.shutdown()
        return while_loading, once_started

    assert asyncio.run(scenario()) == ([1], [])


def test_the_actor_writes_its_log_lines_at_the_servers_level_with_time_and_level(
    capfd: pytest.CaptureFixture[str],
) -> None:
    package = logging.getLogger("kvserve")
    kept = (package.level, package.handlers[:], package.propagate)
    try:
        show_logs(logging.INFO)
        logging.getLogger("kvserve.cluster.scheduler_actor").info("replica 3: starting again (try 1 of 5)")
        logging.getLogger("kvserve.cluster.scheduler_actor").debug("one step's detail")
    finally:
        for handler in package.handlers[len(kept[1]):]:
            package.removeHandler(handler)
        package.setLevel(kept[0])
        package.propagate = kept[2]

    [line] = capfd.readouterr().err.splitlines()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO kvserve.cluster.scheduler_actor: "
        r"replica 3: starting again \(try 1 of 5\)",
        line,
    ), line


def test_a_request_that_broke_replicas_as_often_as_it_may_move_ends_with_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It may move no more: the replica it was computed on fails, and it ends there although the other is up.
    monkeypatch.setattr("kvserve.cluster.scheduler_actor.MAX_MOVES_PER_REQUEST", 0)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[RequestDelta, RequestDelta]:
        actor, executors = fake_actor(monkeypatch, "round_robin")
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        executors[0].failed = True
        await actor.add_request(RequestSpec("poison", [1, 2, 3], params))  # round robin: replica 0
        last = (await last_deltas(actor, {"poison"}))["poison"]
        after = await run_to_the_end(actor, "after", [4, 5, 6])
        await actor.shutdown()
        return last, after

    last, after = asyncio.run(scenario())
    assert last.error is not None and "it had moved 0 times already" in last.error
    assert (after.error, after.replica) == (None, 1)


def test_a_request_too_big_for_the_replica_is_refused_and_the_next_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> RequestDelta:
        actor, _ = fake_actor(monkeypatch, "cost_ttft")
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        huge = SamplingParams(max_tokens=10 * FakeExecutor.num_kv_blocks * BLOCK_SIZE)
        with pytest.raises(ValueError, match="sampling_params.max_tokens: request needs up to"):
            await actor.add_request(RequestSpec("huge", list(range(1, 81)), huge))
        served = await run_to_the_end(actor, "fits", list(range(1, 81)))
        await actor.shutdown()
        return served

    served = asyncio.run(scenario())
    assert served.error is None and served.finish_reason == "length"


def test_an_idle_replica_whose_workers_died_is_found_without_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvserve.cluster.scheduler_actor.IDLE_CHECK_S", 0.05)

    async def scenario() -> tuple[list[bool], int | None, RequestDelta]:
        actor, executors = fake_actor(monkeypatch, "round_robin")
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        executors[0].died = True
        await asyncio.sleep(0.3)  # a few idle checks
        healthy = [s.healthy for s in await actor.get_stats()]
        batch = await actor.poll_outputs(0.0)
        served = await run_to_the_end(actor, "after", [1, 2, 3])
        await actor.shutdown()
        return healthy, batch.num_healthy_replicas, served

    healthy, num_healthy, served = asyncio.run(scenario())
    assert healthy == [False, True]
    assert num_healthy == 1
    assert (served.error, served.replica) == (None, 1)


def test_a_queued_request_with_no_replica_left_ends_with_an_error_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def scenario() -> dict[str, RequestDelta]:
        # Requests do not wait for the replica starting again (tests/cluster/test_recovery_outage.py).
        actor, executors = fake_actor(monkeypatch, "round_robin", max_queue_wait_s=0)
        await actor.start_replica(0, "cpu")
        executors[0].failed = True
        for k in range(2):
            prompt = [100 * k + i + 1 for i in range(MAX_NUM_BATCHED_TOKENS)]
            await actor.add_request(RequestSpec(f"r{k}", prompt, params))
        deltas = await last_deltas(actor, {"r0", "r1"})
        await actor.shutdown()
        return deltas

    deltas = asyncio.run(scenario())
    for req_id in ("r0", "r1"):  # r0 was being computed, r1 queued: neither had another replica to go to
        assert "replica 0 failed" in deltas[req_id].error
        assert "no other replica took it: none of the 2 replicas is available" in deltas[req_id].error


# -- live: 2 replicas routed by cost_ttft ------------------------------------------------


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    model_dir: Path = create_tiny_model(tmp_path_factory.mktemp("routing-model"), "llama", seed=0)
    config = ClusterConfig.from_kwargs(
        str(model_dir),
        parallel=ParallelConfig(tensor_parallel_size=1, num_replicas=2),
        block_size=BLOCK_SIZE,
        num_blocks=128,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        device="cpu",
        routing="cost_ttft",
    )
    handle = start_cluster(config)
    try:
        yield handle
    finally:
        handle.shutdown()


def add(handle: ClusterHandle, req_id: str, prompt: list[int], max_tokens: int) -> int:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return ray.get(handle.scheduler.add_request.remote(RequestSpec(req_id, prompt, params)), timeout=TIMEOUT_S)


def wait_for_last_delta(handle: ClusterHandle, req_id: str) -> RequestDelta:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for delta in ray.get(handle.scheduler.poll_outputs.remote(1.0), timeout=TIMEOUT_S):
            if delta.req_id == req_id and delta.is_last:
                return delta
    pytest.fail(f"request {req_id} did not finish in {TIMEOUT_S} s")


def test_a_prompt_sharing_a_long_prefix_goes_to_the_replica_that_cached_it(cluster: ClusterHandle) -> None:
    prefix = [(7 * i) % 900 + 5 for i in range(40 * BLOCK_SIZE)]
    first = add(cluster, "first", prefix + [11, 12, 13], max_tokens=2)
    done = wait_for_last_delta(cluster, "first")
    assert (done.replica, done.num_cached_tokens) == (first, 0)
    # A long request keeps a replica busy, whichever it lands on: when it is the
    # cached one, load balancing alone would send the next request elsewhere.
    add(cluster, "busy", [3] * 50, max_tokens=500)

    second = add(cluster, "second", prefix + [21, 22, 23, 24], max_tokens=2)
    done = wait_for_last_delta(cluster, "second")
    ray.get(cluster.scheduler.abort_requests.remote(["busy"]), timeout=TIMEOUT_S)

    assert second == first == done.replica
    assert done.num_cached_tokens == 40 * BLOCK_SIZE
