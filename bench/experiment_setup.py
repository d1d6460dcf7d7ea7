"""Setting up ``kvserve experiment``: the request stream, the fleet, the policies' arguments.

Every helper turns a bad setting into an ``ExperimentError`` with a message
that names the option, which the command prints without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench.workloads import WorkloadRequest, make_workload
from kvserve.bench.workloads.cache_reference import CacheReference
from kvserve.bench.workloads.registry import TRACE_WORKLOAD, WORKLOADS
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.routing.policies import POLICIES
from kvserve.scheduler.simulation.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig

DEFAULT_KV_FRACTION = 0.25
REQUESTS_PER_REPLICA = 250
DEFAULT_NUM_REQUESTS_RANGE = (2_000, 100_000)


def default_num_requests(num_replicas: int) -> int:
    """Requests per run when ``--num-requests`` is not given: 250 per replica, 2,000 to 100,000.

    Every replica needs a long stream of its own to reach its steady state.
    With 2,000 requests on 64 replicas (31 each), a 64-group shared-prefix
    stream's 64 cold prefills were 3% of it: TTFT p99 was the cold-start time
    under every cache-aware policy, and a replica's request count was mostly
    the sampling noise of its group's popularity (load max/mean 1.3-1.5 for
    any policy that keeps a group on one replica; 1.11-1.16 with 16,000 requests).
    """
    low, high = DEFAULT_NUM_REQUESTS_RANGE
    return min(max(low, REQUESTS_PER_REPLICA * num_replicas), high)


class ExperimentError(ValueError):
    """A bad experiment setup, reported to the user without a traceback."""


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """How to (re)generate the request stream at any rate, in any process."""

    workload: str
    num_requests: int
    seed: int
    burstiness: float
    params: dict[str, Any] = field(default_factory=dict)

    def at(self, qps: float | None) -> list[WorkloadRequest]:
        return make_workload(
            self.workload, self.num_requests, qps, seed=self.seed, burstiness=self.burstiness, **self.params
        )

    def with_vocab_size(self, vocab_size: int) -> StreamSpec:
        """This stream with token ids below ``vocab_size`` (the served model's vocabulary)."""
        given = self.params.get("vocab_size")
        if given is None:
            return dataclasses.replace(self, params={**self.params, "vocab_size": vocab_size})
        if not isinstance(given, int) or given > vocab_size:
            raise ExperimentError(f"--workload-arg vocab_size={given} exceeds the model's vocabulary of {vocab_size}")
        return self


@dataclass(frozen=True, slots=True)
class LiveModel:
    """The model directory a live experiment's front end serves, and its vocabulary size."""

    model_dir: str
    vocab_size: int


def live_model(args: argparse.Namespace) -> LiveModel:
    """Check the live-only options and find the model (``--model``, else the embedded tiny one)."""
    if args.jobs != 1:
        raise ExperimentError("--jobs is for simulations: live runs go one at a time")
    if args.time_scale is not None and not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        raise ExperimentError(f"--time-scale must be a positive number, got {args.time_scale}")
    from kvserve.worker.model_config import ModelConfig

    model_dir = args.model
    if model_dir is None:
        from kvserve.worker.tiny_model import ensure_default_tiny_model

        model_dir = ensure_default_tiny_model()
    try:
        model = ModelConfig.from_pretrained(model_dir)
    except (ValueError, OSError) as exc:
        raise ExperimentError(f"--model: {exc}") from None
    return LiveModel(str(model_dir), model.vocab_size)


def check_live_options(args: argparse.Namespace) -> None:
    """``ExperimentError`` for a live-only option given to a simulated experiment."""
    if args.live:
        return
    given = [name for name, value in (("--address", args.address), ("--model", args.model),
                                      ("--time-scale", args.time_scale)) if value is not None]
    if given:
        raise ExperimentError(f"{', '.join(given)} only apply to --live")


def parse_value(text: str) -> Any:
    """An int, a float, a bool, ``None``, or else the text itself."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    return text


def parse_key_values(items: Sequence[str], what: str) -> list[tuple[str, Any]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ExperimentError(f"{what} must be KEY=VALUE, got {item!r}")
        pairs.append((key.strip(), parse_value(value.strip())))
    return pairs


def parse_policy_args(items: Sequence[str], policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    parsed: dict[str, dict[str, Any]] = {}
    for key, value in parse_key_values(items, "--policy-arg"):
        policy, dot, name = key.partition(".")
        if not dot or policy not in POLICIES:
            raise ExperimentError(f"--policy-arg must be POLICY.KEY=VALUE with a known policy, got {key!r}")
        parsed.setdefault(policy, {})[name] = value
    return parsed


def stream_spec(args: argparse.Namespace) -> StreamSpec:
    params = dict(parse_key_values(args.workload_arg, "--workload-arg"))
    if args.workload == TRACE_WORKLOAD:
        if args.trace is None:
            raise ExperimentError("the mooncake workload needs --trace PATH")
        params["trace"] = str(args.trace)
    elif args.workload not in WORKLOADS:
        raise ExperimentError(f"unknown workload {args.workload!r}; choose from {sorted([*WORKLOADS, TRACE_WORKLOAD])}")
    spec = StreamSpec(args.workload, args.num_requests, args.seed, args.burstiness, params)
    try:
        spec.at(None if args.workload == TRACE_WORKLOAD else 1.0)[:1]
    except (ValueError, OSError) as exc:
        raise ExperimentError(str(exc)) from None
    return spec


def parse_rates(text: str, stream: StreamSpec) -> list[Any]:
    text = text.strip()
    if text == "knee":
        return ["knee"]
    if text == "trace":
        if stream.workload != TRACE_WORKLOAD:
            raise ExperimentError("--qps trace replays a trace's own timing: only for the mooncake workload")
        return [None]
    try:
        rates = [float(q) for q in text.split(",") if q.strip()]
    except ValueError:
        raise ExperimentError(f"--qps must be comma-separated numbers, 'knee' or 'trace', got {text!r}") from None
    if not rates or any(not (q > 0 and math.isfinite(q)) for q in rates):
        raise ExperimentError(f"--qps rates must be positive, got {text!r}")
    return rates


def qps_label(qps: float | None, stream: Sequence[WorkloadRequest]) -> float:
    """The rate a run is reported at: a trace's own mean rate when replayed as recorded."""
    if qps is not None:
        return qps
    span = stream[-1].arrival_time - stream[0].arrival_time
    return round((len(stream) - 1) / span, 3) if span > 0 else float(len(stream))


def fleet_config(
    args: argparse.Namespace,
    requests: Sequence[WorkloadRequest],
    reference: CacheReference,
    cost_model: StepCostModel,
) -> FleetConfig:
    block_size = args.block_size
    longest = max(r.num_prompt_tokens + r.output_len for r in requests)
    blocks_for_longest = -(-longest // block_size)
    if args.kv_blocks_per_replica is not None:
        num_usable = args.kv_blocks_per_replica
    else:
        fraction = DEFAULT_KV_FRACTION if args.kv_fraction is None else args.kv_fraction
        if not fraction > 0:
            raise ExperimentError(f"--kv-fraction must be > 0, got {fraction}")
        num_usable = math.ceil(fraction * reference.num_reused_blocks)
    if num_usable < blocks_for_longest:
        raise ExperimentError(
            f"{num_usable} KV blocks per replica cannot hold the longest request "
            f"({longest} tokens = {blocks_for_longest} blocks); raise --kv-fraction or --kv-blocks-per-replica"
        )
    try:
        return FleetConfig(
            num_replicas=args.replicas,
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=longest,
            ),
            cache_config=CacheConfig(block_size=block_size, num_blocks=num_usable + 1),
            cost_model=cost_model,
        )
    except ValueError as exc:
        raise ExperimentError(str(exc)) from None


def default_policy_kwargs(policy: str, seed: int, fleet: FleetConfig) -> dict[str, Any]:
    if policy in ("least_loaded", "consistent_hash"):
        return {"seed": seed}
    if policy == "cost_ttft":
        return {
            "cost_model": fleet.cost_model,
            "max_num_batched_tokens": fleet.scheduler_config.max_num_batched_tokens,
        }
    return {}


def describe(args: argparse.Namespace, stream: StreamSpec, reference: CacheReference, fleet: FleetConfig) -> None:
    cost = fleet.cost_model
    lines = [
        f"workload {stream.workload} {stream.params or ''}: {stream.num_requests} requests, seed {stream.seed}",
        f"prefix working set at 1 qps: {reference.num_reused_blocks} blocks reused "
        f"({reference.num_distinct_blocks} distinct; infinite-cache hit rate {reference.hit_rate:.3f})",
        f"fleet: {fleet.num_replicas} replicas x {fleet.cache_config.num_usable_blocks} KV blocks "
        f"({fleet.cache_config.num_usable_blocks / max(reference.num_reused_blocks, 1):.2f} of the working set), "
        f"budget {fleet.scheduler_config.max_num_batched_tokens} tokens, max {fleet.scheduler_config.max_num_seqs} seqs",
        f"step cost: a={cost.a:.3g} s, b={cost.b:.3g} s/prefill token, c={cost.c:.3g} s/decode, "
        f"d={cost.d:.3g} s/context token",
    ]
    for line in lines:
        print(line)
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
              if key != "handler"}
    config["kv_blocks_per_replica_used"] = fleet.cache_config.num_usable_blocks
    config["infinite_cache_hit_rate"] = reference.hit_rate
    config["prefix_working_set_blocks"] = reference.num_reused_blocks
    (args.out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
