"""The simulated fleet of ``kvserve experiment``: its caches sized on the stream, its memory, its longest request.

Every helper turns a bad setting into an ``ExperimentError`` with a message
that names the option, which the command prints without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

from kvserve.experiments.experiment_setup import (
    DEFAULT_KV_FRACTION,
    ExperimentError,
    StreamSpec,
    default_num_requests,
    workload_arg_error,
)
from kvserve.experiments.workloads import WorkloadRequest
from kvserve.experiments.workloads.cache_reference import CacheReference
from kvserve.experiments.workloads.registry import TRACE_WORKLOAD, workload_parameters
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig


def sizing_stream(args: argparse.Namespace, stream: StreamSpec) -> StreamSpec | None:
    """The stream whose prefix working set ``--kv-fraction`` sizes the caches on, at the reference rate
    (1 qps; a trace as recorded): ``stream`` with the default number of requests for ``--replicas`` (a
    trace: all its records).  ``None`` where no stream is needed (``--kv-blocks-per-replica``).

    NOTE: sized on ``stream`` itself, a session workload's caches shrank with ``--num-requests``: its
    working set is every session's history, which grows with the stream, while the histories under way
    at once do not.  With 300 requests of multi-turn chat at 8 replicas and 20 qps, each replica held
    1,604 blocks where the default 2,000 requests give 9,960; the fleet could not hold the 16,013
    blocks of the sessions under way, and every policy's hit rate was 0.20-0.29 of an infinite cache's.
    ``--num-requests`` now sets how long a run measures, not how much its replicas hold.

    A shared-prefix stream with ``prompts_per_group`` has num_groups x prompts_per_group requests:
    the sizing stream keeps its groups and takes as many prompts per group as come nearest the default.
    """
    if args.kv_blocks_per_replica is not None:
        return None
    if stream.workload == TRACE_WORKLOAD:
        return dataclasses.replace(stream, num_requests=None)
    num_requests = default_num_requests(args.replicas)
    params = stream.params
    per_group = params.get("prompts_per_group")
    num_groups = params.get("num_groups", workload_parameters(stream.workload).get("num_groups"))
    if per_group is not None and isinstance(num_groups, int) and num_groups > 0:
        per_group = max(1, round(num_requests / num_groups))
        num_requests = num_groups * per_group
        params = {**params, "prompts_per_group": per_group}
    return dataclasses.replace(stream, num_requests=num_requests, params=params)


def cache_sized_by(args: argparse.Namespace, reference: CacheReference) -> tuple[float, int] | None:
    """The (fraction, working-set blocks) replica caches are sized from; ``None`` for ``--kv-blocks-per-replica``."""
    if args.kv_blocks_per_replica is not None:
        return None
    if not reference.num_reused_blocks:
        raise ExperimentError(
            "the stream reuses no prefix (a working set of 0 blocks), so --kv-fraction sizes no cache: "
            "give --kv-blocks-per-replica"
        )
    fraction = DEFAULT_KV_FRACTION if args.kv_fraction is None else args.kv_fraction
    return fraction, reference.num_reused_blocks


def fleet_config(
    args: argparse.Namespace,
    requests: Sequence[WorkloadRequest],
    reference: CacheReference,
    cost_model: StepCostModel,
) -> FleetConfig:
    block_size = args.block_size
    longest = longest_request(requests)
    sized_by = cache_sized_by(args, reference)
    if sized_by is None:
        num_usable = args.kv_blocks_per_replica
    else:
        fraction, working_set = sized_by
        num_usable = math.ceil(fraction * working_set)
    _check_room(num_usable, block_size, longest, sized_by)
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


# What a simulated fleet holds per KV block before it serves a request (its
# block and free-list entry).  Measured on 200 replicas x 2,049 blocks: 117
# bytes.  A full cache adds the blocks' hashes and index entries: about 430
# bytes a block at the end of a run, so a fleet refused for this minimum could
# never have run here, while one that passes may still need up to 4x more.
FLEET_BYTES_PER_BLOCK = 120


def check_fleet_memory(fleet: FleetConfig, num_fleets: int, available_bytes: int | None) -> None:
    """``ExperimentError`` when ``num_fleets`` such fleets at once would need more than ``available_bytes``.

    A fleet far too big for the machine would otherwise be built block by
    block for minutes or hours before running out of memory.  ``None``: the
    available memory is unknown; nothing is checked.
    """
    num_blocks = fleet.num_replicas * fleet.cache_config.num_blocks
    needed = num_fleets * num_blocks * FLEET_BYTES_PER_BLOCK
    if available_bytes is not None and needed > available_bytes:
        jobs = f" ({num_fleets} parallel jobs at once)" if num_fleets > 1 else ""
        raise ExperimentError(
            f"{fleet.num_replicas:,} replicas x {fleet.cache_config.num_blocks:,} KV blocks need at least "
            f"{_size(needed)} to simulate{jobs} ({FLEET_BYTES_PER_BLOCK} bytes a block before any request), more than "
            f"the {_size(available_bytes)} available here: fewer replicas, or fewer KV blocks per replica "
            f"(--kv-fraction or --kv-blocks-per-replica)"
            f"{', or fewer --jobs' if num_fleets > 1 else ''}"
        )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:,.1f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:,.1f} MB"


def available_memory_bytes() -> int | None:
    """The kernel's estimate of the memory available to a new process (``MemAvailable``); ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def longest_request(requests: Sequence[WorkloadRequest]) -> int:
    """Tokens of the longest request of ``requests``, its output included."""
    return max(r.num_prompt_tokens + r.output_len for r in requests)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _check_room(
    num_usable_blocks: int, block_size: int, longest: int, sized_by: tuple[float, int] | None = None
) -> None:
    """``ExperimentError`` unless a replica's cache holds the longest request.

    ``sized_by``: the (fraction, working-set blocks) the cache was sized from,
    for a message that names the least fraction that fits.
    """
    blocks_for_longest = _blocks_for(longest, block_size)
    if num_usable_blocks >= blocks_for_longest:
        return
    if sized_by is None:
        raise ExperimentError(
            f"{num_usable_blocks} KV blocks per replica cannot hold the longest request "
            f"({longest} tokens = {blocks_for_longest} blocks); raise --kv-fraction or --kv-blocks-per-replica"
        )
    fraction, working_set = sized_by
    least = _round_up(blocks_for_longest / working_set)  # rounded up: it holds the longest
    raise ExperimentError(
        f"{num_usable_blocks} KV blocks per replica ({fraction:g} of the {working_set}-block working set) cannot "
        f"hold the longest request ({longest} tokens = {blocks_for_longest} blocks); give --kv-fraction "
        f"{least:g} or more, or --kv-blocks-per-replica"
    )


