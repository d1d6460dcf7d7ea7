"""Decode attention on a GPU: the CUDA kernels against the device's copy bandwidth and a torch baseline.

Decode batches of 1/16/64/256 requests x contexts of 512/4k/16k tokens, 32 query heads
over 8 local KV heads of 128 dims, bfloat16, blocks of 16 in shuffled order.  In the
same run:

* copy bandwidth: a 4 GiB device-to-device copy, counting bytes read plus written; and,
  for reference, the read rate of a 4 GiB ``sum`` (attention reads, it hardly writes);
* the kernels (``CudaAttentionBackend``): bytes = K/V read + query + output, so
  ``% copy`` is achieved over measured copy bandwidth;
* the torch baseline: gather each request's blocks (``index_select``), then
  ``scaled_dot_product_attention`` in bfloat16 with the GQA group as query rows.

Times are medians over CUDA-event-timed replays of a CUDA graph of many calls (warm-up
first), rotating over enough copies of the inputs (disjoint blocks of one cache) that
they do not fit in L2.  Every case also checks the kernel against the baseline.
Targets on an H100: >= 75% of copy bandwidth at batch >= 16 with 4k context, and >= 3x
the baseline.  ``--prefill`` adds chunked-prefill cases against the torch reference backend.

    python -m kvserve.bench.attention [--batches 1,16,64,256] [--contexts 512,4096,16384]
                                      [--replays N] [--prefill] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.bench.arg_types import int_at_least, positive_ints, unwritable_reason
from kvserve.experiments.report import format_table
from kvserve.kernels import AttentionMetadata, build_attention_metadata
from kvserve.kernels.attention_metadata import attention_metadata_from_arrays
from kvserve.kernels.backend import TorchReferenceBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GROUP = NUM_HEADS // NUM_KV_HEADS
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
MAX_INPUT_SETS = 64
MIN_CALLS_PER_GRAPH = 10
TARGET_COPY_FRACTION = 0.75
TARGET_SPEEDUP = 3.0
# Chunked prefill cases: (requests, cached tokens, new tokens per request).
PREFILL_CASES = [(1, 0, 2048), (1, 4096, 512), (4, 0, 512), (8, 4096, 128)]


@dataclass(frozen=True, slots=True)
class DecodeResult:
    batch: int
    context: int
    kernel_us: float
    kernel_gbps: float
    copy_fraction: float
    baseline_us: float | None
    speedup: float | None
    relative_error: float
    graphs: bool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=positive_ints, default="1,16,64,256",
                        help="decode batch sizes (default 1,16,64,256)")
    parser.add_argument("--contexts", type=positive_ints, default="512,4096,16384",
                        help="context lengths (default 512,4096,16384)")
    parser.add_argument("--replays", type=int_at_least(1), default=30, help="timed replays per case (default 30)")
    parser.add_argument("--prefill", action="store_true", help="also time chunked prefill against the reference")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args(argv)
    if args.json is not None and (reason := unwritable_reason(Path(args.json))) is not None:
        parser.error(f"--json {args.json}: {reason}")  # before the minutes of measuring, not after
    if not torch.cuda.is_available():
        print(
            f"kvserve.bench.attention needs a CUDA device, and none is visible "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}).",
            file=sys.stderr,
        )
        return 1
    from kvserve.kernels.cuda_backend import CudaAttentionBackend
    from kvserve.kernels.cuda_build import CudaExtensionBuildError

    try:
        backend = CudaAttentionBackend()
    except CudaExtensionBuildError as exc:
        print(f"the CUDA attention kernels do not build here: {exc}", file=sys.stderr)
        return 1

    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2_bytes = getattr(properties, "L2_cache_size", 50 * 2**20)
    copy_gbps, read_gbps = memory_bandwidths_gbps(args.replays)
    print(f"{properties.name}: {properties.multi_processor_count} SMs, L2 {l2_bytes / 2**20:.0f} MiB, "
          f"device-to-device copy {copy_gbps:.0f} GB/s (read + write), sum reads {read_gbps:.0f} GB/s; {backend!r}")

    results = []
    for batch in args.batches:
        for context in args.contexts:
            results.append(run_decode_case(backend, batch, context, l2_bytes, copy_gbps, args.replays))
            torch.cuda.empty_cache()
    print_decode_table(results, copy_gbps)
    prefill_rows = run_prefill_cases(backend, args.replays) if args.prefill else []
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": properties.name, "copy_gbps": copy_gbps, "read_gbps": read_gbps,
                       "decode": [asdict(r) for r in results],
                       "prefill": prefill_rows}, file, indent=2)
    return 0 if all(r.relative_error < 1e-2 for r in results) else 1


def time_us_per_call(calls: list[Callable[[], object]], replays: int, *, use_graph: bool = True) -> tuple[float, bool]:
    """Median µs per call over ``replays`` timed runs of all ``calls``, and whether a CUDA graph ran them.

    The runs replay one CUDA graph of all ``calls`` where capture works, else launch them plainly.
    """
    for _ in range(2):  # warm-up, outside any capture: plans, allocator pools, lazy init
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = None
    if use_graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for call in calls:
                    call()
        except RuntimeError as exc:
            print(f"  (CUDA graph capture failed, timing plain launches: {exc})", file=sys.stderr)
            graph = None
            torch.cuda.synchronize()

    def run() -> None:
        if graph is not None:
            graph.replay()
        else:
            for call in calls:
                call()

    for _ in range(3):
        run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times) / len(calls), graph is not None


def memory_bandwidths_gbps(replays: int) -> tuple[float, float]:
    """The device's copy rate (bytes read + written) and read rate (a ``sum``), in GB/s, on one 4 GiB buffer.

    4 GiB is far past L2, as the large decode cases are.
    """
    source = torch.randn(2**31, dtype=DTYPE, device="cuda")
    target = torch.empty_like(source)
    num_bytes = source.numel() * source.element_size()
    copy_us, _ = time_us_per_call([functools.partial(target.copy_, source)] * MIN_CALLS_PER_GRAPH, replays)
    del target
    read_us, _ = time_us_per_call([source.sum] * MIN_CALLS_PER_GRAPH, replays)
    del source
    return 2 * num_bytes / (copy_us * 1e-6) / 1e9, num_bytes / (read_us * 1e-6) / 1e9


def decode_sets(batch: int, context: int, num_sets: int) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
    """One bfloat16 cache holding ``num_sets`` disjoint copies of a decode batch, in shuffled blocks."""
    blocks_per_req = context // BLOCK_SIZE
    num_blocks = num_sets * batch * blocks_per_req + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    value_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    block_ids = (np.random.default_rng(batch * 100_003 + context).permutation(num_blocks - 1) + 1).astype(np.int64)
    query_lens, seq_lens = np.ones(batch, dtype=np.int64), np.full(batch, context, dtype=np.int64)
    sets = []
    for s in range(num_sets):
        tables = block_ids[s * batch * blocks_per_req : (s + 1) * batch * blocks_per_req].reshape(batch, -1)
        sets.append(attention_metadata_from_arrays(query_lens, seq_lens, tables, BLOCK_SIZE, "cuda"))
    return key_cache, value_cache, sets


def baseline_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, context: int) -> torch.Tensor:
    """Gather every request's blocks into a dense copy, then SDPA (the GQA group as query rows)."""
    batch = query.shape[0]
    block_ids = metadata.block_tables.view(-1)
    keys = key_cache.index_select(0, block_ids).view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    values = value_cache.index_select(0, block_ids).view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    queries = query.view(batch, NUM_KV_HEADS, GROUP, HEAD_DIM)
    return F.scaled_dot_product_attention(queries, keys, values, scale=SCALE).view(batch, NUM_HEADS, HEAD_DIM)


