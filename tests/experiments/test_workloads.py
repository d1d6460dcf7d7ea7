"""Workload generators: shapes, sharing, determinism, arrivals, and Mooncake trace replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.experiments.workloads import TokenSegments, WorkloadRequest, make_workload, sessions
from kvserve.experiments.workloads.agent_tools import agent_tools
from kvserve.experiments.workloads.arrivals import arrival_times
from kvserve.experiments.workloads.cache_reference import infinite_cache_reference
from kvserve.experiments.workloads.document_qa import document_qa
from kvserve.experiments.workloads.mooncake import mooncake_trace
from kvserve.experiments.workloads.multi_turn import customer_contexts, multi_turn
from kvserve.experiments.workloads.shared_prefix import shared_prefix
from kvserve.scheduler.request import Request


def is_sorted(requests: list[WorkloadRequest]) -> bool:
    times = [r.arrival_time for r in requests]
    return times == sorted(times)


def test_shared_prefix_requests_are_a_group_prompt_then_a_question() -> None:
    requests = shared_prefix(300, qps=10, num_groups=4, system_prompt_len=64, question_len=8, output_len=5)

    assert len(requests) == 4 * 4 + 300 and is_sorted(requests)  # a warm-up of 4 per group first
    assert {r.num_prompt_tokens for r in requests} == {72}
    assert {r.output_len for r in requests} == {5}
    by_group: dict[str, set[tuple[int, ...]]] = {}
    for r in requests:
        by_group.setdefault(r.group, set()).add(tuple(list(r.prompt_token_ids)[:64]))
    assert len(by_group) == 4 and all(len(prefixes) == 1 for prefixes in by_group.values())
    questions = {tuple(list(r.prompt_token_ids)[64:]) for r in requests}
    assert len(questions) == 316


@pytest.mark.parametrize(
    ("requests", "num_warmup"),
    [
        (shared_prefix(100, qps=10, num_groups=8, system_prompt_len=16, question_len=4), 4 * 8),
        (shared_prefix(100, qps=10, num_groups=8, warmup_per_group=1, system_prompt_len=16, question_len=4), 8),
        (shared_prefix(100, qps=10, num_groups=8, warmup_per_group=0, system_prompt_len=16, question_len=4), 0),
        (document_qa(100, qps=10, num_documents=5, document_len=32, question_len=4), 4 * 5),
    ],
    ids=["shared_prefix", "one_per_group", "none", "document_qa"],
)
def test_prefix_groups_start_with_a_marked_warm_up_then_the_measured_requests(
    requests: list[WorkloadRequest], num_warmup: int
) -> None:
    assert [r.measured for r in requests] == [False] * num_warmup + [True] * 100
    assert is_sorted(requests)


@pytest.mark.parametrize(
    ("requests", "shared_len"),
    [
        (shared_prefix(50, qps=10, num_groups=1, system_prompt_len=64, question_len=8), 64),
        (multi_turn(50, qps=10, system_prompt_len=32, user_len=8, answer_len=6), 32),
        (customer_contexts(50, qps=10, num_customers=1, context_len=48, user_len=8, answer_len=6), 48),
        (agent_tools(50, qps=10, num_tools=1, system_prompt_len=24, tool_spec_len=16), 40),
    ],
    ids=["shared_prefix", "multi_turn", "customer_contexts", "agent_tools"],
)
def test_requests_built_from_shared_segments_share_their_token_objects(
    requests: list[WorkloadRequest], shared_len: int
) -> None:
    # What keeps a large simulation's memory in check: a Request copies its
    # prompt, and the shared prefix of two copies must be the same int objects.
    first, second = (Request(str(i), r.prompt_token_ids) for i, r in enumerate(requests[:2]))
    assert first.prompt_token_ids == list(requests[0].prompt_token_ids)
    assert all(a is b for a, b in zip(first.all_token_ids[:shared_len], second.all_token_ids[:shared_len]))


def test_groups_times_prompts_gives_every_group_the_same_number_of_requests() -> None:
    requests = shared_prefix(60, qps=10, num_groups=4, prompts_per_group=15, system_prompt_len=8, question_len=4)

    measured = [r for r in requests if r.measured]
    assert sorted(sum(r.group == f"group-{g}" for r in measured) for g in range(4)) == [15, 15, 15, 15]
    assert sorted(sum(r.group == f"group-{g}" for r in requests) for g in range(4)) == [19, 19, 19, 19]
    assert [r.group for r in requests[:15]] != ["group-0"] * 15
    with pytest.raises(ValueError, match="num_groups x prompts_per_group"):
        shared_prefix(61, qps=10, num_groups=4, prompts_per_group=15)


def test_zipf_popularity_skews_groups() -> None:
    requests = shared_prefix(4000, qps=10, num_groups=16, system_prompt_len=4, question_len=4, zipf_exponent=1.2)
    counts = sorted((sum(r.group == g for r in requests) for g in {r.group for r in requests}), reverse=True)

    assert counts[0] > 4 * counts[-1]


def test_tenants_salt_their_groups() -> None:
    requests = shared_prefix(50, qps=10, num_groups=4, system_prompt_len=4, question_len=4, num_tenants=2)

    assert {r.cache_salt for r in requests} == {"tenant-0", "tenant-1"}
    assert all(r.cache_salt == f"tenant-{int(r.group.split('-')[1]) % 2}" for r in requests)


def test_the_same_seed_gives_the_same_stream_and_the_rate_changes_only_timing() -> None:
    a = make_workload("multi_turn", 200, qps=5, seed=3)
    b = make_workload("multi_turn", 200, qps=5, seed=3)
    c = make_workload("shared_prefix", 100, qps=5, seed=3, system_prompt_len=32)
    d = make_workload("shared_prefix", 100, qps=50, seed=3, system_prompt_len=32)

    assert a == b
    assert [r.prompt_token_ids for r in c] == [r.prompt_token_ids for r in d]
    assert [r.arrival_time for r in c] == pytest.approx([10 * r.arrival_time for r in d])
    assert make_workload("multi_turn", 200, qps=5, seed=4) != a


def test_multi_turn_prompts_grow_by_the_previous_answer_and_a_new_message() -> None:
    requests = multi_turn(400, qps=20, system_prompt_len=32, user_len=8, answer_len=6, min_turns=3, max_turns=3)
    sessions: dict[str, list[WorkloadRequest]] = {}
    for r in requests:
        sessions.setdefault(r.group, []).append(r)

    complete = [turns for turns in sessions.values() if len(turns) == 3]
    assert complete
    for turns in complete:
        for previous, current in zip(turns, turns[1:]):
            expected = list(previous.prompt_token_ids) + list(previous.output_token_ids)
            assert list(current.prompt_token_ids)[: len(expected)] == expected
            assert current.num_prompt_tokens == len(expected) + 8
            assert current.arrival_time > previous.arrival_time
    assert {tuple(list(r.prompt_token_ids)[:32]) for r in requests}.__len__() == 1


def test_sessions_are_in_steady_state_from_the_start_with_a_marked_warm_up() -> None:
    requests = multi_turn(3000, qps=50, think_time=4.0, system_prompt_len=16, user_len=8, answer_len=8)
    measured = [r for r in requests if r.measured]
    warm_up = [r for r in requests if not r.measured]
    times = np.array([r.arrival_time for r in measured])

    assert len(measured) == 3000 and is_sorted(requests)
    assert warm_up and max(r.arrival_time for r in warm_up) < 6.0 <= times.min()
    assert (len(times) - 1) / (times.max() - times.min()) == pytest.approx(50, rel=0.1)
    # Sessions under way at 0 arrive with their history: long prompts from the first second.
    assert max(r.num_prompt_tokens for r in warm_up[:50]) > 16 + 3 * 16


@pytest.mark.parametrize("workload", ["multi_turn", "customer_contexts", "agent_tools"])
@pytest.mark.parametrize(("num_requests", "qps"), [(10, 1e9), (10**12, 1.0)])
def test_a_stream_too_long_to_generate_is_refused_at_once(workload, num_requests, qps) -> None:  # noqa: ANN001
    # Sessions start 1.5 x think_time x max_turns before 0 at the rate's pace:
    # at 1e9 qps that is billions of turns whatever the number of measured
    # requests, and 1e12 measured turns are as many; the generator ground
    # through either until memory ran out.
    with pytest.raises(ValueError, match=r"the stream needs about [\d,]+ turns generated: .* the limit is 5,000,000"):
        make_workload(workload, num_requests, qps=qps)


def test_the_turn_limit_counts_the_sessions_before_0_the_warm_up_and_the_measured(monkeypatch) -> None:  # noqa: ANN001
    # 2 qps x 1.5 s of warm-up x (4 turns + 1) + 5 measured = 20 turns expected.
    monkeypatch.setattr(sessions, "MAX_GENERATED_TURNS", 20)
    kwargs = {"think_time": 1.0, "min_turns": 2, "max_turns": 4, "system_prompt_len": 8, "user_len": 4,
              "answer_len": 4}

    assert multi_turn(5, qps=2.0, **kwargs)
    with pytest.raises(ValueError, match="about 21 turns generated: 5 measured, 3 a warm-up"):
        multi_turn(5, qps=2.1, **kwargs)
    with pytest.raises(ValueError, match="about 21 turns generated: 6 measured, 3 a warm-up"):
        multi_turn(6, qps=2.0, **kwargs)


@pytest.mark.parametrize("workload", ["multi_turn", "agent_tools"])
def test_sessions_in_bursts_too_large_to_generate_are_refused(workload) -> None:  # noqa: ANN001
    # At burstiness 1e-6 nearly every gap between session starts is 0: time
    # stood still while sessions piled up, and the generator never ended
    # (agent_tools grew to 620 MB in 40 s).  The expected count passes the check.
    with pytest.raises(ValueError, match=r"generated 1[\d,]{5} turns, more than twice the \d+ expected, .* 1e-06"):
        make_workload(workload, 10, qps=1.0, burstiness=1e-6)
    assert make_workload(workload, 10, qps=1.0, burstiness=1e-2)  # bursty, within the limit


def test_customer_contexts_share_a_long_context_per_customer() -> None:
    requests = customer_contexts(300, qps=20, num_customers=5, context_len=256, user_len=8, answer_len=4)
    contexts: dict[str, set[tuple[int, ...]]] = {}
    for r in requests:
        contexts.setdefault(r.group.split("/")[0], set()).add(tuple(list(r.prompt_token_ids)[:256]))

    assert 1 < len(contexts) <= 5 and all(len(c) == 1 for c in contexts.values())


def test_agent_tasks_start_with_the_system_prompt_and_one_tool_spec() -> None:
    requests = agent_tools(300, qps=20, system_prompt_len=64, num_tools=10, tool_spec_len=32,
                           observation_len=8, action_len=4, zipf_exponent=1.5)
    systems = {tuple(list(r.prompt_token_ids)[:64]) for r in requests}
    tools = {tuple(list(r.prompt_token_ids)[64:96]) for r in requests}
    tool_counts = sorted((sum(r.group.startswith(f"tool-{t}/") for r in requests) for t in range(10)), reverse=True)

    assert len(systems) == 1 and 1 < len(tools) <= 10
    assert tool_counts[0] > 3 * max(tool_counts[-1], 1)


def test_document_qa_asks_many_questions_about_few_documents() -> None:
    requests = document_qa(200, qps=5, num_documents=4, document_len=512, question_len=16)

    assert {r.num_prompt_tokens for r in requests} == {528}
    assert len({r.group for r in requests}) == 4


def test_arrivals_have_the_requested_mean_rate_and_bursts_are_burstier() -> None:
    poisson = np.diff(arrival_times(20_000, 50.0, np.random.default_rng(0)))
    bursty = np.diff(arrival_times(20_000, 50.0, np.random.default_rng(0), burstiness=0.25))

    assert 1 / poisson.mean() == pytest.approx(50.0, rel=0.03)
    assert 1 / bursty.mean() == pytest.approx(50.0, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)


def test_token_segments_read_as_one_sequence() -> None:
    tokens = TokenSegments(([1, 2], [], [3, 4, 5])) + [6]

    assert list(tokens) == [1, 2, 3, 4, 5, 6]
    assert (len(tokens), tokens[2], tokens[-1], tokens[1:3]) == (6, 3, 6, [2, 3])
    assert tokens == [1, 2, 3, 4, 5, 6]


# -- Mooncake traces ------------------------------------------------------------------


def write_trace(path, rows) -> None:  # noqa: ANN001
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")


SAMPLE_TRACE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 250, "input_length": 600, "output_length": 7, "hash_ids": [1, 9]},
    {"timestamp": 2000, "input_length": 300, "output_length": 3, "hash_ids": [4]},
]


def test_mooncake_replay_maps_equal_hash_ids_to_equal_prefixes(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, SAMPLE_TRACE)

    requests = mooncake_trace(path)

    assert [r.arrival_time for r in requests] == [0.0, 0.25, 0.5, 2.0]
    assert [r.num_prompt_tokens for r in requests] == [1100, 600, 1024, 300]
    assert [r.output_len for r in requests] == [10, 7, 5, 3]
    first, third, second, fourth = (list(r.prompt_token_ids) for r in requests)
    assert first[:1024] == second  # ids [1, 2] shared
    assert third[:512] == first[:512] and third[512:] != first[512:600]  # id 1 shared, then 9 (partial)
    assert fourth[:300] != first[:300]
    reference = infinite_cache_reference(requests, block_size=16)
    assert reference.num_hit_tokens == 512 + 1008  # id 1 for the third; all but the last block of the second


def test_mooncake_replay_marks_its_first_records_as_a_warm_up(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, SAMPLE_TRACE * 5)  # 20 records, 5 at each timestamp

    default = mooncake_trace(path)
    half = mooncake_trace(path, warmup_fraction=0.5)

    assert [r.measured for r in default] == [False] * 2 + [True] * 18  # a tenth
    assert [r.measured for r in half] == [False] * 10 + [True] * 10
    assert all(r.measured for r in mooncake_trace(path, warmup_fraction=0))
    with pytest.raises(ValueError, match="warmup_fraction"):
        mooncake_trace(path, warmup_fraction=1.5)


def test_mooncake_replay_rescales_to_a_rate_and_caps_requests(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, SAMPLE_TRACE)

    requests = make_workload("mooncake", 3, qps=4.0, trace=str(path))

    assert len(requests) == 3
    assert requests[-1].arrival_time == pytest.approx(2 / 4.0)


def test_a_trace_of_one_instant_has_no_rate_to_rescale(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, [{**record, "timestamp": 700} for record in SAMPLE_TRACE])

    assert [r.arrival_time for r in mooncake_trace(path)] == [0.0] * 4  # as recorded
    with pytest.raises(ValueError, match=r"has no time span to rescale to 2 qps \(4 requests, all at one instant\)"):
        mooncake_trace(path, qps=2.0)
    with pytest.raises(ValueError, match=r"\(1 request, all at one instant\)"):
        mooncake_trace(path, qps=2.0, num_requests=1)


def test_a_malformed_trace_line_is_reported_with_its_number(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, [SAMPLE_TRACE[0], {"timestamp": 1, "input_length": 2000, "output_length": 1, "hash_ids": [1]}])

    with pytest.raises(ValueError, match="trace.jsonl:2"):
        mooncake_trace(path)


def test_unknown_workloads_and_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("chatbot", 10, qps=1)
    with pytest.raises(ValueError, match="the shared_prefix workload has no parameter num_gropus; its parameters"):
        make_workload("shared_prefix", 10, qps=1, num_gropus=3)


def test_mooncake_num_requests_takes_the_earliest_requests_of_an_unsorted_trace(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, SAMPLE_TRACE)  # timestamps 0, 500, 250, 2000

    requests = mooncake_trace(path, num_requests=2)

    assert [r.arrival_time for r in requests] == [0.0, 0.25]
    assert [r.num_prompt_tokens for r in requests] == [1100, 600]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("timestamp", float("nan"), "timestamp must be a finite number"),
        ("timestamp", "soon", "timestamp must be a finite number"),
        # Too large for a float: math.isfinite raised OverflowError, a traceback.
        pytest.param(
            "timestamp", 10**400, r"timestamp must be a finite number, got 10000000000000000000\.\.\. \(401 characters\)",
            id="timestamp-too-large-for-a-float",
        ),
        ("input_length", 1024.5, "input_length must be an integer >= 1"),
        ("output_length", True, "output_length must be an integer >= 1"),
        ("output_length", 0, "output_length must be an integer >= 1"),
        ("hash_ids", "12", "hash_ids must be a list of integers"),
        ("hash_ids", [1, 2.0], "hash_ids must be integers >= 0"),
        ("hash_ids", [1, -2], "hash_ids must be integers >= 0"),
    ],
)
def test_a_mooncake_record_of_the_wrong_type_is_reported_with_its_line(tmp_path, field, value, message) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, [SAMPLE_TRACE[0], {**SAMPLE_TRACE[1], field: value}])

    with pytest.raises(ValueError, match=f"trace.jsonl:2: not a Mooncake record: {message}"):
        mooncake_trace(path)


def test_a_trace_may_start_with_a_byte_order_mark(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, SAMPLE_TRACE)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # as some Windows tools write UTF-8

    assert [r.num_prompt_tokens for r in mooncake_trace(path)] == [1100, 600, 1024, 300]


def test_a_trace_without_records_or_with_an_endless_span_is_refused(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match="trace.jsonl holds no records"):
        mooncake_trace(path)

    # Each timestamp is finite, their difference is not: arrivals at inf, and figures of nan.
    write_trace(path, [{**SAMPLE_TRACE[0], "timestamp": -1e308}, {**SAMPLE_TRACE[1], "timestamp": 1e308}])
    with pytest.raises(ValueError, match="span from -1e\\+308 to 1e\\+308 ms, too long to replay"):
        mooncake_trace(path)


@pytest.mark.parametrize(
    ("workload", "params", "message"),
    [
        ("multi_turn", {"think_time": float("inf")}, "think_time must be a finite number >= 0"),
        ("multi_turn", {"think_time": float("nan")}, "think_time must be a finite number >= 0"),
        ("multi_turn", {"user_len": 2.5}, "user_len must be an integer >= 1"),
        ("customer_contexts", {"zipf_exponent": float("nan")}, "zipf_exponent must be a finite number >= 0"),
        ("customer_contexts", {"num_customers": 0}, "num_customers must be an integer >= 1"),
        ("agent_tools", {"think_time": float("inf")}, "think_time must be a finite number >= 0"),
        ("agent_tools", {"min_steps": 4, "max_steps": 2}, "need min_steps <= max_steps"),
        ("shared_prefix", {"num_groups": True}, "num_groups must be an integer >= 1"),
        ("shared_prefix", {"system_prompt_len": 0, "question_len": 0}, "system_prompt_len \\+ question_len"),
        ("shared_prefix", {"vocab_size": 3}, "vocab_size must be an integer >= 4"),
        ("document_qa", {"document_len": -1}, "document_len must be an integer >= 0"),
    ],
)
def test_generator_parameters_must_be_finite_and_in_range(workload, params, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        make_workload(workload, 10, qps=1.0, **params)


@pytest.mark.parametrize("block_tokens", [0, -4, 2.5])
def test_mooncake_block_tokens_must_be_a_positive_integer(tmp_path, block_tokens) -> None:  # noqa: ANN001
    path = tmp_path / "trace.jsonl"
    write_trace(path, SAMPLE_TRACE)

    with pytest.raises(ValueError, match="block_tokens must be an integer >= 1"):
        mooncake_trace(path, block_tokens=block_tokens)
