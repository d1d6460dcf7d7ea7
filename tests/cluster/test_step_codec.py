"""Step plans and results survive the wire exactly; corrupted messages are rejected by field."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kvserve.cluster.step_codec import (
    decode_plan,
    decode_result,
    decode_sampling_params,
    encode_plan,
    encode_result,
    encode_sampling_params,
)
from kvserve.proto import step_pb2
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.logprobs import StepLogprobs, StepPromptLogprobs
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import NewRequestData, StepPlan
from kvserve.scheduler.step_result import StepResult
from tests.scheduler.paged_token_worker import PagedTokenWorker


def over_the_wire(plan: StepPlan) -> StepPlan:
    return decode_plan(step_pb2.StepPlan.FromString(encode_plan(plan).SerializeToString()))


def worker_view(plan: StepPlan) -> StepPlan:
    """``plan`` as workers see it: stop conditions are the scheduler's business."""
    new_requests = [
        dataclasses.replace(
            new,
            sampling_params=dataclasses.replace(new.sampling_params, stop_token_ids=(), ignore_eos=False),
        )
        for new in plan.new_requests
    ]
    return dataclasses.replace(plan, new_requests=new_requests)


def scheduled_plans(overlapped: bool = False) -> list[StepPlan]:
    """Every plan of a busy replica: a small pool (preemptions), chunked prefill, varied params.

    ``overlapped``: each plan is scheduled before the previous one's tokens are
    applied, so decodes carry placeholder rows.
    """
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, max_model_len=128),
        CacheConfig(block_size=4, num_blocks=24),
    )
    worker = PagedTokenWorker(24, 4)
    rng = random.Random(5)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=20, seed=1234, stop_token_ids=(3, 4),
                       min_p=0.05),
        SamplingParams(max_tokens=15, temperature=1.3, seed=2**40, logprobs=3),
        SamplingParams(max_tokens=14, temperature=0.0, presence_penalty=0.5, frequency_penalty=-0.25,
                       logit_bias={3: 1.5, 7: -2.0}, min_tokens=3, stop_token_ids=(5,), repetition_penalty=1.3),
        SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2),
    ]
    for i in range(10):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(3, 30))]
        scheduler.add_request(Request(f"req-{i}", prompt, params[i % len(params)], eos_token_ids=(2,)))
    plans: list[StepPlan] = []
    in_flight: tuple[StepPlan, list[int]] | None = None
    last_samples: dict[str, int] = {}
    while scheduler.has_unfinished_requests() or in_flight is not None:
        plan = scheduler.schedule()
        if in_flight is not None:
            scheduler.update(*in_flight)
            in_flight = None
        if plan.is_empty:
            continue
        plans.append(plan)
        token_ids = list(plan.token_ids)
        for row in plan.placeholder_rows:  # as a worker does: its own last sample
            token_ids[sum(plan.num_scheduled_tokens[:row])] = last_samples[plan.req_ids[row]]
        sampled = worker.execute(dataclasses.replace(plan, token_ids=token_ids))
        last_samples = dict(zip((r for r, s in zip(plan.req_ids, plan.sample) if s), sampled))
        if overlapped:
            in_flight = (plan, sampled)
        else:
            scheduler.update(plan, sampled)
    return plans


@pytest.mark.parametrize("overlapped", [False, True])
def test_every_scheduled_plan_round_trips_exactly(overlapped: bool) -> None:
    plans = scheduled_plans(overlapped)
    assert any(p.placeholder_rows for p in plans) == overlapped
    for plan in plans:
        assert over_the_wire(plan) == worker_view(plan)
    # The plans cover every kind of content the protocol carries.
    assert any(p.preempted_req_ids for p in plans)
    assert any(p.finished_req_ids for p in plans)
    assert any(p.new_requests and len(p.new_requests) < p.num_reqs for p in plans)
    assert any(
        any(n > 1 for n in p.num_scheduled_tokens) and any(n == 1 for n in p.num_scheduled_tokens) for p in plans
    )
    assert any(not all(p.sample) for p in plans)  # an unfinished prefill chunk
    # Prompt logprobs of chunks, some ending before their prompt does.
    assert any(p.next_prompt_token_ids for p in plans) and any(
        len(p.next_prompt_token_ids) < len(p.prompt_logprobs_rows) for p in plans
    )
    # A request with min_tokens brings every token that would stop it (its EOS too).
    assert {new.stop_token_ids for p in plans for new in p.new_requests if new.sampling_params.min_tokens} == {(2, 5)}
    # A request with a repetition penalty brings its whole prompt, every time it (re)starts; the others none.
    assert all(
        len(new.prompt_token_ids) == (new.num_prompt_tokens if new.sampling_params.penalizes_prompt else 0)
        for p in plans for new in p.new_requests
    )
    assert any(new.prompt_token_ids for p in plans for new in p.new_requests)


