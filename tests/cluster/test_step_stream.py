"""The step protocol's stream between a ``GrpcReplicaExecutor`` and StepWorker servers, without Ray.

The ranks here are ``StepRunner`` stand-ins served in this process, so that
a slow or failing step can be staged exactly.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import grpc
import pytest

from kvserve.cluster.grpc_auth import bearer_metadata
from kvserve.cluster.replica_client import MAX_STEPS_IN_FLIGHT, STEPS_AHEAD, GrpcReplicaExecutor
from kvserve.cluster.step_codec import decode_result, encode_plan
from kvserve.cluster.step_servicer import start_step_server
from kvserve.proto import step_pb2, step_pb2_grpc
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import NewRequestData, StepPlan
from kvserve.scheduler.step_result import StepResult
from tests.scheduler.simulation.test_simulated_executor import make_scheduler

NUM_BLOCKS = 32
WORKER_THREAD = "rank-worker"
SECRET = "a-replica-secret-for-the-tests"
AUTH = bearer_metadata(SECRET)


def plan(step_id: int) -> StepPlan:
    return StepPlan(
        step_id=step_id,
        req_ids=["a", "b"],
        num_scheduled_tokens=[2, 1],
        num_computed_tokens=[0, 4],
        token_ids=[step_id, 7, 8],
        num_new_block_ids=[1, 0],
        new_block_ids=[3],
        sample=[True, True],
        new_requests=[NewRequestData("a", SamplingParams(max_tokens=4), 2)] if step_id == 0 else [],
        finished_req_ids=[],
        preempted_req_ids=[],
    )


class Rank:
    """A rank without a model: answers each plan with its first token id, after ``execute_hook``."""

    def __init__(self, sample: bool, execute_hook: Callable[[StepPlan], None] | None = None) -> None:
        self.sample = sample
        self.execute_hook = execute_hook
        self.plans: list[StepPlan] = []
        self.threads: set[str] = set()  # the names of the threads that called it
        self.shut_down = False

    def determine_num_blocks(self) -> int:
        self.threads.add(threading.current_thread().name)
        return NUM_BLOCKS

    def initialize_cache(self, num_blocks: int) -> None:
        self.threads.add(threading.current_thread().name)

    def execute(self, plan: StepPlan) -> StepResult | None:
        self.threads.add(threading.current_thread().name)
        if self.execute_hook is not None:
            self.execute_hook(plan)
        self.plans.append(plan)
        if not self.sample:
            return None
        return StepResult(plan.step_id, [plan.token_ids[0]] * plan.num_sampled)

    def shutdown(self) -> None:
        self.threads.add(threading.current_thread().name)
        self.shut_down = True


@asynccontextmanager
async def replica(*ranks: Rank, step_timeout_s: float = 10.0) -> AsyncIterator[GrpcReplicaExecutor]:
    servers = []
    threads = []
    for rank in ranks:
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_THREAD)
        server, address = await start_step_server(rank, thread, "127.0.0.1", secret=SECRET)
        servers.append((server, address))
        threads.append(thread)
    executor = GrpcReplicaExecutor(
        0, [address for _, address in servers], secret=SECRET, step_timeout_s=step_timeout_s
    )
    try:
        await executor.initialize_cache()
        yield executor
    finally:
        await executor.shutdown()
        for server, _ in servers:
            await server.stop(None)
        for thread in threads:
            thread.shutdown(wait=False, cancel_futures=True)


def test_every_step_reaches_every_rank_in_order_and_rank_0_answers() -> None:
    ranks = [Rank(sample=True), Rank(sample=False)]

    async def scenario() -> list[StepResult]:
        async with replica(*ranks) as executor:
            return [await executor.execute(plan(i)) for i in range(20)]

    results = asyncio.run(scenario())
    assert [r.step_id for r in results] == list(range(20))
    assert [r.sampled_token_ids for r in results] == [[i, i] for i in range(20)]
    for rank in ranks:
        assert [p.step_id for p in rank.plans] == list(range(20))
        assert rank.plans[0].new_requests == plan(0).new_requests
        assert rank.shut_down


def test_every_call_into_a_rank_runs_on_its_one_worker_thread() -> None:
    rank = Rank(sample=True)

    async def scenario() -> None:
        async with replica(rank) as executor:
            for i in range(5):
                await executor.execute(plan(i))

    asyncio.run(scenario())
    assert rank.threads == {f"{WORKER_THREAD}_0"}


def test_a_step_past_its_deadline_fails_the_replica_and_every_step_after() -> None:
    release = threading.Event()
    rank = Rank(sample=True, execute_hook=lambda p: p.step_id == 1 and release.wait(10))

    async def scenario() -> None:
        async with replica(rank, step_timeout_s=0.3) as executor:
            await executor.execute(plan(0))
            start = time.monotonic()
            with pytest.raises(ReplicaFailedError, match=r"replica 0 did not answer step 1 within 0.3 s"):
                await executor.execute(plan(1))
            assert time.monotonic() - start < 2.0
            assert executor.failed
            release.set()
            with pytest.raises(ReplicaFailedError, match="did not answer step 1"):
                await executor.execute(plan(2))

    asyncio.run(scenario())


def test_a_steps_deadline_runs_while_the_ranks_work_on_it_not_while_it_waits_behind_others() -> None:
    # Each step takes 0.2 s of a 0.5 s deadline; the third, sent with the first, is answered
    # some 0.6 s after its sending: in time, since the ranks worked on it for 0.2 s.
    rank = Rank(sample=True, execute_hook=lambda p: time.sleep(0.2))

    async def scenario() -> list[StepResult]:
        async with replica(rank, step_timeout_s=0.5) as executor:
            start = time.monotonic()
            launched = [await executor.launch(plan(step)) for step in range(MAX_STEPS_IN_FLIGHT)]
            results = [await step.result() for step in launched]
            assert time.monotonic() - start >= 0.2 * MAX_STEPS_IN_FLIGHT > 0.5
            assert not executor.failed
            return results

    assert [r.step_id for r in asyncio.run(scenario())] == list(range(MAX_STEPS_IN_FLIGHT))


def test_a_failing_step_is_internal_and_fails_the_replica() -> None:
    def fail_step_3(p: StepPlan) -> None:
        if p.step_id == 3:
            raise RuntimeError("out of blocks")

    rank = Rank(sample=True, execute_hook=fail_step_3)

    async def scenario() -> None:
        async with replica(rank) as executor:
            for i in range(3):
                await executor.execute(plan(i))
            with pytest.raises(
                ReplicaFailedError, match="replica 0 rank 0 failed at step 3: INTERNAL: RuntimeError: out of blocks"
            ):
                await executor.execute(plan(3))
            with pytest.raises(ReplicaFailedError, match="failed at step 3"):
                await executor.execute(plan(4))

    asyncio.run(scenario())


def test_a_failing_rank_of_two_fails_the_replica_naming_it() -> None:
    def fail(p: StepPlan) -> None:
        raise ValueError("bad shard")

    ranks = [Rank(sample=True), Rank(sample=False, execute_hook=fail)]

    async def scenario() -> None:
        async with replica(*ranks) as executor:
            failure = "replica 0 rank 1 failed at step 0: INTERNAL: ValueError: bad shard"
            with pytest.raises(ReplicaFailedError, match=failure):
                await executor.execute(plan(0))

    asyncio.run(scenario())


# What gloo raised on the surviving rank when the other rank of its replica died (torch 2.13).
GLOO_PEER_GONE = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26771. "
    "This is typically caused by a remote worker crashing."
)


def failed_step_records(caplog, exception: Exception) -> list:
    def fail(p: StepPlan) -> None:
        raise exception

    async def scenario() -> None:
        async with replica(Rank(sample=True, execute_hook=fail)) as executor:
            with pytest.raises(ReplicaFailedError):
                await executor.execute(plan(0))

    with caplog.at_level("DEBUG", logger="kvserve.cluster.step_servicer"):
        asyncio.run(scenario())
    return [r for r in caplog.records if r.name == "kvserve.cluster.step_servicer" and "execute failed" in r.getMessage()]


def test_a_rank_whose_peer_died_logs_one_error_line_and_the_traceback_at_debug(caplog) -> None:
    records = failed_step_records(caplog, RuntimeError(GLOO_PEER_GONE + "\nException raised from recvBytes"))

    errors = [r for r in records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == [f"execute failed: RuntimeError: {GLOO_PEER_GONE}"]
    assert errors[0].exc_info is None
    assert [r.exc_info is not None for r in records if r.levelname == "DEBUG"] == [True]


def test_a_setting_the_rank_cannot_run_with_logs_one_error_line(caplog) -> None:
    # (a KV-cache budget too small: the message says which setting and what it takes)
    from kvserve.scheduler.checks import SettingError

    records = failed_step_records(caplog, SettingError("cpu_kv_cache_bytes is 1: ..."))

    errors = [r for r in records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == ["execute failed: SettingError: cpu_kv_cache_bytes is 1: ..."]
    assert errors[0].exc_info is None


def test_a_rank_whose_own_code_failed_logs_the_traceback_at_error(caplog) -> None:
    records = failed_step_records(caplog, KeyError("layers.3.weight"))

    assert [(r.levelname, r.getMessage()) for r in records] == [("ERROR", "execute failed: KeyError: 'layers.3.weight'")]
    assert records[0].exc_info is not None


def test_a_cancelled_step_makes_the_replica_unusable() -> None:
    release = threading.Event()
    rank = Rank(sample=True, execute_hook=lambda p: release.wait(10))

    async def scenario() -> None:
        async with replica(rank) as executor:
            step = asyncio.create_task(executor.execute(plan(0)))
            await asyncio.sleep(0.2)
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
            release.set()
            with pytest.raises(ReplicaFailedError, match="step 0 was cancelled in flight"):
                await executor.execute(plan(1))

    asyncio.run(scenario())


@asynccontextmanager
async def served(rank: Rank) -> AsyncIterator[step_pb2_grpc.StepWorkerStub]:
    """A stub to ``rank``'s own StepWorker server (calls carry ``metadata=AUTH``)."""
    thread = ThreadPoolExecutor(max_workers=1)
    server, address = await start_step_server(rank, thread, "127.0.0.1", secret=SECRET)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield step_pb2_grpc.StepWorkerStub(channel)
    finally:
        await server.stop(None)
        thread.shutdown(wait=False, cancel_futures=True)


