"""``kvserve experiment --live``: the request stream replayed on a live cluster of simulated replicas.

Each run (a policy at a rate) starts a fresh cluster on Ray: the scheduler
actor routing with that policy and ``num_replicas`` simulated replicas
(``SimulatedWorker``: no model; each step sleeps the cost model's time)
configured like the simulated fleet (block size, KV blocks, token budget,
max seqs, cost model); then a gRPC front end in this process.  An asyncio
client sends every request at its arrival time, as one streaming
``Generate`` (the prompt's token ids, ``max_tokens`` = its output length,
EOS ignored, ``request_id`` = its index), and records when its first token
and its end arrive, its cached prompt tokens and its replica.

The live run samples the simulator's tokens: synthetic ones keyed by the
request id, or a multi-turn workload's own answers (``output_token_ids``,
which its later prompts repeat), handed to the workers as scripts.

``time_scale`` X stretches everything: steps last X times the modelled time
and requests arrive X times slower, so the fleet sees the same load while
Ray's and gRPC's overheads shrink against the steps; recorded times are
divided by X, comparable with the simulator's.  Each live step costs a few
milliseconds beyond its modelled time (the scheduler actor, gRPC, the front
end; more on a busy machine): with the default cost model's ~7 ms steps,
take X >= 5 (``kvserve experiment --live``'s default), and raise it until
the figures stop moving.  Measured on this project's 2-core machine, TTFT
p50 live against simulated on one stream: +19% to +133% at X = 1 (8 to 32
replicas), -3% to +15% at X = 5 on an otherwise idle machine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray

from kvserve.experiments.experiment_report import progress_line
from kvserve.experiments.workloads import WorkloadRequest
from kvserve.cluster.config import ClusterConfig, ServerConfig
from kvserve.scheduler.engine_config import ParallelConfig
from kvserve.cluster.interrupts import sigterm_cancels_task
from kvserve.cluster.launcher import ClusterHandle, init_local_ray, join_ray, start_cluster
from kvserve.cluster.server import start_server
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.scheduler.simulation.simulated_worker import SimulationConfig
from kvserve.scheduler.simulation.simulator import FleetConfig, RequestRecord

logger = logging.getLogger(__name__)

# Per request: a stream still open after this long means the run is stuck.
REQUEST_TIMEOUT_S = 600.0
_LENGTH = generate_pb2.FINISH_REASON_LENGTH


@dataclass(frozen=True, slots=True)
class LiveResult:
    """A live run in the simulator's shape: one record per request (input order), times / ``time_scale``.

    ``replica_busy_time`` is empty (the client does not see the steps);
    ``output_token_ids[i]`` are the tokens request ``i`` streamed.
    """

    policy: str
    records: list[RequestRecord]
    replica_num_requests: list[int]
    end_time: float
    wall_time: float
    output_token_ids: list[list[int]] = field(repr=False, compare=False)
    replica_busy_time: list[float] = field(default_factory=list)


def live_cluster_config(
    fleet: FleetConfig,
    stream: Sequence[WorkloadRequest],
    *,
    model_dir: str,
    policy: str,
    policy_kwargs: Mapping[str, Any] | None = None,
    time_scale: float = 1.0,
    placement_timeout_s: float | None = 60.0,
) -> ClusterConfig:
    """A cluster of simulated replicas configured like ``fleet``, routing with ``policy``.

    ``fleet.vocab_size`` must be the model's.  The answers ``stream`` scripts
    (``output_token_ids``) go to the workers, keyed by request index.
    """
    scheduler = fleet.scheduler_config
    cache = fleet.cache_config
    scripts = {
        str(index): list(item.output_token_ids)
        for index, item in enumerate(stream)
        if item.output_token_ids is not None
    }
    return ClusterConfig.from_kwargs(
        model_dir,
        parallel=ParallelConfig(num_replicas=fleet.num_replicas),
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        max_model_len=scheduler.max_model_len,
        enable_chunked_prefill=scheduler.enable_chunked_prefill,
        long_prefill_token_threshold=scheduler.long_prefill_token_threshold,
        block_size=cache.block_size,
        num_blocks=cache.num_blocks,
        enable_prefix_caching=cache.enable_prefix_caching,
        routing=policy,
        routing_args=dict(policy_kwargs or {}),
        placement_timeout_s=placement_timeout_s,
        simulation=SimulationConfig(
            cost_model=fleet.cost_model,
            time_scale=time_scale,
            vocab_size=fleet.vocab_size,
            scripted_output_token_ids=scripts,
        ),
    )


@contextmanager
def ray_session(
    address: str | None, num_worker_slots: int, report: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Ray for live runs: the driver's if it is connected, else ``address``'s, else a new local one.

    A local instance offers ``num_worker_slots`` worker slots and stops at the
    end; ``report`` is told of a Ctrl-C while it starts (``init_local_ray``).
    """
    if ray.is_initialized():
        yield
        return
    if address is not None:
        join_ray(address)
    else:
        init_local_ray(num_worker_slots, report)
    try:
        yield
    finally:
        ray.shutdown()


