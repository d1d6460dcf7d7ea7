"""Prompt logprobs on their way from the scheduler actor to the front end: on the delta of a request's
first output token, once, also for a request that moved off a failed replica.

The actor runs on fake replicas, without Ray: each executor gives prompt token ``t`` the logprob
``-t`` (and one alternative, token 3 at -0.5), so that every entry says which position it is.
"""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import pytest

from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.messages import OutputBatch, RequestDelta, RequestSpec
from kvserve.cluster.output_mailbox import PendingOutput
from kvserve.cluster.scheduler_actor import SchedulerActor
from kvserve.scheduler.engine_config import ParallelConfig
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.logprobs import StepPromptLogprobs, TokenLogprobs
from kvserve.scheduler.request import FinishReason, Request
from kvserve.scheduler.request_output import RequestOutput
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

BLOCK_SIZE = 4
# Small steps: a prompt takes several chunks.
MAX_NUM_BATCHED_TOKENS = 8
TIMEOUT_S = 30.0
NUM_PROMPT_TOKENS = 20
PROMPT = list(range(10, 10 + NUM_PROMPT_TOKENS))


def token_logprobs(position: int) -> TokenLogprobs:
    """What the fake replicas compute for the prompt token at ``position``."""
    return TokenLogprobs(-float(position), (3,), (-0.5,))


EXPECTED = [None, *(token_logprobs(t) for t in range(1, NUM_PROMPT_TOKENS))]


class PromptLogprobsExecutor:
    """Samples token 7 for every row and computes the prompt logprobs the plan asks for.

    ``fail_after_first_token``: the step after the one that sampled a request's first token fails;
    ``fail_at_step``: its ``n``-th step (from 1) fails.
    """

    num_kv_blocks = 128

    def __init__(self) -> None:
        self.num_prompt_tokens: dict[str, int] = {}
        self.num_steps = 0
        self.fail_at_step: int | None = None
        self.fail_after_first_token = False
        self._sampled = False

    async def execute(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0)
        self.num_steps += 1
        if self.num_steps == self.fail_at_step or (self.fail_after_first_token and self._sampled):
            raise ReplicaFailedError("the worker died")
        self._sampled = self._sampled or plan.num_sampled > 0
        for new in plan.new_requests:
            self.num_prompt_tokens[new.req_id] = new.num_prompt_tokens
        rows, num_positions, values = [], [], []
        for row in plan.prompt_logprobs_rows:
            start = plan.num_computed_tokens[row]
            end = min(start + plan.num_scheduled_tokens[row], self.num_prompt_tokens[plan.req_ids[row]] - 1)
            rows.append(row)
            num_positions.append(end - start)
            values.extend(token_logprobs(t) for t in range(start + 1, end + 1))
        prompt_logprobs = None
        if rows:
            prompt_logprobs = StepPromptLogprobs(
                rows, num_positions, [1] * len(rows),
                [v.logprob for v in values], [3] * len(values), [-0.5] * len(values),
            )
        return StepResult(plan.step_id, [7] * plan.num_sampled, prompt_logprobs=prompt_logprobs)

    async def shutdown(self) -> None:
        pass


def fake_actor(monkeypatch: pytest.MonkeyPatch) -> tuple[SchedulerActor, list[PromptLogprobsExecutor]]:
    executors = [PromptLogprobsExecutor(), PromptLogprobsExecutor()]

    async def launch_replica(replica_id: int, *args, **kwargs) -> SimpleNamespace:
        async def noop() -> None:
            pass

        return SimpleNamespace(executor=executors[replica_id], placement_group=None, shutdown=noop, check_alive=noop)

    monkeypatch.setattr("kvserve.cluster.scheduler_actor.launch_replica", launch_replica)
    monkeypatch.setattr("kvserve.cluster.replica_restart.RESTART_BACKOFF_S", 3600.0)  # a failed one stays down
    config = ClusterConfig.from_kwargs(
        "m", parallel=ParallelConfig(num_replicas=2), block_size=BLOCK_SIZE,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, routing="round_robin",
    )
    model = SimpleNamespace(model_dir="m", model_id="m", vocab_size=1000, max_model_len=256, eos_token_ids=())
    return SchedulerActor(config, model), executors


async def every_delta(actor: SchedulerActor, req_id: str) -> list[RequestDelta]:
    """Every delta of ``req_id`` until its last."""
    deltas: list[RequestDelta] = []
    async with asyncio.timeout(TIMEOUT_S):
        while not (deltas and deltas[-1].is_last):
            deltas.extend(delta for delta in await actor.poll_outputs(TIMEOUT_S) if delta.req_id == req_id)
    return deltas