def test_a_malformed_plan_ends_its_stream_invalid_argument_and_the_rank_keeps_serving() -> None:
    async def scenario() -> None:
        async with served(Rank(sample=True)) as stub:
            message = encode_plan(plan(0))
            message.token_ids = message.token_ids[:-4]
            steps = stub.ExecuteSteps(timeout=10, metadata=AUTH)
            await steps.write(message)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await steps.read()
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "step 0: token_ids has 2 entries but num_scheduled_tokens adds up to 3" in error.value.details()
            num_blocks = await stub.DetermineNumBlocks(step_pb2.Empty(), timeout=10, metadata=AUTH)
            assert num_blocks.num_blocks == NUM_BLOCKS
            steps = stub.ExecuteSteps(timeout=10, metadata=AUTH)
            await steps.write(encode_plan(plan(0)))
            assert decode_result(await steps.read()).sampled_token_ids == [0, 0]
            await steps.done_writing()

    asyncio.run(scenario())


def test_a_rank_serves_one_call_at_a_time_so_a_second_stream_waits_for_the_first() -> None:
    async def scenario() -> None:
        async with served(Rank(sample=True)) as stub:
            first = stub.ExecuteSteps(timeout=10, metadata=AUTH)
            await first.write(encode_plan(plan(0)))
            assert decode_result(await first.read()).step_id == 0
            second = stub.ExecuteSteps(timeout=10, metadata=AUTH)
            await second.write(encode_plan(plan(1)))
            answer = asyncio.ensure_future(second.read())
            await asyncio.sleep(0.3)
            assert not answer.done()
            await first.done_writing()
            assert decode_result(await asyncio.wait_for(answer, 5)).step_id == 1
            await second.done_writing()

    asyncio.run(scenario())