def _round_up(fraction: float, digits: int = 2) -> float:
    """``fraction`` (> 0) rounded up to ``digits`` significant digits."""
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(fraction)))
    return math.ceil(fraction * scale - 1e-9) / scale


def fleet_for(
    fleet: FleetConfig, requests: Sequence[WorkloadRequest], sized_by: tuple[float, int] | None = None
) -> FleetConfig:
    """``fleet`` with a ``max_model_len`` that admits every one of ``requests``.

    The fleet is sized on the stream at 1 qps, but a session workload's
    stream differs with the rate (more sessions under way, longer histories),
    so each run's stream is fitted; its cache must still hold its longest.
    ``sized_by``: as ``cache_sized_by`` gives it, for an error that names the
    least fraction that would.
    """
    longest = longest_request(requests)
    scheduler_config = fleet.scheduler_config
    if longest <= scheduler_config.max_model_len:
        return fleet
    _check_room(fleet.cache_config.num_usable_blocks, fleet.cache_config.block_size, longest, sized_by)
    return dataclasses.replace(fleet, scheduler_config=dataclasses.replace(scheduler_config, max_model_len=longest))


def fleet_at_rate(
    fleet: FleetConfig, stream: StreamSpec, qps: float | None, sized_by: tuple[float, int] | None
) -> FleetConfig:
    """``fleet_for`` the stream at ``qps``; ``ExperimentError`` naming the rate when it does not fit."""
    requests = stream_at_rate(stream, qps)
    try:
        return fleet_for(fleet, requests, sized_by)
    except ExperimentError as exc:
        raise ExperimentError(f"{stream.workload} {rate_phrase(qps)}: {exc}") from None
    except ValueError as exc:
        raise ExperimentError(f"--workload {stream.workload} {rate_phrase(qps)}: {exc}") from None


def stream_at_rate(stream: StreamSpec, qps: float | None) -> list[WorkloadRequest]:
    """``stream.at(qps)``; ``ExperimentError`` naming the workload and rate when it cannot be generated."""
    try:
        return stream.at(qps)
    except (ValueError, TypeError, OSError) as exc:  # OSError: a trace that cannot be read
        # An error about a value the user gave is about that value, whatever the rate.
        raise workload_arg_error(exc, stream.params) or ExperimentError(
            f"--workload {stream.workload} {rate_phrase(qps)}: {exc}"
        ) from None


def rate_phrase(qps: float | None) -> str:
    """A rate as an error or a progress line says it: "at 20 qps", a trace's "as recorded"."""
    return "as recorded" if qps is None else f"at {qps:g} qps"
