"""InputBatch keeps block tables across plans and turns plans into model inputs."""

from __future__ import annotations

import torch

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.input_batch import InputBatch


def test_block_tables_track_the_scheduler_through_growth_preemption_and_finish() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=512),
        CacheConfig(block_size=2, num_blocks=40),
    )
    batch = InputBatch(block_size=2, device=torch.device("cpu"), initial_rows=2, initial_blocks=2)
    for i in range(5):
        scheduler.add_request(
            Request(f"r{i}", list(range(1, 4 + 3 * i)), SamplingParams(max_tokens=20, ignore_eos=True))
        )
    steps = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        batch.apply(plan)
        if plan.req_ids:
            inputs = batch.prepare(plan)
            for i, req_id in enumerate(plan.req_ids):
                assert batch.block_ids(req_id) == scheduler.kv_cache_manager.get_block_ids(req_id)
                expected_width = inputs.attn_metadata.block_tables.shape[1]
                row = inputs.attn_metadata.block_tables[i].tolist()
                assert row[: len(batch.block_ids(req_id))] == batch.block_ids(req_id)
                assert len(row) == expected_width
            assert inputs.input_ids.tolist() == plan.token_ids
        scheduler.update(plan, [7] * plan.num_sampled)
        steps += 1
    assert steps > 10
    assert batch.block_table.shape[0] >= 4  # rows grew
    plan = scheduler.schedule()
    batch.apply(plan)
    assert batch.requests == {}


def test_positions_and_output_indices_follow_the_plan() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=5), CacheConfig(block_size=4, num_blocks=16))
    scheduler.add_request(Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=3)))
    batch = InputBatch(block_size=4, device=torch.device("cpu"))
    plan = scheduler.schedule()  # a chunk of 5
    batch.apply(plan)
    inputs = batch.prepare(plan)
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4] and inputs.output_indices == []
    scheduler.update(plan, [])
    plan = scheduler.schedule()  # the last 2 prompt tokens, sampled
    batch.apply(plan)
    inputs = batch.prepare(plan)
    assert inputs.positions.tolist() == [5, 6]
    assert inputs.logits_indices.tolist() == [1] and inputs.output_indices == [0]


def test_a_request_sent_as_new_again_starts_with_an_empty_table() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=4, num_blocks=16))
    scheduler.add_request(Request("a", list(range(1, 10))))
    batch = InputBatch(block_size=4, device=torch.device("cpu"))
    plan = scheduler.schedule()
    batch.apply(plan)
    batch.apply(plan)  # the same admission again, e.g. replayed after a restart
    assert batch.block_ids("a") == scheduler.kv_cache_manager.get_block_ids("a")
