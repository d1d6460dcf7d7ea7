"""What a single unbounded prefix cache would do with a request stream.

The reference for routing experiments: one cache that never evicts and sees
every request in arrival order (and every answer a later turn reuses)
bounds the hit rate any fleet can reach.  Its reused blocks (those hit at
least once) are the stream's prefix working set, against which replica
caches are sized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.scheduler.block_hash import BlockHasher, num_cacheable_blocks


@dataclass(frozen=True, slots=True)
class CacheReference:
    """The infinite-cache figures of a stream."""

    num_prompt_tokens: int
    num_hit_tokens: int
    num_distinct_blocks: int
    num_reused_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def infinite_cache_reference(
    requests: Sequence[WorkloadRequest], block_size: int, model_id: str = ""
) -> CacheReference:
    """Hit rate and working set of ``requests`` under one cache that never evicts.

    As in the engine, a request can hit at most ``(prompt - 1) // block_size``
    blocks; its prompt blocks are then cached, and so are the blocks of its
    answer when the workload gives one (all but the last answer token have KV).
    Warm-up requests (``measured=False``) fill the cache but are not counted.
    """
    hasher = BlockHasher(block_size, model_id)
    cached: set[bytes] = set()
    reused: set[bytes] = set()
    num_prompt_tokens = 0
    num_hit_tokens = 0
    for request in requests:
        prompt = list(request.prompt_token_ids)
        hashes = hasher.hash_token_ids(prompt, request.cache_salt)
        max_hit = num_cacheable_blocks(len(prompt), block_size)
        num_hit = 0
        for block_hash in hashes[:max_hit]:
            if block_hash not in cached:
                break
            num_hit += 1
        reused.update(hashes[:num_hit])
        if request.measured:
            num_prompt_tokens += len(prompt)
            num_hit_tokens += num_hit * block_size
        cached.update(hashes)
        if request.output_token_ids is not None and len(request.output_token_ids) > 1:
            with_answer = list(chain(prompt, request.output_token_ids[:-1]))
            parent = hashes[-1] if hashes else None
            cached.update(hasher.hash_token_ids(with_answer, request.cache_salt, parent, len(hashes)))
    return CacheReference(num_prompt_tokens, num_hit_tokens, len(cached), len(reused))
