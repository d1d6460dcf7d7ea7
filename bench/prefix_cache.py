"""Benchmark (a): prefix lookup + hashing + allocation + free per request.

Workload: 1024-token prompts, block size 16, the first half of every prompt
shared with other requests (one of 16 shared prefixes), the second half
unique.  A window of requests stays allocated while new ones arrive, so the
pool cycles and allocation evicts cached blocks.  Per request we time what the
control plane does: build the request, hash its blocks, look up its prefix,
allocate slots (caching the new full blocks), and free it.

Baseline, measured in the same run: hashing the same prompts' blocks alone
(the part every engine must pay), so the ratio is the cost of the whole
control plane over that of hashing alone: 1.0 at best, lower is better.

    python -m kvserve.bench.prefix_cache [--requests N]
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve.bench.arg_types import int_at_least
from kvserve.experiments.report import format_table
from kvserve.scheduler.block_hash import BlockHasher
from kvserve.scheduler.kv_cache_manager import KVCacheManager
from kvserve.scheduler.request import Request

PROMPT_LEN = 1024
BLOCK_SIZE = 16
NUM_SHARED_PREFIXES = 16
LIVE_REQUESTS = 64
TARGET_US = 100.0
HEADERS = ["blocks", "us/request", "hashing-only us (baseline)", "us/request / hashing-only (lower: better)",
           "hit rate", f"<= {TARGET_US:.0f} us"]


def make_prompts(num_requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    half = PROMPT_LEN // 2
    prefixes = [[rng.randrange(32_000) for _ in range(half)] for _ in range(NUM_SHARED_PREFIXES)]
    return [
        prefixes[i % NUM_SHARED_PREFIXES] + [rng.randrange(32_000) for _ in range(half)]
        for i in range(num_requests)
    ]


def run_control_plane(prompts: list[list[int]], num_blocks: int) -> tuple[float, float]:
    """µs per request for the whole path, and the prefix hit rate."""
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    live: list[Request] = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt)
        computed = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, PROMPT_LEN - computed.num_tokens, computed) is None:
            raise RuntimeError("pool too small for the live window")
        request.num_computed_tokens = PROMPT_LEN
        live.append(request)
        if len(live) > LIVE_REQUESTS:
            manager.free(live.pop(0))
    for request in live:
        manager.free(request)
    elapsed = time.perf_counter() - start
    return elapsed / len(prompts) * 1e6, manager.prefix_cache_stats.hit_rate


def run_hashing_only(prompts: list[list[int]]) -> float:
    hasher = BlockHasher(BLOCK_SIZE)
    start = time.perf_counter()
    for prompt in prompts:
        hasher.hash_token_ids(prompt)
    return (time.perf_counter() - start) / len(prompts) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int_at_least(1), default=20_000, help="requests per run (default 20000)")
    args = parser.parse_args(argv)
    prompts = make_prompts(args.requests)
    hashing_us = min(run_hashing_only(prompts) for _ in range(3))
    rows = []
    for num_blocks in (10_000, 100_000):
        run_control_plane(prompts[:2000], num_blocks)  # warm up
        timings = [run_control_plane(prompts, num_blocks) for _ in range(3)]
        us = min(t for t, _ in timings)
        hit_rate = timings[0][1]
        rows.append(
            [num_blocks, f"{us:.1f}", f"{hashing_us:.1f}", f"{us / hashing_us:.2f}x",
             f"{hit_rate:.3f}", "yes" if us <= TARGET_US else "NO"]
        )
    print(f"prefix lookup + hashing + allocation + free, {PROMPT_LEN}-token prompts, "
          f"block size {BLOCK_SIZE}, half shared, {args.requests} requests (best of 3)")
    print(format_table(
        HEADERS,
        rows,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