def relative_error(output: torch.Tensor, expected: torch.Tensor) -> float:
    """‖output − expected‖ / ‖expected‖ in float32; infinite where the output holds NaN."""
    if output.isnan().any():
        return math.inf
    return ((output.float() - expected.float()).norm() / expected.float().norm()).item()


def run_decode_case(backend, batch: int, context: int, l2_bytes: int, copy_gbps: float, replays: int) -> DecodeResult:
    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
    # Disjoint copies of the batch, together 4x L2 (at most 64), so that the timed calls miss in L2.
    num_sets = max(1, min(MAX_INPUT_SETS, math.ceil(4 * l2_bytes / kv_bytes)))
    key_cache, value_cache, sets = decode_sets(batch, context, num_sets)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    num_calls = max(num_sets, MIN_CALLS_PER_GRAPH)

    def kernel_call(metadata: AttentionMetadata) -> Callable[[], torch.Tensor]:
        return lambda: backend.paged_attention(query, key_cache, value_cache, metadata, SCALE)

    def baseline_call(metadata: AttentionMetadata) -> Callable[[], torch.Tensor]:
        return lambda: baseline_decode(query, key_cache, value_cache, metadata, context)

    error = relative_error(kernel_call(sets[0])(), baseline_call(sets[0])())

    kernel_us, graphs = time_us_per_call([kernel_call(sets[i % num_sets]) for i in range(num_calls)], replays)
    # A graph keeps every call's gathered copy of the cache alive: at 256 x 16k that is 17 GB a
    # call.  Where the copies would not fit easily, plain launches (each call is milliseconds).
    free_bytes, _ = torch.cuda.mem_get_info()
    baseline_graph = num_calls * kv_bytes <= free_bytes // 4
    try:
        baseline_us, _ = time_us_per_call([baseline_call(sets[i % num_sets]) for i in range(num_calls)], replays,
                                          use_graph=baseline_graph)
    except torch.cuda.OutOfMemoryError:
        baseline_us = None
    # K/V read, plus the query read and the output written.
    kernel_gbps = (kv_bytes + 2 * batch * NUM_HEADS * HEAD_DIM * DTYPE.itemsize) / (kernel_us * 1e-6) / 1e9
    result = DecodeResult(
        batch=batch, context=context, kernel_us=kernel_us, kernel_gbps=kernel_gbps,
        copy_fraction=kernel_gbps / copy_gbps, baseline_us=baseline_us,
        speedup=None if baseline_us is None else baseline_us / kernel_us,
        relative_error=error, graphs=graphs,
    )
    print(f"  batch {batch:4d} context {context:6d}: {kernel_us:9.1f} us, {kernel_gbps:6.0f} GB/s, "
          f"baseline {'OOM' if baseline_us is None else f'{baseline_us:9.1f} us'}, rel. error {error:.1e}")
    return result