def test_empty_plan_round_trips() -> None:
    plan = StepPlan(7, [], [], [], [], [], [], [], [], ["a"], [])
    assert over_the_wire(plan) == plan


def test_sampling_params_keep_what_workers_need() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.75, top_k=3, seed=0, stop_token_ids=(9,))
    decoded = decode_sampling_params(encode_sampling_params(params))
    assert (decoded.max_tokens, decoded.temperature, decoded.top_p, decoded.top_k, decoded.seed) == (
        5, 0.5, 0.75, 3, 0,
    )
    unset = decode_sampling_params(encode_sampling_params(SamplingParams()))
    assert (unset.top_k, unset.seed, unset.logprobs) == (None, None, None)


@pytest.mark.parametrize("logprobs", [0, 5])
def test_sampling_params_carry_the_logprobs_asked_for(logprobs: int) -> None:
    assert decode_sampling_params(encode_sampling_params(SamplingParams(logprobs=logprobs))).logprobs == logprobs


def test_result_round_trips_with_float32_logprobs_of_the_rows_that_asked() -> None:
    logprobs = StepLogprobs(
        rows=[0, 2], token_logprobs=[-0.5, -7.0], num_top=[2, 0], top_token_ids=[5, 6], top_logprobs=[-0.5, -1.25]
    )
    result = StepResult(3, [5, 999, 0], logprobs)
    message = step_pb2.StepResult.FromString(encode_result(3, result).SerializeToString())
    assert decode_result(message) == result
    assert len(message.sampled_token_ids) == 12 and len(message.token_logprobs) == 8


def test_a_result_without_logprobs_carries_none() -> None:
    message = encode_result(3, StepResult(3, [5, 6]))
    assert message.ByteSize() < 20
    assert decode_result(message) == StepResult(3, [5, 6])


def test_result_of_a_non_driver_rank_decodes_to_none() -> None:
    assert decode_result(encode_result(4, None)) is None


@pytest.fixture
def message() -> step_pb2.StepPlan:
    return encode_plan(scheduled_plans()[1])


def int32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


@pytest.mark.parametrize("field", ["num_scheduled_tokens", "num_computed_tokens", "num_new_block_ids"])
def test_column_with_a_missing_request_is_rejected(message: step_pb2.StepPlan, field: str) -> None:
    setattr(message, field, getattr(message, field)[:-4])
    with pytest.raises(ValueError, match=f"^{field} has {len(message.req_ids) - 1} entries"):
        decode_plan(message)


def test_sample_column_of_wrong_length_is_rejected(message: step_pb2.StepPlan) -> None:
    message.sample += b"\x01"
    with pytest.raises(ValueError, match="^sample has"):
        decode_plan(message)


def test_truncated_int32_array_is_rejected(message: step_pb2.StepPlan) -> None:
    message.token_ids = message.token_ids[:-1]
    with pytest.raises(ValueError, match="^token_ids is .* bytes, not a whole number"):
        decode_plan(message)


def test_token_ids_disagreeing_with_scheduled_counts_are_rejected(message: step_pb2.StepPlan) -> None:
    message.token_ids += int32([17])
    with pytest.raises(ValueError, match="^token_ids has .* but num_scheduled_tokens adds up to"):
        decode_plan(message)


def test_block_ids_disagreeing_with_their_counts_are_rejected(message: step_pb2.StepPlan) -> None:
    message.new_block_ids = message.new_block_ids[:-4]
    with pytest.raises(ValueError, match="^new_block_ids has .* but num_new_block_ids adds up to"):
        decode_plan(message)


