"""Decode attention: the C++ CPU kernel against the torch reference, on one batch.

64 decode requests with contexts of 300-640 tokens in shuffled blocks of 16,
4 query heads over 2 KV heads of 16 dims, float32.  Both backends run the same
batch, interleaved, ``--rounds`` times ``--calls`` calls; the table shows
milliseconds per call (min and median over rounds) and the speed-up of the
CPU backend against the reference.

    python -m kvserve.bench.decode_attention [--threads N] [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvserve.bench.arg_types import int_at_least
from kvserve.experiments.report import format_table
from kvserve.kernels import AttentionMetadata, build_attention_metadata
from kvserve.kernels.cpu_backend import CpuAttentionBackend
from kvserve.kernels.reference import paged_attention

NUM_REQS = 64
CONTEXT_RANGE = (300, 640)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 16


def decode_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query, key cache, value cache and metadata of one decode-only batch."""
    rng = random.Random(seed)
    seq_lens = [rng.randint(*CONTEXT_RANGE) for _ in range(NUM_REQS)]
    blocks_per_req = [-(-seq_len // BLOCK_SIZE) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    free_block_ids = list(range(1, num_blocks))
    rng.shuffle(free_block_ids)
    block_tables = []
    for count in blocks_per_req:
        block_tables.append(free_block_ids[:count])
        del free_block_ids[:count]
    generator = torch.Generator().manual_seed(seed)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=generator)
    value_cache = torch.randn(cache_shape, generator=generator)
    query = torch.randn(NUM_REQS, NUM_HEADS, HEAD_DIM, generator=generator)
    metadata = build_attention_metadata([1] * NUM_REQS, seq_lens, block_tables, BLOCK_SIZE, "cpu")
    return query, key_cache, value_cache, metadata


def ms_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int_at_least(1), default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=int_at_least(1), default=15, help="timed rounds per backend (default 15)")
    parser.add_argument("--calls", type=int_at_least(1), default=20, help="calls per round (default 20)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    query, key_cache, value_cache, metadata = decode_batch()
    scale = HEAD_DIM**-0.5
    cpu_backend = CpuAttentionBackend()
    runs = {
        "torch reference": lambda: paged_attention(query, key_cache, value_cache, metadata, scale),
        "cpu (C++ kernel)": lambda: cpu_backend.paged_attention(query, key_cache, value_cache, metadata, scale),
    }
    torch.testing.assert_close(runs["cpu (C++ kernel)"](), runs["torch reference"](), atol=1e-5, rtol=1e-5)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):  # interleaved, so that load from elsewhere hits both alike
        for name, run in runs.items():
            times[name].append(ms_per_call(run, args.calls))
    baseline = min(times["torch reference"])
    rows = [
        [name, f"{min(t):.3f}", f"{statistics.median(t):.3f}", f"{baseline / min(t):.2f}x"]
        for name, t in times.items()
    ]
    print(
        f"decode attention, {NUM_REQS} requests, contexts {CONTEXT_RANGE[0]}-{CONTEXT_RANGE[1]}, "
        f"{NUM_HEADS}/{NUM_KV_HEADS} heads x {HEAD_DIM}, block {BLOCK_SIZE}, float32, {args.threads} threads"
    )
    print(format_table(["backend", "min ms/call", "median ms/call", "speed-up (min)"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
