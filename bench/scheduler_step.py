"""Benchmark (b): ``schedule()`` + ``update()`` time per step.

Scenarios: 256 and 1024 running decode requests with ~1k-token contexts, and
8 chunked prefills (225-token chunks each, 2048-token budget) mixed into 248
decodes.  Requests are prefilled outside the timed region; the timed steps
are pure control plane (no model: sampled tokens are synthetic).

Baselines, measured in the same run: the same request counts with 128-token
contexts (per-step cost must not grow with context length) and the 256-request
run scaled to 1024 (growth must be linear in requests).

    python -m kvserve.bench.scheduler_step [--steps N]
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve.bench.arg_types import int_at_least
from kvserve.experiments.report import format_table
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

BLOCK_SIZE = 16


def build_scheduler(
    num_decodes: int,
    context_len: int,
    num_prefills: int = 0,
    prefill_len: int = 8192,
    budget: int = 8192,
    prefill_chunk: int | None = None,
) -> Scheduler:
    rng = random.Random(0)
    max_model_len = max(context_len, prefill_len) + 4096
    # The pool is sized as for 1k contexts whatever the context, as a GPU's
    # memory would be: only the context length varies between scenarios.
    num_blocks = (num_decodes * 2048 + num_prefills * (prefill_len + 1024)) // BLOCK_SIZE + 64
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=1 << 20, max_num_seqs=num_decodes + num_prefills,
                        max_model_len=max_model_len),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
    )
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(num_decodes):
        # Lengths vary so that requests cross block boundaries on different steps.
        length = context_len - rng.randrange(BLOCK_SIZE)
        scheduler.add_request(Request(f"d{i}", [rng.randrange(32_000) for _ in range(length)], params))
    plan = scheduler.schedule()  # prefill everything in one untimed step
    scheduler.update(plan, [1] * plan.num_sampled)
    for i in range(num_prefills):
        prompt = [rng.randrange(32_000) for _ in range(prefill_len)]
        scheduler.add_request(Request(f"p{i}", prompt, params))
    scheduler.scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=num_decodes + num_prefills,
        max_model_len=max_model_len,
        long_prefill_token_threshold=prefill_chunk,
    )
    return scheduler


def time_steps(scheduler: Scheduler, num_steps: int) -> tuple[float, float]:
    """Mean µs per schedule()+update(), and mean tokens per step."""
    token = 17
    num_tokens = 0
    start = time.perf_counter()
    for _ in range(num_steps):
        plan = scheduler.schedule()
        scheduler.update(plan, [token] * plan.num_sampled)
        num_tokens += plan.total_num_scheduled_tokens
    elapsed = time.perf_counter() - start
    return elapsed / num_steps * 1e6, num_tokens / num_steps


def measure(num_steps: int, repeats: int, **kwargs: int) -> tuple[float, float]:
    results = [time_steps(build_scheduler(**kwargs), num_steps) for _ in range(repeats)]
    return min(r[0] for r in results), results[0][1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int_at_least(1), default=200, help="timed steps per run (default 200)")
    parser.add_argument("--repeats", type=int_at_least(1), default=3, help="runs per scenario, best kept (default 3)")
    args = parser.parse_args(argv)
    scenarios = [
        ("256 decodes, 1k context", dict(num_decodes=256, context_len=1024), 1000.0),
        ("256 decodes, 128 context (baseline)", dict(num_decodes=256, context_len=128), None),
        ("1024 decodes, 1k context", dict(num_decodes=1024, context_len=1024), 4000.0),
        ("1024 decodes, 128 context (baseline)", dict(num_decodes=1024, context_len=128), None),
        (
            "248 decodes + 8 chunked prefills",
            # Each prefill gets a 225-token chunk per step and lasts past the timed steps.
            dict(num_decodes=248, context_len=1024, num_prefills=8, budget=2048, prefill_chunk=225,
                 prefill_len=225 * (args.steps + 10)),
            1000.0,
        ),
    ]
    results = {}
    rows = []
    for name, kwargs, target in scenarios:
        us, tokens = measure(args.steps, args.repeats, **kwargs)
        results[name] = us
        verdict = "" if target is None else ("yes" if us <= target else "NO")
        rows.append([name, f"{tokens:.0f}", f"{us:.0f}", f"{us / tokens:.2f}", "" if target is None else f"{target:.0f}", verdict])
    print(f"schedule() + update() per step, block size {BLOCK_SIZE}, {args.steps} steps (best of {args.repeats})")
    print(format_table(["scenario", "tokens/step", "us/step", "us/token", "target us", "met"], rows))
    r256, r1024 = results["256 decodes, 1k context"], results["1024 decodes, 1k context"]
    print()
    print(format_table(
        ["ratio", "value", "meaning"],
        [
            ["1024 / (4 x 256)", f"{r1024 / (4 * r256):.2f}", "1.0 = linear in requests"],
            ["256: 1k / 128 context", f"{r256 / results['256 decodes, 128 context (baseline)']:.2f}",
             "1.0 = independent of context length"],
            ["1024: 1k / 128 context", f"{r1024 / results['1024 decodes, 128 context (baseline)']:.2f}",
             "1.0 = independent of context length"],
        ],
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
