"""Prefill attention on a GPU: kvserve's paged path against dense causal FlashAttention.

Cases (32 query / 8 KV heads x 128, bfloat16, blocks of 16 in shuffled order): one
request of 2,048 and of 8,192 new tokens, and a chunk of 512 new tokens over 4,096
cached.  For each, in one run:

* ``kvserve``: ``CudaAttentionBackend.paged_attention`` on the paged cache as a step
  calls it (FlashAttention on K/V gathered from the blocks);
* ``CUDA cores``: the same backend with ``flash_prefill=False`` (the earlier path);
* ``dense flash``: torch's FlashAttention on the same tokens in contiguous tensors
  (``scaled_dot_product_attention`` with ``is_causal`` for new prompts; the varlen
  kernel, aligned to the bottom right, for the chunk over cached context).

TFLOP/s count the causal (query, key) pairs: 4 x heads x head_dim FLOPs each, over the
median device time of 20 calls queued back to back (:func:`time_ms`), for every path
alike.  ``kvserve host us`` is the host's time to queue one call of the paged path: in
a forward pass it overlaps the device's work on the layers before, while it is shorter.
(Until session 44 every call waited for the device before the next was queued, which
added the host's time to each figure: 0.49-0.56 of dense flash at 2,048 tokens.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvserve.experiments.report import format_table
from kvserve.kernels import build_attention_metadata
from kvserve.kernels.flash_prefill import flash_varlen_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SCALE = HEAD_DIM**-0.5
# (cached tokens, new tokens)
CASES = [(0, 2048), (0, 8192), (4096, 512)]


def time_ms(call, repeats: int = 20) -> float:
    """The median device time of ``call`` in ms, between events around each call.

    The calls are queued back to back and the host waits once, after the last: as in a
    forward pass, where the host queues a layer's launches while the device runs the
    layers before, the host's own time per call is hidden as long as it is shorter
    than the device's (:func:`host_us` measures it).  Waiting after every call would
    add the host's time to every figure and favour the path with the fewest launches.
    """
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def host_us(call, repeats: int = 20) -> float:
    """The host's median microseconds to queue ``call`` (the device idle before each)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def run_case(cached: int, new: int) -> dict[str, float]:
    from kvserve.kernels.cuda_backend import CudaAttentionBackend

    seq_len = cached + new
    num_blocks = -(-seq_len // BLOCK_SIZE)
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_blocks + 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    value_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    table = (torch.randperm(num_blocks + 7, device="cuda", generator=generator)[:num_blocks] + 1).tolist()
    query = torch.randn(new, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    metadata = build_attention_metadata([new], [seq_len], [table], BLOCK_SIZE, "cuda")
    flash = CudaAttentionBackend()
    cuda_cores = CudaAttentionBackend(flash_prefill=False)
    ours = lambda: flash.paged_attention(query, key_cache, value_cache, metadata, SCALE)  # noqa: E731
    ours_ms = time_ms(ours)
    ours_host_us = host_us(ours)
    cores_ms = time_ms(lambda: cuda_cores.paged_attention(query, key_cache, value_cache, metadata, SCALE))
    slots = torch.tensor(table, device="cuda")
    keys = key_cache[slots].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].contiguous()
    values = value_cache[slots].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].contiguous()
    expected = None
    if cached == 0:
        q, k, v = (t.transpose(0, 1)[None] for t in (query, keys, values))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            dense = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
            dense_ms = time_ms(dense)
            expected = dense()[0].transpose(0, 1)
    else:
        cu_q = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
        dense = lambda: flash_varlen_attention(query, keys, values, cu_q, cu_k, new, seq_len, SCALE)
        dense_ms = time_ms(dense)
        expected = dense()
    error = (flash.paged_attention(query, key_cache, value_cache, metadata, SCALE).float() - expected.float()).abs().max()
    pairs = new * cached + new * (new + 1) / 2
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs
    return {
        "cached": cached, "new": new, "kvserve_ms": ours_ms, "kvserve_host_us": ours_host_us, "cuda_cores_ms": cores_ms, "dense_ms": dense_ms,
        "kvserve_tflops": flops / ours_ms / 1e9, "cuda_cores_tflops": flops / cores_ms / 1e9,
        "dense_tflops": flops / dense_ms / 1e9, "max_abs_error": float(error),
    }


def prefill_table(results: list[dict[str, float]]) -> str:
    rows = [
        [f"{r['new']:,} new over {r['cached']:,} cached", f"{r['kvserve_ms']:.3f}", f"{r['kvserve_host_us']:.0f}",
         f"{r['kvserve_tflops']:.0f}", f"{r['cuda_cores_tflops']:.0f}", f"{r['dense_tflops']:.0f}",
         f"{r['kvserve_tflops'] / r['dense_tflops']:.2f}", f"{r['max_abs_error']:.3g}"]
        for r in results
    ]
    return format_table(
        ["case", "kvserve ms", "kvserve host us", "kvserve TFLOP/s", "CUDA cores TFLOP/s", "dense flash TFLOP/s", "kvserve / dense",
         "max |diff|"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not torch.cuda.is_available():
        # Exit code 1 as bench.attention's: a missing device is not a usage error.
        print(f"kvserve.bench.prefill_attention needs a CUDA device, and none is visible "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}).", file=sys.stderr)
        return 1
    print(prefill_table([run_case(cached, new) for cached, new in CASES]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
