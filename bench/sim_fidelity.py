"""How well the fleet simulator predicts a real replica: one request stream, served twice.

Once by a real engine (``kvserve.LLM``'s scheduler and workers; a GPU with
``--shape llama-3-8b``), with each request added when its arrival time has come
on the wall clock; once by the simulator (one replica, the same scheduler and
cache settings) on a virtual clock priced by ``--cost-model``, and once more by
the simulator with ``StepCostModel.default()`` for comparison.  The table gives
each run's figures and the simulated ones as ratios to the real run's.

    python -m kvserve.bench.sim_fidelity --cost-model cost.json --shape llama-3-8b --device cuda \\
        [--requests 300] [--qps 4] [--workload shared_prefix] [--workload-arg num_groups=8]

Without ``--model`` or ``--shape`` a fresh tiny random Llama runs (on a CPU:
useful to test the pipeline, its figures say nothing about a GPU).  Token ids
come from the model's vocabulary unless ``--workload-arg vocab_size=N`` (no
larger) is given.  The default stream (556 requests of 2,176-token prompts)
takes a CPU minutes; a short one tests the pipeline in seconds:

    python -m kvserve.bench.sim_fidelity --cost-model llama-3-8b-h100 --device cpu --requests 20 \\
        --workload-arg num_groups=2 --workload-arg system_prompt_len=64 --workload-arg output_len=16

``--requests`` counts the measured requests, as ``kvserve experiment
--num-requests`` does: the workload adds its warm-up (a shared_prefix stream
the first requests of each group), which both runs serve and the figures
leave out.

On a CPU a step's time depends on torch's thread count: ``--threads N`` runs the
real replica with N (default: as many as torch takes in this process), and a
cost model whose ``"calibration"`` says it was timed on a CPU with another count
(``kvserve.bench.calibrate_cost_model --threads``) is warned of on stderr.

Session workloads (multi_turn, agent_tools) put scripted answers into later
prompts; the simulator caches those answers, the real replica its own, so
their later turns hit less on the real replica: compare hit rates on
workloads without answers in their prompts (shared_prefix, document_qa).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvserve import LLM
from kvserve.bench.arg_types import float_above, int_at_least
from kvserve.experiments.experiment_report import RunResult, RunSummary, replayed_counts, summarize
from kvserve.experiments.experiment_setup import StreamSpec, parse_key_values
from kvserve.bench.model_source import add_model_arguments, model_dir_for, model_vocab_size
from kvserve.experiments.report import format_table
from kvserve.experiments.workloads import WORKLOADS, WorkloadRequest
from kvserve.experiments.workloads.registry import TRACE_WORKLOAD
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.cost_model import StepCostModel, cost_model_calibration, measured_cost_models
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator, RequestRecord, SimulationResult
from kvserve.worker.model_config import ModelConfig

REAL = "real replica"
BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayResult:
    """A real replica's run in the simulator's shape (``RunResult``): times from the run's start."""

    policy: str
    records: list[RequestRecord]
    replica_busy_time: list[float]
    end_time: float
    wall_time: float

    @property
    def replica_num_requests(self) -> list[int]:
        return [len(self.records)]


def replay(
    engine: EngineCore,
    stream: Sequence[WorkloadRequest],
    *,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    progress: Callable[[int, int], None] = lambda finished, total: None,
) -> ReplayResult:
    """Serve ``stream`` on ``engine``, adding each request once the clock reaches its arrival time.

    Requests join between steps, as in the simulator, where a step in flight
    is not interrupted either.  A request's first token and finish are timed
    when the step that produced them returns.
    """
    start = clock()
    pending = deque(enumerate(stream))
    requests: dict[str, tuple[int, Request]] = {}
    first_token: dict[int, float] = {}
    records: list[RequestRecord | None] = [None] * len(stream)
    busy = 0.0
    num_finished = 0
    try:
        while pending or engine.has_unfinished_requests():
            now = clock() - start
            while pending and pending[0][1].arrival_time <= now:
                index, item = pending.popleft()
                request = Request(
                    str(index), list(item.prompt_token_ids),
                    SamplingParams(max_tokens=item.output_len, ignore_eos=True),
                    cache_salt=item.cache_salt, arrival_time=item.arrival_time,
                )
                engine.add_request(request)
                requests[request.req_id] = (index, request)
            if not engine.has_unfinished_requests():
                sleep(max(0.0, pending[0][1].arrival_time - now))
                continue
            step_start = clock()
            outputs = engine.step()
            done = clock()
            busy += done - step_start
            for output in outputs:
                index, request = requests[output.req_id]
                first_token.setdefault(index, done - start)
                if output.finished:
                    del requests[output.req_id]
                    records[index] = RequestRecord(
                        index=index, arrival_time=request.arrival_time, first_token_time=first_token[index],
                        finish_time=done - start, replica_id=0, num_prompt_tokens=request.num_prompt_tokens,
                        num_cached_tokens=request.num_cached_tokens or 0, num_output_tokens=request.num_output_tokens,
                        num_preemptions=request.num_preemptions,
                    )
                    num_finished += 1
                    progress(num_finished, len(stream))
    except BaseException:
        engine.abort_requests(list(requests))  # nothing left running in the engine
        raise
    end = clock() - start
    missing = [i for i, record in enumerate(records) if record is None]
    if missing:
        raise RuntimeError(f"{len(missing)} requests never finished, the first {missing[0]}")
    return ReplayResult(REAL, records, [busy], end, end)  # type: ignore[arg-type]