def test_a_replica_of_ranks_in_other_processes_is_scheduled_overlapped_by_default() -> None:
    async def scenario() -> tuple[bool, bool]:
        async with replica(Rank(sample=True)) as executor:
            default = EngineCore(make_scheduler(), executor).async_scheduling
            return default, EngineCore(make_scheduler(), executor, async_scheduling=False).async_scheduling

    assert asyncio.run(scenario()) == (True, False)


def test_launched_steps_reach_the_ranks_before_the_previous_one_is_answered() -> None:
    """Overlapped scheduling: steps 1 and 2 are sent while the ranks still run step 0, so they
    start each as soon as they answered the one before; the answers come in order, one per step."""
    release = threading.Event()
    ranks = [Rank(sample=True, execute_hook=lambda p: p.step_id == 0 and release.wait(10)), Rank(sample=False)]

    async def scenario() -> list[StepResult]:
        async with replica(*ranks) as executor:
            assert executor.steps_ahead == STEPS_AHEAD == MAX_STEPS_IN_FLIGHT - 1
            launched = [await executor.launch(plan(step)) for step in range(MAX_STEPS_IN_FLIGHT)]
            with pytest.raises(RuntimeError, match=f"{MAX_STEPS_IN_FLIGHT} steps are already in flight"):
                await executor.launch(plan(MAX_STEPS_IN_FLIGHT))
            with pytest.raises(RuntimeError, match="step 1's result was asked for out of order"):
                await launched[1].result()
            release.set()
            return [await step.result() for step in launched] + [await executor.execute(plan(MAX_STEPS_IN_FLIGHT))]

    results = asyncio.run(scenario())
    steps = list(range(MAX_STEPS_IN_FLIGHT + 1))
    assert [(r.step_id, r.sampled_token_ids) for r in results] == [(s, [s, s]) for s in steps]
    assert [[p.step_id for p in rank.plans] for rank in ranks] == [steps] * 2


