"""The infinite-cache reference: hit rate and prefix working set of a stream."""

from __future__ import annotations

from kvserve.experiments.workloads import WorkloadRequest
from kvserve.experiments.workloads.cache_reference import infinite_cache_reference


def test_infinite_cache_hits_every_full_block_seen_before_but_the_last_token() -> None:
    shared = list(range(3, 35))  # two blocks of 16
    requests = [
        WorkloadRequest(0.0, shared + [40, 41], 1),
        WorkloadRequest(1.0, shared + [50], 1),
        WorkloadRequest(2.0, shared, 1),  # 32 tokens: at most 31 can hit, so one block
        WorkloadRequest(3.0, shared, 1, cache_salt="other"),
    ]

    reference = infinite_cache_reference(requests, block_size=16)

    assert reference.num_hit_tokens == 32 + 16
    assert reference.num_prompt_tokens == 34 + 33 + 32 + 32
    assert reference.num_reused_blocks == 2
    assert reference.num_distinct_blocks == 4  # two blocks under each salt


def test_answers_given_by_the_workload_are_cached_for_the_next_turn() -> None:
    first = WorkloadRequest(0.0, [5] * 16, 17, output_token_ids=list(range(100, 117)))
    second = WorkloadRequest(1.0, [5] * 16 + list(range(100, 117)) + [9], 1)

    reference = infinite_cache_reference([first, second], block_size=16)

    assert reference.num_hit_tokens == 32