def simulate(
    stream: Sequence[WorkloadRequest], scheduler_config: SchedulerConfig, cache_config: CacheConfig,
    cost_model: StepCostModel, label: str,
) -> SimulationResult:
    fleet = FleetConfig(num_replicas=1, scheduler_config=scheduler_config, cache_config=cache_config,
                        cost_model=cost_model)
    result = FleetSimulator(fleet, make_policy("round_robin")).run(stream)
    return dataclasses.replace(result, policy=label)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost-model", required=True, metavar="FILE_OR_NAME",
                        help="the calibrated step cost model: a JSON file, or the name of a measured one "
                             f"({', '.join(measured_cost_models())})")
    add_model_arguments(parser)
    workloads = sorted([*WORKLOADS, TRACE_WORKLOAD])
    parser.add_argument("--workload", default="shared_prefix", choices=workloads, metavar="WORKLOAD",
                        help=f"one of {', '.join(workloads)} (default shared_prefix)")
    parser.add_argument("--workload-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a parameter of the workload, e.g. num_groups=8 (repeatable)")
    parser.add_argument("--requests", type=int_at_least(1), default=300,
                        help="measured requests (default 300); the workload's warm-up requests are added, served "
                             "and left out of the figures (the mooncake trace: its records, warm-up included)")
    parser.add_argument("--qps", type=float_above(0), default=4.0, help="mean arrival rate (default 4)")
    parser.add_argument("--num-blocks", type=int_at_least(2), default=4096,
                        help=f"KV blocks of {BLOCK_SIZE} tokens in the replica (default 4096)")
    parser.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=2048,
                        help="token budget of a step (default 2048)")
    parser.add_argument("--max-num-seqs", type=int_at_least(1), default=256,
                        help="requests in a step at most (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the model's weights (default 0)")
    parser.add_argument("--threads", type=int_at_least(1), metavar="N",
                        help="torch threads of the real replica on a CPU (no effect on a GPU; default: torch's "
                             f"own count, {torch.get_num_threads()} here)")
    args = parser.parse_args(argv)
    try:
        cost_model = StepCostModel.load(args.cost_model)
        calibration = cost_model_calibration(args.cost_model)
    except (OSError, ValueError) as exc:
        parser.error(f"--cost-model {args.cost_model}: {getattr(exc, 'strerror', None) or exc}")
    try:
        vocab_size = model_vocab_size(args)
    except (OSError, ValueError) as exc:
        parser.error(f"--model: {exc}")
    try:
        workload_args = dict(parse_key_values(args.workload_arg, "--workload-arg"))
        burstiness = workload_args.pop("burstiness", 1.0)
        # As kvserve experiment --live does: token ids from the model's vocabulary unless given.
        spec = StreamSpec(args.workload, args.requests, args.seed, burstiness, workload_args)
        stream = spec.with_vocab_size(vocab_size).at(args.qps)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    longest = max(len(r.prompt_token_ids) + r.output_len for r in stream)
    # Checked before a model is written or a request served (a replica cannot hold it).
    blocks_needed = -(-longest // BLOCK_SIZE)
    if blocks_needed > args.num_blocks - 1:  # one is the null block
        parser.error(f"the workload's longest request ({longest} tokens) needs {blocks_needed} KV blocks; "
                     f"give --num-blocks {blocks_needed + 1} or more")
    if args.model is not None:
        limit = ModelConfig.from_pretrained(args.model).max_model_len  # read above: it does not fail here
        if longest > limit:
            parser.error(f"the workload's longest request ({longest} tokens) exceeds the {limit} tokens "
                         f"{args.model} serves: shorten the workload with --workload-arg")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for(args, Path(tmp), max_position_embeddings=longest)
        try:
            llm = LLM(model_dir, device=args.device, num_blocks=args.num_blocks, block_size=BLOCK_SIZE,
                      seed=args.seed, max_model_len=longest, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, cpu_threads=args.threads)
        except ValueError as exc:
            parser.error(str(exc))
        try:
            # NOTE: on a CPU the engine runs in this process, with torch's thread count (--threads set it).
            if llm.engine.executor.worker.device.type == "cpu":
                warning = thread_count_warning(calibration, torch.get_num_threads())
                if warning is not None:
                    print(f"warning: {warning}", file=sys.stderr, flush=True)
            # Warm-up: first launches (kernel builds, library handles) stay out of the run.
            llm.generate([list(stream[0].prompt_token_ids)], SamplingParams(max_tokens=4, ignore_eos=True))
            if not llm.engine.scheduler.kv_cache_manager.reset_prefix_cache():
                raise RuntimeError("the warm-up left blocks in use")
            scheduler_config = llm.engine.scheduler.scheduler_config
            cache_config = llm.engine.scheduler.cache_config
            print(f"{args.workload} at {args.qps:g} qps on one replica ({cache_config.num_blocks} KV blocks of "
                  f"{cache_config.block_size} tokens): {replayed_counts({args.qps: [r.measured for r in stream]})}",
                  flush=True)

            def report(finished: int, total: int) -> None:
                if finished % max(1, total // 10) == 0 or finished == total:
                    print(f"  {REAL}: {finished}/{total} requests finished", flush=True)

            real = replay(llm.engine, stream, progress=report)
        finally:
            llm.shutdown()
    results = [
        real,
        simulate(stream, scheduler_config, cache_config, cost_model, "sim, calibrated"),
        simulate(stream, scheduler_config, cache_config, StepCostModel.default(), "sim, default()"),
    ]
    summaries = summarize_measured(results, stream, workload=args.workload, qps=args.qps)
    print(format_table(["run", *FIGURES, "busy s", "preempt"], [
        [s.policy, *(f"{getattr(s, name):.3f}" for name in FIGURES.values()), f"{r.replica_busy_time[0]:.1f}",
         s.num_preemptions] for s, r in zip(summaries, results)
    ]))
    print()
    print(ratio_table(summaries))
    return 0


def thread_count_warning(calibration: Mapping[str, Any], num_threads: int) -> str | None:
    """Why a cost model calibrated as ``calibration`` says mispredicts a real replica on a CPU with
    ``num_threads`` torch threads: it was timed on a CPU with another count.  ``None`` when the
    counts agree, or the calibration names no count or another device."""
    calibrated = calibration.get("torch_threads")
    if calibration.get("device", "cpu") != "cpu" or not isinstance(calibrated, int) or calibrated == num_threads:
        return None
    return (f"the cost model was calibrated with {calibrated} torch threads, the real replica runs with "
            f"{num_threads}: the simulator prices its steps at another speed (--threads {calibrated} matches)")


def summarize_measured(
    results: Sequence[RunResult], stream: Sequence[WorkloadRequest], *, workload: str, qps: float
) -> list[RunSummary]:
    """Each run's figures over the stream's measured requests, as ``kvserve experiment`` gives them.

    The warm-up (its cold prefills above all) is served in every run and left out of every figure but busy time.
    """
    measured = [r.measured for r in stream]
    return [summarize(r, workload=workload, qps=qps, infinite_hit_rate=0.0, measured=measured) for r in results]


# Column title -> RunSummary field.
FIGURES = {"hit rate": "hit_rate", "TTFT p50 s": "ttft_p50", "TTFT p99 s": "ttft_p99",
           "e2e p50 s": "e2e_p50", "e2e p99 s": "e2e_p99"}


def ratio_table(summaries: Sequence[RunSummary]) -> str:
    """Each simulated run's figures over the real run's (the first): unitless, headed as such (1.00x: the same)."""
    headers = ["ratio (1.00x: as the real run)", *(f"{name.removesuffix(' s')}: sim / real" for name in FIGURES)]
    return format_table(headers, [_ratios(s, summaries[0]) for s in summaries[1:]])


def _ratios(summary: RunSummary, real: RunSummary) -> list[str]:
    """``summary``'s figures over the real run's."""
    ratios = []
    for name in FIGURES.values():
        reference = getattr(real, name)
        ratios.append(f"{getattr(summary, name) / reference:.2f}x" if reference else "-")
    return [f"{summary.policy} / real", *ratios]


if __name__ == "__main__":
    raise SystemExit(main())