def print_decode_table(results: list[DecodeResult], copy_gbps: float) -> None:
    rows = [
        [r.batch, r.context, f"{r.kernel_us:.1f}", f"{r.kernel_gbps:.0f}", f"{100 * r.copy_fraction:.0f}%",
         "OOM" if r.baseline_us is None else f"{r.baseline_us:.1f}",
         "-" if r.speedup is None else f"{r.speedup:.2f}x", f"{r.relative_error:.1e}"]
        for r in results
    ]
    print(f"\ndecode attention, {NUM_HEADS} query / {NUM_KV_HEADS} KV heads x {HEAD_DIM}, bfloat16, block "
          f"{BLOCK_SIZE}; copy bandwidth {copy_gbps:.0f} GB/s; median us per call")
    print(format_table(
        ["batch", "context", "kernel us", "GB/s", "% copy", "torch us", "speed-up", "rel. error"], rows
    ))
    targeted = [r for r in results if r.batch >= 16 and r.context == 4096]
    if targeted:
        worst = min(r.copy_fraction for r in targeted)
        print(f"target: >= {100 * TARGET_COPY_FRACTION:.0f}% of copy bandwidth at batch >= 16, 4k context: "
              f"worst {100 * worst:.0f}% -> {'met' if worst >= TARGET_COPY_FRACTION else 'MISSED'}")
    speedups = [r.speedup for r in results if r.speedup is not None]
    if speedups:
        print(f"target: >= {TARGET_SPEEDUP:.0f}x the torch baseline: worst {min(speedups):.2f}x, "
              f"median {statistics.median(speedups):.2f}x -> {'met' if min(speedups) >= TARGET_SPEEDUP else 'MISSED'}")
    targeted_speedups = [r.speedup for r in targeted if r.speedup is not None]
    if targeted_speedups:
        print(f"        at batch >= 16, 4k context: worst {min(targeted_speedups):.2f}x -> "
              f"{'met' if min(targeted_speedups) >= TARGET_SPEEDUP else 'MISSED'}")
    if any(r.relative_error >= 1e-2 for r in results):
        print("ERROR: the kernel and the baseline disagree (relative error >= 1e-2)")


def run_prefill_cases(backend, replays: int) -> list[dict[str, float]]:
    """Chunked prefill: the CUDA kernels against the torch reference backend (the worker's former path)."""
    reference_backend = TorchReferenceBackend()
    rows, table = [], []
    for num_reqs, cached, new in PREFILL_CASES:
        seq_len = cached + new
        blocks_per_req = -(-seq_len // BLOCK_SIZE)
        block_tables = [list(range(1 + r * blocks_per_req, 1 + (r + 1) * blocks_per_req)) for r in range(num_reqs)]
        metadata = build_attention_metadata([new] * num_reqs, [seq_len] * num_reqs, block_tables, BLOCK_SIZE, "cuda")
        shape = (num_reqs * blocks_per_req + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        key_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        value_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        query = torch.randn(num_reqs * new, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        args = (query, key_cache, value_cache, metadata, SCALE)
        output, expected = backend.paged_attention(*args), reference_backend.paged_attention(*args)
        error = ((output.float() - expected.float()).norm() / expected.float().norm()).item()
        kernel_us, _ = time_us_per_call([lambda: backend.paged_attention(*args)], replays, use_graph=False)
        reference_us, _ = time_us_per_call([lambda: reference_backend.paged_attention(*args)], replays,
                                           use_graph=False)
        # Causal: new token j attends to cached + j + 1 keys; 2 FLOPs per multiply-add, QK and PV.
        flops = 4 * NUM_HEADS * HEAD_DIM * num_reqs * sum(cached + j + 1 for j in range(new))
        rows.append(dict(requests=num_reqs, cached=cached, new=new, kernel_us=kernel_us, reference_us=reference_us,
                         kernel_tflops=flops / (kernel_us * 1e-6) / 1e12, relative_error=error))
        table.append([num_reqs, cached, new, f"{kernel_us:.1f}", f"{flops / (kernel_us * 1e-6) / 1e12:.1f}",
                      f"{reference_us:.1f}", f"{reference_us / kernel_us:.2f}x", f"{error:.1e}"])
    print("\nchunked prefill, same heads; median us per call (plain launches)")
    print(format_table(["requests", "cached", "new", "kernel us", "TFLOP/s", "reference us", "speed-up",
                        "rel. error"], table))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