def run(monkeypatch: pytest.MonkeyPatch, params: SamplingParams, prepare=None) -> list[RequestDelta]:
    """The deltas of one request of ``PROMPT``, after ``prepare(executors)``."""

    async def scenario() -> list[RequestDelta]:
        actor, executors = fake_actor(monkeypatch)
        for replica_id in range(2):
            await actor.start_replica(replica_id, "cpu")
        if prepare is not None:
            prepare(executors)
        await actor.add_request(RequestSpec("r", PROMPT, params))
        try:
            return await every_delta(actor, "r")
        finally:
            await actor.shutdown()

    return asyncio.run(scenario())


def with_prompt_logprobs(deltas: list[RequestDelta]) -> list[tuple[int, list]]:
    """Each delta that carries prompt logprobs: its index among the tokens' deltas, and them."""
    return [(i, d.prompt_logprobs) for i, d in enumerate(deltas) if d.prompt_logprobs is not None]


# -- the actor -----------------------------------------------------------------------------------


def test_the_delta_of_the_first_token_carries_every_prompt_tokens_logprobs_once(monkeypatch) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1)

    deltas = run(monkeypatch, params)

    assert [t for d in deltas for t in d.token_ids] == [7, 7, 7, 7]
    [(index, prompt_logprobs)] = with_prompt_logprobs(deltas)
    assert deltas[index].token_ids[0] == 7 and not any(d.token_ids for d in deltas[:index])
    assert prompt_logprobs == EXPECTED


def test_a_request_of_one_token_gets_them_on_its_last_delta(monkeypatch) -> None:
    deltas = run(monkeypatch, SamplingParams(max_tokens=1, prompt_logprobs=0))

    assert deltas[-1].is_last and deltas[-1].token_ids == [7]
    assert with_prompt_logprobs(deltas) == [(len(deltas) - 1, EXPECTED)]


def test_a_request_that_did_not_ask_gets_none(monkeypatch) -> None:
    deltas = run(monkeypatch, SamplingParams(max_tokens=2, ignore_eos=True))

    assert with_prompt_logprobs(deltas) == []


def test_a_request_moved_after_its_first_token_does_not_get_them_again(monkeypatch) -> None:
    def fail_after_first_token(executors: list[PromptLogprobsExecutor]) -> None:
        executors[0].fail_after_first_token = True  # round robin: replica 0 takes the request

    deltas = run(monkeypatch, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1), fail_after_first_token)

    assert {d.replica for d in deltas} == {0, 1}  # it moved
    assert deltas[-1].error is None and deltas[-1].num_output_tokens == 4
    assert [t for d in deltas for t in d.token_ids] == [7, 7, 7, 7]
    [(_, prompt_logprobs)] = with_prompt_logprobs(deltas)
    assert prompt_logprobs == EXPECTED


def test_a_request_moved_mid_prompt_gets_them_once_and_whole(monkeypatch) -> None:
    first_replica: list[PromptLogprobsExecutor] = []

    def fail_at_third_step(executors: list[PromptLogprobsExecutor]) -> None:
        executors[0].fail_at_step = 3  # two chunks of the prompt computed there, with their logprobs
        first_replica.append(executors[0])

    deltas = run(monkeypatch, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1), fail_at_third_step)

    assert first_replica[0].num_steps == 3 and first_replica[0].num_prompt_tokens == {"r": NUM_PROMPT_TOKENS}
    assert all(d.replica == 1 for d in deltas if d.token_ids)
    [(_, prompt_logprobs)] = with_prompt_logprobs(deltas)
    assert prompt_logprobs == EXPECTED


# -- the messages ----------------------------------------------------------------------------------


def test_a_pending_output_takes_them_with_the_first_token_only() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=3, prompt_logprobs=0))
    request.prompt_logprobs.extend([TokenLogprobs(-1.0), TokenLogprobs(-2.0)])
    entry = PendingOutput(replica=0)

    request.append_output_token(7)
    entry.add(RequestOutput("r", 7), request)
    first = entry.to_delta("r")
    entry = PendingOutput(replica=0)
    request.append_output_token(8)
    entry.add(RequestOutput("r", 8, FinishReason.LENGTH), request)
    second = entry.to_delta("r")

    assert first.prompt_logprobs == [None, TokenLogprobs(-1.0), TokenLogprobs(-2.0)]
    assert (second.prompt_logprobs, second.finish_reason, second.token_ids) == (None, "length", [8])


def test_an_output_batch_keeps_them_for_running_and_ended_requests_and_pickles_them() -> None:
    running = RequestDelta("a", [7], replica=0, prompt_logprobs=[None, TokenLogprobs(-1.5, (2,), (-0.25,))])
    ended = RequestDelta("b", [7], finish_reason="length", replica=1, prompt_logprobs=[None])
    plain = RequestDelta("c", [8], replica=0)

    batch = pickle.loads(pickle.dumps(OutputBatch.from_deltas([running, ended, plain])))

    assert list(batch) == [running, plain, ended]
    assert batch.prompt_logprobs == {"a": [None, TokenLogprobs(-1.5, (2,), (-0.25,))]}
