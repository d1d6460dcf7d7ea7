"""A TP-2 replica on Ray, driven over gRPC, generates exactly what the in-process engine does."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from kvserve import LLM, SamplingParams
from kvserve.cluster.placement import PlacementError
from kvserve.cluster.replica_launcher import ReplicaHandle, launch_replica
from kvserve.cluster.worker_actor import RAY_NAMESPACE, worker_actor_name
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.request import Request
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.tiny_model import create_tiny_model
from kvserve.worker.worker_config import WorkerConfig

BLOCK_SIZE = 8
NUM_BLOCKS = 64
MAX_NUM_BATCHED_TOKENS = 32
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# The data path is under test here, not the kernels: the reference attention
# needs no build step in the worker processes.
ATTENTION_BACKEND = "torch"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    # One loop for the module: the replica's gRPC channels belong to it.
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=21)


@pytest.fixture(scope="module")
def replica(ray_cluster, model_dir: Path, loop: asyncio.AbstractEventLoop) -> Iterator[ReplicaHandle]:
    config = WorkerConfig(
        str(model_dir), tp_size=2, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, cpu_threads=1,
        attention_backend=ATTENTION_BACKEND,
    )
    handle = loop.run_until_complete(launch_replica(0, config, device_kind="cpu", step_timeout_s=30.0))
    yield handle
    loop.run_until_complete(handle.shutdown())


def make_scheduler(num_blocks: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=2048),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
    )


async def generate(handle: ReplicaHandle, prompts: list[list[int]]) -> list[list[int]]:
    scheduler = make_scheduler(handle.executor.num_kv_blocks)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"req-{i}", prompt, GREEDY))
    outputs: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        result = await handle.executor.execute(plan)
        for output in scheduler.update(plan, result.sampled_token_ids, result.logprobs):
            outputs[output.req_id].append(output.token_id)
    return list(outputs.values())


def test_tp2_replica_generates_the_greedy_tokens_of_the_in_process_engine(
    replica: ReplicaHandle, model_dir: Path, loop: asyncio.AbstractEventLoop
) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    tokens = loop.run_until_complete(generate(replica, prompts))
    with LLM(model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
             attention_backend=ATTENTION_BACKEND) as llm:
        expected = [output.token_ids for output in llm.generate(prompts, GREEDY)]
    assert replica.executor.num_kv_blocks == NUM_BLOCKS
    assert tokens == expected
    assert all(len(t) == GREEDY.max_tokens for t in tokens)


def test_rank_actors_are_found_by_name(replica: ReplicaHandle) -> None:
    for rank, actor in enumerate(replica.actors):
        found = ray.get_actor(worker_actor_name(0, rank), namespace=RAY_NAMESPACE)
        assert found._actor_id == actor._actor_id
        assert ray.get(found.ping.remote(), timeout=10) is True
    assert worker_actor_name(0, 1) == "kvserve-worker-r0-t1"


def test_unplaceable_replica_fails_naming_the_missing_resource(
    ray_cluster, model_dir: Path, loop: asyncio.AbstractEventLoop
) -> None:
    config = WorkerConfig(str(model_dir), tp_size=3, num_blocks=NUM_BLOCKS)
    with pytest.raises(PlacementError, match="needs 3 kvserve_worker_slot on one node .* largest node has 2"):
        loop.run_until_complete(launch_replica(9, config, device_kind="cpu", placement_timeout_s=1.0))


def test_a_launch_waiting_for_room_says_so_while_it_waits(
    ray_cluster, model_dir: Path, loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    # A restart waiting for a lost node to come back was silent until the node was back.
    config = WorkerConfig(str(model_dir), tp_size=3, num_blocks=NUM_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="kvserve.cluster.placement"), pytest.raises(PlacementError):
        loop.run_until_complete(
            launch_replica(9, config, device_kind="cpu", placement_timeout_s=1.0, report_waiting_every_s=0.3)
        )
    waiting = [r.getMessage() for r in caplog.records if r.name == "kvserve.cluster.placement"]
    assert len(waiting) >= 2, waiting
    assert all(m.startswith("replica 9: still waiting for room after ") for m in waiting)
    assert "needs 3 kvserve_worker_slot on one node" in waiting[0]
    assert """--resources '{"kvserve_worker_slot": N}'""" in waiting[0]  # pastes into `ray start` as JSON
    assert not [g for g in ray.util.placement_group_table().values() if g["name"] == "kvserve-replica-9"
                and g["state"] != "REMOVED"]


def test_starting_a_cluster_says_what_replicas_still_wait_for(ray_cluster, model_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    # Joining a cluster, placement waits without limit (an autoscaler may be
    # adding nodes): the front end said nothing while a replica that fits no node waited.
    from kvserve.cluster import launcher
    from kvserve.cluster.config import ClusterConfig
    from kvserve.scheduler.engine_config import ParallelConfig

    monkeypatch.setattr(launcher, "_STILL_WAITING_S", 0.5)
    config = ClusterConfig.from_kwargs(
        str(model_dir), parallel=ParallelConfig(tensor_parallel_size=4, num_replicas=1),
        num_blocks=NUM_BLOCKS, device="cpu", placement_timeout_s=2.0,
    )
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="the cluster failed to start"):
        launcher.start_cluster(config, progress=lines.append)

    waiting = [line for line in lines if line.startswith("still waiting for 1 of 1 replica(s) after ")]
    assert waiting and (
        "s: replica 0 waiting for resources: each needs 4 kvserve_worker_slot on one node (STRICT_PACK); "
        "the largest node has 2"
    ) in waiting[0]


def test_a_rendezvous_port_taken_before_rank_0_binds_it_starts_the_ranks_again(  # noqa: ANN001
    ray_cluster, model_dir: Path, loop: asyncio.AbstractEventLoop, monkeypatch, caplog
) -> None:
    # Seen under load: the port rank 0 chose was free, and another process bound it before rank 0's
    # torch.distributed store did (EADDRINUSE): the whole cluster failed to start.
    from kvserve.cluster import replica_launcher
    from kvserve.cluster.worker_actor import WorkerActor

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        class PortTaken(WorkerActor):
            async def rendezvous_address(self) -> str:
                return f"127.0.0.1:{port}"

        original, port_taken = replica_launcher._RemoteWorkerActor, ray.remote(PortTaken)
        made: list[str] = []

        class FirstRankZeroGetsATakenPort:
            @staticmethod
            def options(**options):  # noqa: ANN003, ANN205
                made.append(options["name"])
                return (port_taken if len(made) == 1 else original).options(**options)

        monkeypatch.setattr(replica_launcher, "_RemoteWorkerActor", FirstRankZeroGetsATakenPort)
        config = WorkerConfig(
            str(model_dir), tp_size=2, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, cpu_threads=1,
            attention_backend=ATTENTION_BACKEND,
        )
        with caplog.at_level(logging.WARNING, logger="kvserve.cluster.replica_launcher"):
            handle = loop.run_until_complete(launch_replica(7, config, device_kind="cpu", step_timeout_s=30.0))
    try:
        assert made == [worker_actor_name(7, 0), worker_actor_name(7, 1)] * 2  # the ranks, twice
        assert "replica 7: its rendezvous port was taken before rank 0 bound it (try 1 of 3)" in caplog.text
        tokens = loop.run_until_complete(generate(handle, [[5, 6, 7]]))
        with LLM(model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, attention_backend=ATTENTION_BACKEND) as llm:
            assert tokens == [llm.generate([[5, 6, 7]], GREEDY)[0].token_ids]
    finally:
        loop.run_until_complete(handle.shutdown())


def test_replica_that_fails_to_start_leaves_nothing_behind(
    ray_cluster, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    config = WorkerConfig(str(tmp_path / "no-such-model"), num_blocks=NUM_BLOCKS)
    with pytest.raises(ReplicaFailedError, match="replica 5 failed to start: .*no-such-model"):
        loop.run_until_complete(launch_replica(5, config, device_kind="cpu"))

    def actor_gone() -> bool:
        try:
            ray.get_actor(worker_actor_name(5, 0), namespace=RAY_NAMESPACE)
        except ValueError:
            return True
        return False

    def group_removed() -> bool:
        groups = ray.util.placement_group_table().values()
        return all(g["state"] == "REMOVED" for g in groups if g["name"] == "kvserve-replica-5")

    deadline = time.monotonic() + 10.0
    while not (actor_gone() and group_removed()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert actor_gone()
    assert group_removed()


def kill_and_wait_for_exit(actor: ray.actor.ActorHandle) -> None:
    """Kill ``actor`` and wait until its process is gone.

    NOTE: Ray reports the actor dead before its process has exited; until
    then the process's gRPC server may still answer a step.  ``ray.kill``
    returns before the kill is delivered, so a call made right after it may
    still run; only once the process is gone must every call fail.
    """
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while _process_alive(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"worker process {pid} still alive 30 s after ray.kill")
        time.sleep(0.05)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.ping.remote(), timeout=30)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_rank_fails_the_next_step_quickly_and_every_step_after(
    replica: ReplicaHandle, loop: asyncio.AbstractEventLoop
) -> None:
    scheduler = make_scheduler(NUM_BLOCKS)
    scheduler.add_request(Request("after-kill", [5, 6, 7, 8], GREEDY))
    victim = ray.get_actor(worker_actor_name(0, 1), namespace=RAY_NAMESPACE)
    loop.run_until_complete(replica.check_alive())  # every rank answers
    kill_and_wait_for_exit(victim)
    # Found without a step (as the scheduler actor checks an idle replica).
    with pytest.raises(ReplicaFailedError, match="replica 0 rank 1's worker died"):
        loop.run_until_complete(replica.check_alive())

    plan = scheduler.schedule()
    start = time.monotonic()
    with pytest.raises(ReplicaFailedError, match="replica 0 rank 1 failed at step 0: UNAVAILABLE"):
        loop.run_until_complete(replica.executor.execute(plan))
    assert time.monotonic() - start < 5.0
    assert replica.executor.failed
    with pytest.raises(ReplicaFailedError, match="rank 1 failed"):
        loop.run_until_complete(replica.executor.execute(plan))