def run_live(
    stream: Sequence[WorkloadRequest],
    config: ClusterConfig,
    *,
    label: str = "",
    report: Callable[[str], None] = lambda line: None,
) -> LiveResult:
    """Start a cluster for ``config``, replay ``stream`` through its front end, stop it.

    Ray must be initialised.  ``report`` receives the cluster's start-up
    lines and a progress line every 10% of the requests.  ``RuntimeError``
    when the cluster fails to start or a request fails.
    """
    if config.simulation is None:
        raise ValueError("live experiments run simulated replicas: config.simulation is unset")
    handle = start_cluster(config, progress=lambda line: report(f"  {label}: {line}"))
    try:
        return asyncio.run(_stoppable(_replay(handle, stream, label, report)))
    finally:
        handle.shutdown()


async def _stoppable(replay: Awaitable[LiveResult]) -> LiveResult:
    """``replay``, which SIGTERM stops as Ctrl-C does: at an ``await`` (see ``sigterm_cancels_task``)."""
    async with sigterm_cancels_task():
        return await replay


async def _replay(
    handle: ClusterHandle, stream: Sequence[WorkloadRequest], label: str, report: Callable[[str], None]
) -> LiveResult:
    config = handle.config
    time_scale = config.simulation.time_scale or 1.0  # type: ignore[union-attr]  # checked by run_live
    server_config = ServerConfig(host="127.0.0.1", port=0, max_concurrent_requests=max(1024, len(stream)))
    server = await start_server(handle.scheduler, handle.model_info, server_config)
    loop = asyncio.get_running_loop()
    num_requests = len(stream)
    every = max(1, num_requests // 10)
    num_finished = 0
    # A rate found by --qps knee can be low: say how long the replay will take.
    arrivals_s = max((item.arrival_time for item in stream), default=0.0) * time_scale
    report(f"  {label}: replaying {num_requests} requests, arriving over {arrivals_s:.0f} s")
    wall_start = time.perf_counter()

    def on_finished() -> None:
        nonlocal num_finished
        num_finished += 1
        if num_finished % every == 0 or num_finished == num_requests:
            report(progress_line(label, num_finished, num_requests, time.perf_counter() - wall_start))

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            start = loop.time()
            tasks = []
            for index, item in enumerate(stream):
                delay = start + item.arrival_time * time_scale - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_send(stub, index, item, start, time_scale, on_finished)))
            try:
                outcomes = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
    finally:
        await server.stop(grace_s=1.0)
    records = [record for record, _ in outcomes]
    served = [0] * config.parallel.num_replicas
    for record in records:
        served[record.replica_id] += 1
    return LiveResult(
        policy=config.routing,
        records=records,
        replica_num_requests=served,
        end_time=max((r.finish_time for r in records), default=0.0),
        wall_time=time.perf_counter() - wall_start,
        output_token_ids=[tokens for _, tokens in outcomes],
    )


async def _send(
    stub: generate_pb2_grpc.GenerationStub,
    index: int,
    item: WorkloadRequest,
    start: float,
    time_scale: float,
    on_finished: Callable[[], None],
) -> tuple[RequestRecord, list[int]]:
    """One request as a streaming ``Generate``: its record (times since ``start`` / ``time_scale``) and tokens."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=list(item.prompt_token_ids)),
        sampling_params=generate_pb2.SamplingParams(max_tokens=item.output_len, ignore_eos=True),
        request_id=str(index),
        cache_salt=item.cache_salt or "",
    )
    loop = asyncio.get_running_loop()
    sent = loop.time()
    first_token: float | None = None
    last = None
    tokens: list[int] = []
    try:
        async for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S * time_scale):
            if first_token is None and response.token_ids:
                first_token = loop.time()
            tokens.extend(response.token_ids)
            last = response
    except grpc.aio.AioRpcError as exc:
        raise RuntimeError(f"request {index} failed: {exc.code().name}: {exc.details()}") from None
    finished = loop.time()
    if last is None or first_token is None or last.finish_reason != _LENGTH:
        reason = "no response" if last is None else generate_pb2.FinishReason.Name(last.finish_reason)
        raise RuntimeError(f"request {index} ended without its {item.output_len} tokens ({reason})")
    on_finished()
    record = RequestRecord(
        index=index,
        arrival_time=(sent - start) / time_scale,
        first_token_time=(first_token - start) / time_scale,
        finish_time=(finished - start) / time_scale,
        replica_id=last.replica,
        num_prompt_tokens=last.usage.prompt_tokens,
        num_cached_tokens=last.usage.cached_prompt_tokens,
        num_output_tokens=last.usage.completion_tokens,
        num_preemptions=0,  # unseen: the report shows none (see experiment_report)
    )
    return record, tokens