def test_a_rank_failing_with_two_steps_in_flight_fails_both() -> None:
    def fail_step_0(p: StepPlan) -> None:
        if p.step_id == 0:
            raise RuntimeError("lost device")

    rank = Rank(sample=True, execute_hook=fail_step_0)

    async def scenario() -> None:
        async with replica(rank) as executor:
            first = await executor.launch(plan(0))
            try:
                second = await executor.launch(plan(1))
            except ReplicaFailedError as exc:
                # The rank can end the stream before the second plan is written: that fails step 0 too,
                # with grpc's own INTERNAL status in place of the rank's (its reason is in the rank's log).
                assert re.search(r"failed at step 0: INTERNAL: (RuntimeError: lost device|Internal error from Core)",
                                 str(exc))
                second = None
                with pytest.raises(ReplicaFailedError, match=re.escape(str(exc))):
                    await first.result()
            else:
                with pytest.raises(ReplicaFailedError, match="failed at step 0: INTERNAL: RuntimeError: lost device"):
                    await first.result()
            if second is not None:
                with pytest.raises(ReplicaFailedError, match="failed at step 0"):
                    await second.result()
            assert executor.failed

    asyncio.run(scenario())


class AsyncRank(Rank):
    """A rank whose ``launch`` returns at once and runs the step meanwhile, as a CUDA worker's does."""

    launches_ahead = True

    def __init__(self, step_s: float) -> None:
        super().__init__(sample=True)
        self.step_s = step_s
        self.events: list[str] = []
        self.launch_threads: set[str] = set()  # the threads that called launch()
        self.result_threads: set[str] = set()  # and result()
        self._device = ThreadPoolExecutor(max_workers=1)  # runs the steps in order, as a CUDA stream

    def launch(self, plan: StepPlan):
        self.launch_threads.add(threading.current_thread().name)
        self.events.append(f"launch {plan.step_id}")
        done = self._device.submit(lambda: (time.sleep(self.step_s), self.execute(plan))[1])
        rank = self

        class Launched:
            def wait(self) -> None:  # from any thread
                done.result()

            def result(self) -> StepResult | None:
                rank.result_threads.add(threading.current_thread().name)
                rank.events.append(f"result {plan.step_id}")
                return done.result()

        return Launched()


def test_a_rank_that_launches_ahead_starts_the_next_step_before_it_waits_for_the_last() -> None:
    """With a plan already sent, a CUDA-like rank launches it before it waits for the step
    running: its device never waits for the host between the two.  Answers stay in order."""
    rank = AsyncRank(step_s=0.2)

    async def scenario() -> list[StepResult]:
        async with replica(rank) as executor:
            first = await executor.launch(plan(0))
            second = await executor.launch(plan(1))
            results = [await first.result(), await second.result()]
            # Nothing sent ahead: the rank answers the step without waiting for another.
            return results + [await executor.execute(plan(2))]

    results = asyncio.run(scenario())
    assert [(r.step_id, r.sampled_token_ids) for r in results] == [(0, [0, 0]), (1, [1, 1]), (2, [2, 2])]
    assert rank.events == ["launch 0", "launch 1", "result 0", "result 1", "launch 2", "result 2"]
    # launch() on the worker thread, which does nothing else; result() (the copy of the samples
    # waited for) on the thread that answers, while the worker thread launches the next step.
    assert rank.launch_threads == {f"{WORKER_THREAD}_0"}
    assert len(rank.result_threads) == 1 and rank.result_threads != rank.launch_threads


def test_a_step_that_fails_on_the_device_of_a_rank_that_launches_ahead_fails_the_replica() -> None:
    rank = AsyncRank(step_s=0.05)
    execute = rank.execute

    def execute_failing_step_1(p: StepPlan) -> StepResult | None:
        if p.step_id == 1:
            raise RuntimeError("illegal memory access")
        return execute(p)

    rank.execute = execute_failing_step_1  # runs on the stand-in's device thread

    async def scenario() -> None:
        async with replica(rank) as executor:
            first = await executor.launch(plan(0))
            second = await executor.launch(plan(1))
            assert (await first.result()).sampled_token_ids == [0, 0]
            with pytest.raises(ReplicaFailedError, match="failed at step 1: INTERNAL: RuntimeError: illegal memory"):
                await second.result()

    asyncio.run(scenario())