def test_negative_block_id_is_rejected(message: step_pb2.StepPlan) -> None:
    message.new_block_ids = int32([-1]) + message.new_block_ids[4:]
    with pytest.raises(ValueError, match="^new_block_ids holds a negative value"):
        decode_plan(message)


def test_sample_flag_other_than_0_or_1_is_rejected(message: step_pb2.StepPlan) -> None:
    message.sample = b"\x02" + message.sample[1:]
    with pytest.raises(ValueError, match="^sample must hold 0 or 1"):
        decode_plan(message)


def test_invalid_sampling_params_are_rejected_by_field(message: step_pb2.StepPlan) -> None:
    message.new_requests.sampling_params[0].top_p = 1.5
    with pytest.raises(ValueError, match=r"^new_requests\.sampling_params\[0\]: top_p"):
        decode_plan(message)


@pytest.mark.parametrize("past", ["end", "start"])
def test_new_request_pointing_past_the_sampling_params_is_rejected(message: step_pb2.StepPlan, past: str) -> None:
    num_params = len(message.new_requests.sampling_params)
    bad = num_params if past == "end" else -1
    message.new_requests.sampling_params_index = int32([bad]) + message.new_requests.sampling_params_index[4:]
    with pytest.raises(
        ValueError, match=rf"^new_requests\.sampling_params_index holds {bad}, but there are {num_params}"
    ):
        decode_plan(message)


def test_new_requests_column_with_a_missing_request_is_rejected(message: step_pb2.StepPlan) -> None:
    message.new_requests.num_prompt_tokens = message.new_requests.num_prompt_tokens[:-4]
    pattern = r"^new_requests\.num_prompt_tokens has .* entries for .* new_requests\.req_ids"
    with pytest.raises(ValueError, match=pattern):
        decode_plan(message)


def test_sampling_params_carry_the_logits_adjustments() -> None:
    params = SamplingParams(presence_penalty=-2.0, frequency_penalty=1.5, logit_bias={9: 0.1, 2: -100.0},
                            min_tokens=4, repetition_penalty=0.75)
    decoded = decode_sampling_params(encode_sampling_params(params))
    assert (decoded.presence_penalty, decoded.frequency_penalty, decoded.logit_bias, decoded.min_tokens,
            decoded.repetition_penalty) == (-2.0, 1.5, ((2, -100.0), (9, 0.1)), 4, 0.75)


def test_no_repetition_penalty_is_left_unset_and_decodes_to_1() -> None:
    wire = encode_sampling_params(SamplingParams())
    assert not wire.HasField("repetition_penalty")
    assert decode_sampling_params(wire).repetition_penalty == 1.0


def test_a_repetition_penalty_out_of_range_is_rejected_by_field() -> None:
    wire = encode_sampling_params(SamplingParams(repetition_penalty=2.0))
    wire.repetition_penalty = 0.0
    with pytest.raises(ValueError, match="^repetition_penalty must be finite and > 0, got 0.0"):
        decode_sampling_params(wire)


@pytest.mark.parametrize("min_p", [0.0, 5e-324, 0.05, 1 / 3, 1.0])
def test_min_p_survives_the_wire_exactly(min_p: float) -> None:
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=min_p)
    wire = step_pb2.WireSamplingParams.FromString(encode_sampling_params(params).SerializeToString())
    assert decode_sampling_params(wire) == dataclasses.replace(params, stop_token_ids=())


def test_new_requests_differing_only_in_min_p_keep_their_own() -> None:
    # The plan sends each distinct SamplingParams once; min_p is part of what makes them distinct.
    new_requests = [NewRequestData(req_id, SamplingParams(seed=1, min_p=min_p), 2)
                    for req_id, min_p in (("a", 0.0), ("b", 0.1), ("c", 0.1), ("d", 0.2))]
    plan = StepPlan(1, ["a", "b", "c", "d"], [2] * 4, [0] * 4, [5, 6] * 4, [0] * 4, [], [True] * 4, new_requests,
                    [], [])
    assert [new.sampling_params.min_p for new in over_the_wire(plan).new_requests] == [0.0, 0.1, 0.1, 0.2]
    assert len(encode_plan(plan).new_requests.sampling_params) == 3


