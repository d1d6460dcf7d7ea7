"""The decoder layer's small kernels on a GPU: the CUDA extension's against Triton's.

For each of ``kernels.fused_elementwise``'s functions a step calls (residual add + RMSNorm,
RoPE with the K/V cache write, SiLU-and-mul), on Llama-3-8B's shapes (hidden 4,096, 32/8
heads x 128, intermediate 14,336, bfloat16) at a decode batch of 64 tokens and a prefill
chunk of 2,048:

* ``host us``: the host's median time to launch one call, the device idle before it.  An
  eager step launches about four of these a layer; where a step is bound by its host (eager
  mixed steps of small models, the step protocol's worker), this is what they cost it.
* ``device us``: one call's time on the device, from 50 calls captured in a CUDA graph and
  replayed (no launch gaps), median of 5 replays.

Each implementation runs in a process of its own (``KVSERVE_FUSED_KERNELS=1`` with the
extension loaded, ``=triton``), so that each is chosen as a step would choose it.

    python -m kvserve.bench.layer_ops
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

from kvserve.bench.prefill_attention import host_us
from kvserve.experiments.report import format_table

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
TOKENS = (64, 2048)
IMPLEMENTATIONS = {"cuda": "1", "triton": "triton"}
CAPTURED_CALLS = 50


def device_us(call) -> float:
    """One call's device microseconds: :data:`CAPTURED_CALLS` calls in a CUDA graph, median of 5 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture (Triton compiles here)
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CAPTURED_CALLS):
            call()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CAPTURED_CALLS)
    return statistics.median(times)


def measure(implementation: str) -> list[dict]:
    """This process's implementation of each op and token count (``KVSERVE_FUSED_KERNELS`` set)."""
    from kvserve.kernels import fused_elementwise as fused

    if implementation == "cuda":
        from kvserve.kernels.cuda_build import load_cuda_extension

        load_cuda_extension()
        assert fused.cuda_extension() is not None, "KVSERVE_FUSED_KERNELS=1 did not pick the extension"
    else:
        assert fused.cuda_extension() is None
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    weight = torch.randn(HIDDEN, device=device, dtype=dtype)
    num_slots = max(TOKENS) * 2
    key_cache, value_cache = torch.zeros(2, num_slots // 16, 16, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    rows = []
    for tokens in TOKENS:
        x, residual = torch.randn(2, tokens, HIDDEN, device=device, dtype=dtype)
        qkv = torch.randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=device, dtype=dtype)
        angles = torch.rand(tokens, HEAD_DIM // 2, device=device) * 6.28
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        slots = torch.randperm(num_slots, device=device)[:tokens]
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device=device, dtype=dtype)
        calls = {
            "add + RMSNorm": lambda: fused.add_rms_norm(x, weight, 1e-5, residual),
            "RoPE + cache write": lambda: fused.rope_and_write_kv(
                qkv, cos, sin, key_cache, value_cache, slots, NUM_HEADS),
            "SiLU-and-mul": lambda: fused.silu_and_mul(gate_up),
        }
        for op, call in calls.items():
            rows.append({"op": op, "tokens": tokens, "host_us": host_us(call, repeats=50),
                         "device_us": device_us(call)})
    return rows


def layer_ops_table(results: dict[str, list[dict]]) -> str:
    """One row per (op, tokens): each implementation's host and device microseconds."""
    names = list(results)
    table = []
    for index, row in enumerate(results[names[0]]):
        line = [row["op"], str(row["tokens"])]
        line += [f"{results[name][index]['host_us']:.1f}" for name in names]
        line += [f"{results[name][index]['device_us']:.1f}" for name in names]
        table.append(line)
    header = ["op", "tokens", *(f"{name} host us" for name in names), *(f"{name} device us" for name in names)]
    return format_table(header, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--implementation", choices=sorted(IMPLEMENTATIONS),
                        help="measure only this one, in this process, and print JSON (what the parent runs)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the layer's small kernels are measured on a GPU", file=sys.stderr)
        return 1
    if args.implementation:
        print(json.dumps(measure(args.implementation)))
        return 0
    results = {}
    for name, mode in IMPLEMENTATIONS.items():
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        child = subprocess.run(
            [sys.executable, "-m", "kvserve.bench.layer_ops", "--implementation", name],
            env=dict(os.environ, KVSERVE_FUSED_KERNELS=mode), capture_output=True, text=True, timeout=300,
        )
        if child.returncode != 0:
            print(f"{name}: failed\n{child.stderr[-3000:]}", file=sys.stderr)
            return 1
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{torch.cuda.get_device_name()}, bf16, Llama-3-8B's layer shapes")
    print(layer_ops_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
