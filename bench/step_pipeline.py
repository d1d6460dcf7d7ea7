"""Benchmark: does the step protocol's round trip hide behind the workers' steps?

A GPU worker's step has two costs in series on its own resources: the host's time to
queue the step (``InputBatch`` updates, the graph replay or the eager launches: 1.6 ms
for the 1B shape on an H200, session 43) and the device's time to run it.  With async
scheduling the scheduler plans step N+1 while the device runs step N.  In process, one
thread plans, launches and applies, so a step costs at least host launch + plan + apply.
Over the step protocol those run in two processes, but with one step left in flight
the workers get plan N+2 only after they answered N: answer, apply, plan and send sit
between two of their launches.  With two steps in flight (``EngineCore.steps_ahead``, the
cluster's default) the workers hold the next plan when they finish a step.

This runs the same decode workload three ways against a stand-in GPU worker
(``EmulatedGpuWorker``: ``launch`` holds its thread, and the GIL, for ``host_ms`` as a
real launch does, then returns; its "device" runs each step ``device_ms`` after the later of
its launch and the previous step's end; tokens are the simulator's synthetic ones):

* in process: ``EngineCore`` with async scheduling, one step ahead (what ``LLM`` does);
* over the step protocol (real gRPC to a spawned worker process, the cluster's
  ``GrpcReplicaExecutor`` and ``StepWorkerServicer``), one step ahead and two.

It prints output tokens/s, each against in process, and the floor
max(host, device) per step.  Outputs must be equal token for token in every mode.

    python -m kvserve.bench.step_pipeline [--requests 64] [--output-tokens 256]
        [--cases 1.6:1.3,0.5:2.0,2.0:1.0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from kvserve.bench.arg_types import int_at_least
from kvserve.bench.emulated_gpu_worker import VOCAB_SIZE, EmulatedGpu, EmulatedGpuWorker
from kvserve.bench.grpc_replica import worker_server
from kvserve.cluster.replica_client import STEPS_AHEAD, GrpcReplicaExecutor
from kvserve.experiments.report import format_table
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

BLOCK_SIZE = 16
PROMPT_TOKENS = 128


def _requests(num_requests: int, output_tokens: int, run: int) -> list[Request]:
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
    # Distinct prompts per run: no run hits the prefix cache filled by another.
    return [Request(f"run{run}-req{i}", [(7 * i + j + 1000 * run) % VOCAB_SIZE for j in range(PROMPT_TOKENS)], params)
            for i in range(num_requests)]


def _scheduler(num_requests: int, num_blocks: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(8192, num_requests * PROMPT_TOKENS), max_num_seqs=num_requests,
                        max_model_len=4096),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
    )


def _outputs(requests: list[Request]) -> list[list[int]]:
    return [list(r.output_token_ids) for r in requests]


def run_in_process(gpu: EmulatedGpu, num_requests: int, output_tokens: int, run: int) -> tuple[float, list]:
    """Seconds for the workload with ``EngineCore`` and the worker in this process, and its outputs."""
    engine = EngineCore(_scheduler(num_requests, gpu.num_blocks), EmulatedGpuWorker(gpu), async_scheduling=True,
                        steps_ahead=1)
    requests = _requests(num_requests, output_tokens, run)
    for request in requests:
        engine.add_request(request)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start, _outputs(requests)


async def _run_over_grpc(address: str, secret: str, gpu: EmulatedGpu, num_requests: int, output_tokens: int,
                         steps_ahead: int, run: int) -> tuple[float, list]:
    executor = GrpcReplicaExecutor(0, [address], secret=secret)
    try:
        num_blocks = await executor.initialize_cache()
        engine = EngineCore(_scheduler(num_requests, num_blocks), executor, async_scheduling=True,
                            steps_ahead=steps_ahead)
        requests = _requests(num_requests, output_tokens, run)
        for request in requests:
            engine.add_request(request)
        start = time.perf_counter()
        while engine.has_unfinished_requests():  # the scheduler actor's step loop, without Ray
            await engine.run_step_async(engine.begin_step())
        return time.perf_counter() - start, _outputs(requests)
    finally:
        await executor.shutdown()


def measure(gpu: EmulatedGpu, num_requests: int, output_tokens: int, repeat: int,
            steps_ahead_modes: tuple[int, ...]) -> dict[str, float]:
    """Median seconds per mode ("in process", "gRPC, k ahead"); ``RuntimeError`` if outputs differ."""
    seconds: dict[str, list[float]] = {}
    with worker_server(gpu, runner=EmulatedGpuWorker) as (address, secret):
        for run in range(repeat + 1):  # run 0 warms both paths up
            took, reference = run_in_process(gpu, num_requests, output_tokens, run)
            timed = {"in process": took}
            for k in steps_ahead_modes:
                took, outputs = asyncio.run(_run_over_grpc(address, secret, gpu, num_requests, output_tokens, k, run))
                # The same requests: their tokens depend on (request id, position) alone.
                if outputs != reference:
                    raise RuntimeError(f"gRPC, {k} ahead: outputs differ from in process's")
                timed[f"gRPC, {k} ahead"] = took
            if run:
                for name, took in timed.items():
                    seconds.setdefault(name, []).append(took)
    return {name: statistics.median(values) for name, values in seconds.items()}


def _parse_cases(text: str) -> list[tuple[float, float]]:
    cases = []
    for item in text.split(","):
        host, sep, device = item.partition(":")
        try:
            case = (float(host), float(device))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a case is HOST_MS:DEVICE_MS, got {item!r}") from None
        if not sep or min(case) < 0:
            raise argparse.ArgumentTypeError(f"a case is HOST_MS:DEVICE_MS with both >= 0, got {item!r}")
        cases.append(case)
    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.step_pipeline",
        description=__doc__.split("\n\n")[0],
        epilog="Each case is HOST_MS:DEVICE_MS: the stand-in worker's host time to launch a step and its "
               "device time to run it. 1.6:1.3 is near the 1B shape's decode step on an H200: session 43 "
               "measured a 1.6 ms host launch, and a 1.1 ms step at batch 64 (1.93x its 0.58 ms floor).",
    )
    parser.add_argument("--requests", type=int_at_least(1), default=64, help="decoding requests (default 64)")
    parser.add_argument("--output-tokens", type=int_at_least(2), default=256,
                        help="tokens each request generates (default 256)")
    parser.add_argument("--cases", type=_parse_cases, default=_parse_cases("1.6:1.3,0.5:2.0,2.0:1.0"),
                        help="comma-separated HOST_MS:DEVICE_MS cases (default 1.6:1.3,0.5:2.0,2.0:1.0)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3, help="timed runs per mode, median (default 3)")
    args = parser.parse_args(argv)
    modes = tuple(sorted({1, STEPS_AHEAD}))
    num_blocks = 1 + args.requests * -(-(PROMPT_TOKENS + args.output_tokens) // BLOCK_SIZE) * 2
    steps = args.output_tokens  # one prefill step that samples, then one decode step per further token
    tokens = args.requests * args.output_tokens
    rows = []
    for host_ms, device_ms in args.cases:
        print(f"case host {host_ms} ms, device {device_ms} ms ...", flush=True)
        gpu = EmulatedGpu(host_ms, device_ms, num_blocks)
        seconds = measure(gpu, args.requests, args.output_tokens, args.repeat, modes)
        floor_s = steps * max(host_ms, device_ms) / 1e3
        base = seconds["in process"]
        for name, took in seconds.items():
            rows.append([f"{host_ms:g}", f"{device_ms:g}", name, f"{took * 1e3 / steps:.2f}",
                         f"{tokens / took:.0f}", f"{base / took:.2f}", f"{floor_s / took:.2f}"])
    print(f"{args.requests} requests x {args.output_tokens} tokens, {args.repeat} timed runs each (median); "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(format_table(["host ms", "device ms", "mode", "ms / step", "tok/s", "vs in process", "of floor"], rows))
    print("floor: max(host, device) per step; outputs equal in every mode")


if __name__ == "__main__":
    main()