def test_a_min_p_out_of_range_is_rejected_by_field() -> None:
    wire = encode_sampling_params(SamplingParams(min_p=0.5))
    wire.min_p = 1.5
    with pytest.raises(ValueError, match=r"^min_p must be in \[0, 1\], got 1.5"):
        decode_sampling_params(wire)


def test_logit_biases_without_their_token_ids_are_rejected() -> None:
    wire = encode_sampling_params(SamplingParams(logit_bias={1: 1.0, 2: 2.0}))
    wire.logit_bias_token_ids = wire.logit_bias_token_ids[:4]
    with pytest.raises(ValueError, match="^logit_bias_token_ids has 1 entries for 2 logit_bias_values"):
        decode_sampling_params(wire)


def penalised_plan() -> StepPlan:
    params = SamplingParams(frequency_penalty=1.0, min_tokens=2)
    new_requests = [NewRequestData("a", params, 3, (4, 4), (0,)), NewRequestData("b", SamplingParams(), 3),
                    NewRequestData("c", params, 3, (), (0, 1))]
    return StepPlan(1, ["a", "b", "c"], [1] * 3, [5, 3, 3], [9] * 3, [0] * 3, [], [True] * 3, new_requests, [], [])


def repeated_plan() -> StepPlan:
    repeated = SamplingParams(repetition_penalty=1.2)
    new_requests = [NewRequestData("a", repeated, 3, (7,), (), (8, 1, 8)), NewRequestData("b", SamplingParams(), 2),
                    NewRequestData("c", repeated, 2, (), (), (4, 4))]
    return StepPlan(1, ["a", "b", "c"], [1] * 3, [4, 2, 2], [9] * 3, [0] * 3, [], [True] * 3, new_requests, [], [])


def test_new_requests_with_a_repetition_penalty_carry_their_prompts() -> None:
    plan = repeated_plan()
    assert over_the_wire(plan) == plan


@pytest.mark.parametrize("field,value,error", [
    ("prompt_token_ids", int32([8, 1, 8, 4]), r"^new_requests\.prompt_token_ids has 4 entries but .* adds up to 5"),
    ("num_prompt_token_ids", int32([3, 0]), r"^new_requests\.num_prompt_token_ids has 2 entries for 3"),
    ("num_prompt_token_ids", int32([2, 0, 3]),
     r"^new_requests\.num_prompt_token_ids\[0\] is 2: a request sends its whole prompt \(num_prompt_tokens 3\)"),
    ("prompt_token_ids", int32([8, 1, 8, -4, 4]), r"^new_requests\.prompt_token_ids holds a negative value"),
])
def test_inconsistent_prompt_token_columns_are_rejected(field: str, value: bytes, error: str) -> None:
    message = encode_plan(repeated_plan())
    setattr(message.new_requests, field, value)
    with pytest.raises(ValueError, match=error):
        decode_plan(message)


def test_new_requests_carry_their_outputs_and_stop_tokens_for_adjustments() -> None:
    plan = penalised_plan()
    assert over_the_wire(plan) == plan


@pytest.mark.parametrize("field,value,error", [
    ("num_output_token_ids", int32([2, 0]), r"^new_requests\.num_output_token_ids has 2 entries for 3"),
    ("output_token_ids", int32([4]), r"^new_requests\.output_token_ids has 1 entries but .* adds up to 2"),
    ("stop_token_ids", int32([0, -1, 1]), r"^new_requests\.stop_token_ids holds a negative value"),
])
def test_inconsistent_output_or_stop_token_columns_are_rejected(field: str, value: bytes, error: str) -> None:
    message = encode_plan(penalised_plan())
    setattr(message.new_requests, field, value)
    with pytest.raises(ValueError, match=error):
        decode_plan(message)


def test_new_requests_send_each_distinct_sampling_params_once() -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    seeded = SamplingParams(max_tokens=8, temperature=0.7, seed=3)
    new_requests = [
        NewRequestData(f"r{i}", params, 5 + i) for i, params in enumerate([greedy, seeded, greedy, greedy])
    ]
    req_ids = [new.req_id for new in new_requests]
    plan = StepPlan(1, req_ids, [1] * 4, [4, 5, 6, 7], [9] * 4, [0] * 4, [], [True] * 4, new_requests, [], [])
    message = encode_plan(plan)
    assert len(message.new_requests.sampling_params) == 2
    assert over_the_wire(plan) == plan


