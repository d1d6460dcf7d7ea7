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

It prints output tokens/s, each against in process, and the floor: the larger of the
steps' host times summed and their device times summed (each runs one step after another).
Outputs must be equal token for token in every mode.

``--workload mixed`` is ``bench.gpu_serving``'s mixed workload instead (``bench.serving_workloads``
made with this stand-in's vocabulary: its first ``--requests`` of 256 prompts of 128-1,024
tokens, chunked in steps of 2,048; a model's vocabulary draws other lengths alike): its steps with prompt tokens run eagerly on a GPU,
with a host time of their own (a case's third number) and a device time that grows with
their tokens (its fourth, us per token).  Session 45 measured the 1B shape's mixed workload
over the step protocol at 0.78-0.80x in process on an H200, where the decode-only emulation
gave 1.02x; this asks whether the eager prefill steps explain it.

    python -m kvserve.bench.step_pipeline [--requests 64] [--output-tokens 256]
        [--workload decode|mixed] [--cases 1.6:1.3,0.5:2.0,2.0:1.0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass

from kvserve.bench import serving_workloads
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
MAX_MODEL_LEN = 4096


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompt lengths, tokens to generate per request, and the step's token budget."""

    prompt_lens: tuple[int, ...]
    output_tokens: int
    step_tokens: int

    @classmethod
    def decode(cls, num_requests: int, output_tokens: int) -> Workload:
        """Prompts of ``PROMPT_TOKENS``, all prefilled in the first step."""
        return cls((PROMPT_TOKENS,) * num_requests, output_tokens, max(8192, num_requests * PROMPT_TOKENS))

    @classmethod
    def mixed(cls, num_requests: int, output_tokens: int) -> Workload:
        """The prompt lengths of the first ``num_requests`` of ``bench.serving_workloads``' mixed
        workload made with ``VOCAB_SIZE`` (256 prompts of 128-1,024 tokens), in steps of the engine's
        default budget."""
        prompts = serving_workloads.make_workloads(VOCAB_SIZE)[0].prompts
        if not 1 <= num_requests <= len(prompts):
            raise ValueError(f"the mixed workload has {len(prompts)} requests, got {num_requests}")
        return cls(tuple(len(p) for p in prompts[:num_requests]), output_tokens,
                   SchedulerConfig().max_num_batched_tokens)

    @property
    def num_blocks(self) -> int:
        """Room for every request at once, twice over (the prefix cache's blocks stay)."""
        return 1 + 2 * sum(-(-(n + self.output_tokens) // BLOCK_SIZE) for n in self.prompt_lens)


def _requests(workload: Workload, run: int) -> list[Request]:
    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True, temperature=0.0)
    # Distinct prompts per run: no run hits the prefix cache filled by another.
    return [Request(f"run{run}-req{i}", [(7 * i + j + 1000 * run) % VOCAB_SIZE for j in range(n)], params)
            for i, n in enumerate(workload.prompt_lens)]


def _scheduler(workload: Workload, num_blocks: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=workload.step_tokens, max_num_seqs=len(workload.prompt_lens),
                        max_model_len=MAX_MODEL_LEN),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
    )


def _outputs(requests: list[Request]) -> list[list[int]]:
    return [list(r.output_token_ids) for r in requests]


@dataclass(frozen=True, slots=True)
class InProcessRun:
    """The in-process run: its seconds, outputs, steps, and floor (its host or its device milliseconds
    summed, the larger)."""

    seconds: float
    outputs: list[list[int]]
    steps: int
    floor_s: float


def run_in_process(gpu: EmulatedGpu, workload: Workload, run: int) -> InProcessRun:
    """The workload with ``EngineCore`` and the worker in this process."""
    worker = EmulatedGpuWorker(gpu)
    engine = EngineCore(_scheduler(workload, gpu.num_blocks), worker, async_scheduling=True, steps_ahead=1)
    requests = _requests(workload, run)
    for request in requests:
        engine.add_request(request)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    floor_s = max(worker.launched_host_ms, worker.launched_device_ms) / 1e3
    return InProcessRun(seconds, _outputs(requests), worker.num_launched, floor_s)


async def _run_over_grpc(address: str, secret: str, workload: Workload, steps_ahead: int,
                         run: int) -> tuple[float, list]:
    executor = GrpcReplicaExecutor(0, [address], secret=secret)
    try:
        num_blocks = await executor.initialize_cache()
        engine = EngineCore(_scheduler(workload, num_blocks), executor, async_scheduling=True,
                            steps_ahead=steps_ahead)
        requests = _requests(workload, run)
        for request in requests:
            engine.add_request(request)
        start = time.perf_counter()
        while engine.has_unfinished_requests():  # the scheduler actor's step loop, without Ray
            await engine.run_step_async(engine.begin_step())
        return time.perf_counter() - start, _outputs(requests)
    finally:
        await executor.shutdown()


def measure(gpu: EmulatedGpu, workload: Workload, repeat: int,
            steps_ahead_modes: tuple[int, ...]) -> tuple[dict[str, float], InProcessRun]:
    """Median seconds per mode ("in process", "gRPC, k ahead"), and the last in-process run;
    ``RuntimeError`` if outputs differ."""
    seconds: dict[str, list[float]] = {}
    with worker_server(gpu, runner=EmulatedGpuWorker) as (address, secret):
        for run in range(repeat + 1):  # run 0 warms both paths up
            in_process = run_in_process(gpu, workload, run)
            timed = {"in process": in_process.seconds}
            for k in steps_ahead_modes:
                took, outputs = asyncio.run(_run_over_grpc(address, secret, workload, k, run))
                # The same requests: their tokens depend on (request id, position) alone.
                if outputs != in_process.outputs:
                    raise RuntimeError(f"gRPC, {k} ahead: outputs differ from in process's")
                timed[f"gRPC, {k} ahead"] = took
            if run:
                for name, took in timed.items():
                    seconds.setdefault(name, []).append(took)
    return {name: statistics.median(values) for name, values in seconds.items()}, in_process


def _parse_cases(text: str) -> list[EmulatedGpu]:
    """``HOST_MS:DEVICE_MS[:PREFILL_HOST_MS:DEVICE_US_PER_TOKEN]`` cases, comma-separated (pools of 0 blocks)."""
    cases = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            numbers = [float(part) for part in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a case is HOST_MS:DEVICE_MS[:PREFILL_HOST_MS:DEVICE_US_PER_TOKEN], got {item!r}") from None
        if len(numbers) not in (2, 4) or min(numbers) < 0:
            raise argparse.ArgumentTypeError(
                f"a case is HOST_MS:DEVICE_MS[:PREFILL_HOST_MS:DEVICE_US_PER_TOKEN], all >= 0, got {item!r}")
        prefill_host_ms, us_per_token = numbers[2:] or (None, 0.0)
        cases.append(EmulatedGpu(numbers[0], numbers[1], 0, prefill_host_ms, us_per_token))
    return cases


def _case_name(gpu: EmulatedGpu) -> str:
    name = f"{gpu.host_ms:g}:{gpu.device_ms:g}"
    return name if gpu.prefill_host_ms is None else f"{name}:{gpu.prefill_host_ms:g}:{gpu.device_us_per_token:g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.step_pipeline",
        description=__doc__.split("\n\n")[0],
        epilog="Each case is HOST_MS:DEVICE_MS: the stand-in worker's host time to launch a step and its "
               "device time to run it. 1.6:1.3 is near the 1B shape's decode step on an H200: session 43 "
               "measured a 1.6 ms host launch, and a 1.1 ms step at batch 64 (1.93x its 0.58 ms floor). "
               "Two more numbers, PREFILL_HOST_MS:DEVICE_US_PER_TOKEN, give a step with prompt tokens its "
               "own host time (an eager launch) and every step a device time per token on top of DEVICE_MS; "
               "1.3:1.0:10:3 is near the 1B shape's mixed workload on an H200 (session 46: eager steps "
               "10-11 ms of host, about 3 us of device per token at 700 TFLOP/s).",
    )
    parser.add_argument("--requests", type=int_at_least(1), default=64, help="decoding requests (default 64)")
    parser.add_argument("--output-tokens", type=int_at_least(2), default=256,
                        help="tokens each request generates (default 256)")
    parser.add_argument("--workload", choices=("decode", "mixed"), default="decode",
                        help="decode: prompts of 128 tokens prefilled at once, then decode steps; mixed: "
                             "bench.gpu_serving's mixed workload (its first --requests of 256 prompts of "
                             "128-1,024 tokens) in steps of 2,048 (default decode)")
    parser.add_argument("--cases", type=_parse_cases, default=_parse_cases("1.6:1.3,0.5:2.0,2.0:1.0"),
                        help="comma-separated HOST_MS:DEVICE_MS[:PREFILL_HOST_MS:DEVICE_US_PER_TOKEN] cases "
                             "(default 1.6:1.3,0.5:2.0,2.0:1.0)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3, help="timed runs per mode, median (default 3)")
    args = parser.parse_args(argv)
    modes = tuple(sorted({1, STEPS_AHEAD}))
    make = Workload.mixed if args.workload == "mixed" else Workload.decode
    try:
        workload = make(args.requests, args.output_tokens)
    except ValueError as exc:
        parser.error(f"--requests: {exc}")
    longest = max(workload.prompt_lens)
    if longest + args.output_tokens > MAX_MODEL_LEN:  # else requests stop short and tok/s counts tokens never made
        parser.error(f"--output-tokens: at most {MAX_MODEL_LEN - longest} (the stand-in's context of "
                     f"{MAX_MODEL_LEN} tokens less the longest prompt's {longest}), got {args.output_tokens}")
    tokens = args.requests * args.output_tokens
    rows = []
    for case in args.cases:
        gpu = dataclasses.replace(case, num_blocks=workload.num_blocks)
        print(f"case {_case_name(gpu)} ...", flush=True)
        seconds, in_process = measure(gpu, workload, args.repeat, modes)
        base = seconds["in process"]
        for name, took in seconds.items():
            rows.append([_case_name(gpu), name, f"{took * 1e3 / in_process.steps:.2f}", f"{tokens / took:.0f}",
                         f"{base / took:.2f}", f"{in_process.floor_s / took:.2f}"])
    print(f"{args.workload} workload: {args.requests} requests x {args.output_tokens} tokens, {args.repeat} timed "
          f"runs each (median); {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(format_table(["case", "mode", "ms / step", "tok/s", "vs in process", "of floor"], rows))
    print("case: HOST_MS:DEVICE_MS[:PREFILL_HOST_MS:DEVICE_US_PER_TOKEN]; floor: the in-process run's steps' "
          "host or device times summed, the larger; outputs equal in every mode")


if __name__ == "__main__":
    main()
