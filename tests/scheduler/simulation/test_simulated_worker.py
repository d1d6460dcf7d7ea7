"""The simulated worker: the modelled step time on every rank, the simulator's tokens on rank 0."""

from __future__ import annotations

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulated_executor import synthetic_output_token_array
from kvserve.scheduler.simulation.simulated_worker import (
    SimulatedWorker,
    SimulatedWorkerConfig,
    SimulationConfig,
)

MODEL = StepCostModel(a=0.01, b=1e-4, c=1e-3, d=0.0)
VOCAB_SIZE = 500
NUM_BLOCKS = 64


def make_worker(rank: int = 0, tp_size: int = 1, *, scripts=None, slept=None) -> SimulatedWorker:  # noqa: ANN001
    simulation = SimulationConfig(
        cost_model=MODEL, time_scale=2.0, vocab_size=VOCAB_SIZE, scripted_output_token_ids=scripts or {}
    )
    config = SimulatedWorkerConfig(simulation, num_blocks=NUM_BLOCKS, rank=rank, tp_size=tp_size)
    worker = SimulatedWorker(config, sleep=(slept.append if slept is not None else lambda seconds: None))
    worker.initialize_cache(worker.determine_num_blocks())
    return worker


def make_scheduler(max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
    )


def run_to_completion(scheduler: Scheduler, worker: SimulatedWorker) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        result = worker.execute(plan)
        for output in scheduler.update(plan, result.sampled_token_ids, result.logprobs):
            outputs.setdefault(output.req_id, []).append(output.token_id)
    return outputs


def add(scheduler: Scheduler, req_id: str, num_prompt_tokens: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(Request(req_id, list(range(3, 3 + num_prompt_tokens)), params))


def test_it_reports_its_configured_blocks() -> None:
    worker = make_worker()

    assert worker.determine_num_blocks() == NUM_BLOCKS


def test_rank_zero_samples_the_tokens_the_simulator_samples() -> None:
    scheduler = make_scheduler()
    worker = make_worker()
    # The second prompt takes two chunked-prefill steps (64-token budget).
    for req_id, num_prompt_tokens, max_tokens in (("0", 10, 5), ("1", 90, 4), ("2", 7, 6)):
        add(scheduler, req_id, num_prompt_tokens, max_tokens)

    outputs = run_to_completion(scheduler, worker)

    assert outputs == {
        "0": synthetic_output_token_array("0", 10, 5, VOCAB_SIZE).tolist(),
        "1": synthetic_output_token_array("1", 90, 4, VOCAB_SIZE).tolist(),
        "2": synthetic_output_token_array("2", 7, 6, VOCAB_SIZE).tolist(),
    }


def test_every_rank_sleeps_the_scaled_step_time_and_only_rank_zero_answers() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 10, 3)
    plan = scheduler.schedule()
    slept: dict[int, list[float]] = {0: [], 1: []}
    workers = [make_worker(rank, tp_size=2, slept=slept[rank]) for rank in (0, 1)]

    results = [worker.execute(plan) for worker in workers]

    assert slept[0] == slept[1] == [pytest.approx(2.0 * MODEL.step_time(plan))]
    expected = synthetic_output_token_array("a", 10, 1, VOCAB_SIZE).tolist()
    assert results[0] is not None and results[0].sampled_token_ids == expected
    assert results[1] is None


def test_a_scripted_request_answers_with_its_script_and_the_others_stay_synthetic() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    worker = make_worker(scripts={"turn-2": [11, 12, 13, 14]})
    add(scheduler, "turn-1", 20, 3)
    add(scheduler, "turn-2", 50, 4)  # chunked over several steps: its first token sits at position 50

    outputs = run_to_completion(scheduler, worker)

    assert outputs["turn-2"] == [11, 12, 13, 14]
    assert outputs["turn-1"] == synthetic_output_token_array("turn-1", 20, 3, VOCAB_SIZE).tolist()


def test_a_step_before_initialize_cache_is_refused() -> None:
    config = SimulatedWorkerConfig(SimulationConfig(MODEL, vocab_size=VOCAB_SIZE), num_blocks=NUM_BLOCKS)
    scheduler = make_scheduler()
    add(scheduler, "a", 10, 1)

    with pytest.raises(RuntimeError, match="initialize_cache"):
        SimulatedWorker(config).execute(scheduler.schedule())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SimulationConfig(MODEL, time_scale=-1.0), "time_scale"),
        (lambda: SimulationConfig(MODEL, vocab_size=2), "vocab_size"),
        (lambda: SimulationConfig(MODEL, vocab_size=10, scripted_output_token_ids={"a": [3, 10]}), "vocabulary"),
        (lambda: SimulatedWorkerConfig(SimulationConfig(MODEL), num_blocks=64), "vocab_size"),
        (lambda: SimulatedWorkerConfig(SimulationConfig(MODEL, vocab_size=100), num_blocks=1), "num_blocks"),
        (
            lambda: SimulatedWorkerConfig(SimulationConfig(MODEL, vocab_size=100), num_blocks=8, rank=2, tp_size=2),
            "rank",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_field(make, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        make()