def result_with_logprobs() -> step_pb2.StepResult:
    logprobs = StepLogprobs(rows=[0, 1], token_logprobs=[-1.0, -2.0], num_top=[1, 1],
                            top_token_ids=[4, 7], top_logprobs=[-1.0, -0.5])
    return encode_result(1, StepResult(1, [4, 5], logprobs))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("token_logprobs", np.array([-1.0], "<f4").tobytes(), "^token_logprobs has 1 entries for 2 logprob_rows"),
        ("logprob_rows", int32([0, 2]), r"^logprob_rows must increase within \[0, 2\)"),
        ("logprob_rows", int32([1, 0]), "^logprob_rows must increase"),
        ("num_top_logprobs", int32([1, 2]), "^top_token_ids has 2 entries but num_top_logprobs adds up to 3"),
        ("top_logprobs", np.array([-1.0], "<f4").tobytes(), "^top_logprobs has 1 entries but top_token_ids has 2"),
    ],
)
def test_result_with_inconsistent_logprobs_is_rejected(field: str, value: bytes, message: str) -> None:
    result = result_with_logprobs()
    setattr(result, field, value)
    with pytest.raises(ValueError, match=message):
        decode_result(result)


@pytest.mark.parametrize(
    "rows, error",
    [([2], "increasing rows"), ([1, 0], "increasing rows"), ([-1], "increasing rows"),
     ([1], "one sampled token"), ([0, 1], "one sampled token")],
)
def test_placeholder_rows_outside_the_sampled_decodes_are_rejected(rows: list[int], error: str) -> None:
    # Row 0: a decode; row 1: a prefill chunk of 3 tokens that does not sample.
    plan = StepPlan(0, ["a", "b"], [1, 3], [3, 0], [0, 1, 2, 3], [0, 0], [], [True, False], [], [], [])
    message = encode_plan(plan)
    message.placeholder_rows = np.asarray(rows, dtype=np.int32).tobytes()
    with pytest.raises(ValueError, match=error):
        decode_plan(message)


def prompt_logprobs_result() -> StepResult:
    prompt = StepPromptLogprobs(rows=[0, 2], num_positions=[2, 1], num_top=[1, 0], token_logprobs=[-0.5, -1.25, -2.0],
                                top_token_ids=[4, 9], top_logprobs=[-0.25, -0.75])
    return StepResult(3, [7], None, prompt)


def test_result_round_trips_with_the_prompt_logprobs_of_the_plan() -> None:
    result = prompt_logprobs_result()
    assert decode_result(step_pb2.StepResult.FromString(encode_result(3, result).SerializeToString())) == result


@pytest.mark.parametrize("field,value,error", [
    ("rows", int32([2, 0]), r"^prompt_logprobs\.rows must increase"),
    ("num_top", int32([1]), r"^prompt_logprobs\.num_top has 1 entries for 2 prompt_logprobs\.rows"),
    ("token_logprobs", np.zeros(2, "<f4").tobytes(), r"^prompt_logprobs\.token_logprobs has 2 entries but .* 3"),
    ("top_token_ids", int32([4]), r"^prompt_logprobs\.top_token_ids has 1 entries but .* adds up to 2"),
])
def test_inconsistent_prompt_logprobs_are_rejected(field: str, value: bytes, error: str) -> None:
    message = encode_result(3, prompt_logprobs_result())
    setattr(message.prompt_logprobs, field, value)
    with pytest.raises(ValueError, match=error):
        decode_result(message)


@pytest.mark.parametrize("rows,next_ids,error", [
    ([1, 1], [], r"^prompt_logprobs_rows must increase within \[0, 3\)"),
    ([3], [], r"^prompt_logprobs_rows must increase within \[0, 3\)"),
    ([0], [5, 6], r"^next_prompt_token_ids has 2 entries for 1 prompt_logprobs_rows"),
])
def test_inconsistent_prompt_logprobs_rows_are_rejected(rows: list[int], next_ids: list[int], error: str) -> None:
    message = encode_plan(penalised_plan())
    message.prompt_logprobs_rows, message.next_prompt_token_ids = int32(rows), int32(next_ids)
    with pytest.raises(ValueError, match=error):
        decode_plan(message)
