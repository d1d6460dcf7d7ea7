"""Benchmark: one tenant's flood of unique prompts against another tenant's prefix cache,
with the share of the cache per tenant (``tenant_cache_share``) off and on.

One replica's real ``Scheduler`` and block pool on a virtual clock; each step lasts what
the default step cost model says (``StepCostModel.default()``), its sampled tokens are
synthetic.  Tenant A sends requests over a few shared prefixes (a system prompt each,
then a short unique question); tenant B sends unique prompts at several rates.  Both are
salted by tenant as the front end salts them, so they never share a block; only the
order of eviction lets B's flood evict A's prefixes.

Printed: A's and B's prefix-cache hit rates (cached prompt tokens / prompt tokens) and
A's time to first token, for each of B's rates and shares; then the control plane's cost
(``schedule()`` + ``update()``, wall clock) with the share on over that with it off, in
the same run: the baseline is the share off.

    python -m kvserve.bench.tenant_cache [--duration S] [--rates R,R,...] [--shares F,F,...]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass

from kvserve.bench.arg_types import float_above, int_at_least, number_list
from kvserve.experiments.report import format_table
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

BLOCK_SIZE = 16
NUM_BLOCKS = 513  # 512 usable: 8k tokens of KV cache
A_RATE = 2.0  # A's requests per second
A_NUM_PREFIXES = 4
A_PREFIX_LEN = 512  # A's four prefixes: 128 blocks, a quarter of the pool
A_QUESTION_LEN = 32
B_PROMPT_LEN = 256
MAX_TOKENS = 16
VOCAB = 32_000


@dataclass(frozen=True, slots=True)
class Arrival:
    time: float
    tenant: str
    prompt: list[int]


@dataclass(frozen=True, slots=True)
class Outcome:
    hit_rate: dict[str, float]
    mean_ttft_s: float
    p90_ttft_s: float
    us_per_step: float
    num_steps: int


def make_arrivals(b_rate: float, duration_s: float, seed: int = 0) -> list[Arrival]:
    """A's requests at ``A_RATE`` and B's at ``b_rate`` per second (Poisson), for ``duration_s``."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(A_PREFIX_LEN)] for _ in range(A_NUM_PREFIXES)]
    arrivals = []
    for tenant, rate in (("A", A_RATE), ("B", b_rate)):
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= duration_s:
                break
            if tenant == "A":
                prompt = [*rng.choice(prefixes), *(rng.randrange(VOCAB) for _ in range(A_QUESTION_LEN))]
            else:
                prompt = [rng.randrange(VOCAB) for _ in range(B_PROMPT_LEN)]
            arrivals.append(Arrival(t, tenant, prompt))
    arrivals.sort(key=lambda arrival: arrival.time)
    return arrivals


def simulate(arrivals: list[Arrival], share: float | None, cost_model: StepCostModel) -> Outcome:
    """Serve ``arrivals`` on one replica; hit rates by tenant, A's TTFT, and the control plane's cost."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=2048),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, tenant_cache_share=share),
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests: dict[str, tuple[Request, float]] = {}
    first_token: dict[str, float] = {}
    now, next_arrival, num_steps, control_s = 0.0, 0, 0, 0.0
    while next_arrival < len(arrivals) or scheduler.has_unfinished_requests():
        while next_arrival < len(arrivals) and arrivals[next_arrival].time <= now:
            arrival = arrivals[next_arrival]
            request = Request(
                f"{arrival.tenant}{next_arrival}", arrival.prompt, params,
                cache_salt=f"tenant={arrival.tenant}\x00", tenant=arrival.tenant,
            )
            scheduler.add_request(request)
            requests[request.req_id] = (request, arrival.time)
            next_arrival += 1
        if not scheduler.has_unfinished_requests():
            now = arrivals[next_arrival].time
            continue
        start = time.perf_counter()
        plan = scheduler.schedule()
        outputs = scheduler.update(plan, [7] * plan.num_sampled)
        control_s += time.perf_counter() - start
        num_steps += 1
        now += cost_model.step_time(plan)
        for output in outputs:
            first_token.setdefault(output.req_id, now)
    queried: dict[str, int] = {"A": 0, "B": 0}
    hits: dict[str, int] = {"A": 0, "B": 0}
    ttfts = []
    for req_id, (request, arrived) in requests.items():
        tenant = req_id[0]
        queried[tenant] += request.num_prompt_tokens
        hits[tenant] += request.num_cached_tokens or 0
        if tenant == "A":
            ttfts.append(first_token[req_id] - arrived)
    ttfts.sort()
    return Outcome(
        hit_rate={tenant: hits[tenant] / queried[tenant] if queried[tenant] else 0.0 for tenant in queried},
        mean_ttft_s=statistics.fmean(ttfts),
        # The nearest rank (the floor of 0.9 * (n - 1) took the lowest of two samples, below the mean).
        p90_ttft_s=ttfts[math.ceil(0.9 * len(ttfts)) - 1],
        us_per_step=control_s / num_steps * 1e6,
        num_steps=num_steps,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float_above(0), default=60.0, metavar="S",
                        help="virtual seconds of arrivals (default 60)")
    parser.add_argument("--rates", type=number_list(0.0, math.inf, above=False, what=">= 0"),
                        default=[0.0, 4.0, 16.0, 32.0],
                        metavar="R,...", help="tenant B's requests per second (default 0,4,16,32)")
    parser.add_argument("--shares", type=number_list(0.0, 1.0, above=True, what="in (0, 1]"),
                        default=[0.25, 0.5, 0.8],
                        metavar="F,...", help="tenant_cache_share values, besides off (default 0.25,0.5,0.8)")
    parser.add_argument("--repeats", type=int_at_least(1), default=3,
                        help="runs of the heaviest rate for the cost ratio, best kept (default 3)")
    args = parser.parse_args(argv)
    cost_model = StepCostModel.default()
    shares: list[float | None] = [None, *args.shares]
    rows = []
    for rate in args.rates:
        arrivals = make_arrivals(rate, args.duration)
        for share in shares:
            outcome = simulate(arrivals, share, cost_model)
            rows.append([
                f"{rate:g}", "off" if share is None else f"{share:g}", f"{outcome.hit_rate['A']:.3f}",
                f"{outcome.mean_ttft_s * 1e3:.1f}", f"{outcome.p90_ttft_s * 1e3:.1f}",
                f"{outcome.hit_rate['B']:.3f}" if rate else "",
            ])
    best = A_PREFIX_LEN / (A_PREFIX_LEN + A_QUESTION_LEN)
    print(
        f"tenant A: {A_RATE:g} req/s over {A_NUM_PREFIXES} prefixes of {A_PREFIX_LEN} tokens (+{A_QUESTION_LEN} "
        f"unique; best hit rate {best:.3f}); tenant B: unique {B_PROMPT_LEN}-token prompts; "
        f"{NUM_BLOCKS - 1} blocks of {BLOCK_SIZE}; {args.duration:g} virtual s; step times from the default cost model"
    )
    print(format_table(["B req/s", "share", "A hit rate", "A mean TTFT ms", "A p90 TTFT ms", "B hit rate"], rows))

    heaviest = make_arrivals(max(args.rates), args.duration)
    costs = {}
    for share in (None, *args.shares):
        costs[share] = min(simulate(heaviest, share, cost_model).us_per_step for _ in range(args.repeats))
    print()
    print(format_table(
        ["share", "schedule()+update() us/step", "ratio to off (baseline)"],
        [["off" if s is None else f"{s:g}", f"{us:.0f}", f"{us / costs[None]:.3f}"] for s, us in costs.items()],
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
