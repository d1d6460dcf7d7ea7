"""Faults on a local cluster: what clients see, what is left behind, how soon it serves again.

    python -m kvserve.bench.faults [--streams 100] [--max-tokens 48]

A local Ray cluster of 2 replicas x tensor-parallel 2 on CPU serving a tiny Llama,
behind the gRPC server as ``kvserve serve`` runs it.  Every scenario first runs its
streams without the fault (the baseline: the tokens each prompt must get, and the
p99 latency of a stream), then with it:

a. kill: one worker rank of replica 1 is killed (``ray.kill``, as SIGKILL) once a third
   of the streams have their first tokens;
c. cancels: ``2 x --streams`` streams, a third cancelled after their first message, a
   third with deadlines of 0.2-1 s;
d. overload: ten times ``max_concurrent_requests`` streams at once, on a server of the same
   cluster admitting 32, started in place of the first (a cluster has one front end: it is the
   scheduler's only poller); the admitted prompts are then run again (the baseline).

Printed for each: requests sent, completed with exactly the baseline's tokens, moved to
another replica mid-stream, the status codes they ended with, KV blocks in use once
idle (must be 0), seconds until every replica serves again, and the p99 latency of the
streams that completed against the baseline's.  Loopback only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvserve.bench.e2e_throughput import ServerLoop
from kvserve.experiments.report import format_table
from kvserve.proto import generate_pb2, generate_pb2_grpc

NUM_REPLICAS, TP_SIZE = 2, 2
# The overload scenario's server admits this many streams; the others' admit every stream they send.
OVERLOAD_MAX_CONCURRENT_REQUESTS = 32
RPC_TIMEOUT_S = 120.0


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    code: str = "OK"
    seconds: float = 0.0


@dataclass
class Scenario:
    name: str
    sent: int
    correct: int
    moved: int
    codes: Counter
    blocks_in_use: int
    recovery_s: float | None
    p99_s: float | None
    baseline_p99_s: float | None
    # For each completed stream whose tokens differ from its baseline's: the index of the first difference.
    divergences: list[int] = field(default_factory=list)


async def one_stream(stub, prompt: list[int], max_tokens: int, *, timeout: float = RPC_TIMEOUT_S,
                     cancel_after: int | None = None, started: asyncio.Event | None = None,
                     cache_salt: str = "") -> StreamResult:
    result = StreamResult()
    start = time.perf_counter()
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling_params=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=cache_salt,
    )
    call = stub.Generate(request, timeout=timeout)
    try:
        async for message in call:
            result.token_ids += message.token_ids
            result.replicas.append(message.replica)
            if started is not None:
                started.set()
            if cancel_after is not None and len(result.replicas) >= cancel_after:
                call.cancel()
                result.code = "CANCELLED"
                break
    except grpc.aio.AioRpcError as exc:
        result.code = exc.code().name
    except asyncio.CancelledError:
        result.code = "CANCELLED"
    result.seconds = time.perf_counter() - start
    return result


def divergences(pairs: list[tuple[StreamResult, StreamResult]]) -> list[int]:
    """Where each completed stream first differs from its baseline (streams that equal it left out)."""
    found = []
    for result, baseline in pairs:
        if result.code == "OK" and result.token_ids != baseline.token_ids:
            found.append(next((i for i, (a, b) in enumerate(zip(result.token_ids, baseline.token_ids)) if a != b),
                              min(len(result.token_ids), len(baseline.token_ids))))
    return found


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def blocks_in_use(stub, timeout_s: float = 10.0) -> int:
    """KV blocks held on the healthy replicas once they are idle (waits up to ``timeout_s`` for idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)).replicas
        healthy = [s for s in stats if s.healthy]
        idle = all(s.num_running == 0 and s.num_waiting == 0 for s in healthy)
        used = sum(round(s.kv_cache_usage * (s.num_kv_blocks - 1)) for s in healthy)
        if (idle and used == 0) or time.monotonic() > deadline:
            return used


async def until_all_healthy(stub, since: float, timeout_s: float = 90.0) -> float | None:
    while time.monotonic() - since < timeout_s:
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)).replicas
        if all(s.healthy for s in stats):
            return time.monotonic() - since
        await asyncio.sleep(0.2)
    return None


def kill_worker(replica: int, rank: int) -> None:
    import ray

    from kvserve.cluster.worker_actor import RAY_NAMESPACE, worker_actor_name

    ray.kill(ray.get_actor(worker_actor_name(replica, rank), namespace=RAY_NAMESPACE))


async def scenario_kill(stub, prompts: list[list[int]], max_tokens: int) -> Scenario:
    baseline = await asyncio.gather(*(one_stream(stub, p, max_tokens) for p in prompts))
    started = [asyncio.Event() for _ in prompts]
    tasks = [asyncio.create_task(one_stream(stub, p, max_tokens, started=e)) for p, e in zip(prompts, started)]
    while sum(e.is_set() for e in started) < len(prompts) // 3:
        await asyncio.sleep(0.01)
    stats = (await stub.GetStats(generate_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)).replicas
    print(f"  killing replica 1 rank 0 while replicas run {[s.num_running for s in stats]} requests", flush=True)
    kill_worker(1, 0)
    killed_at = time.monotonic()
    results = await asyncio.gather(*tasks)
    recovery_s = await until_all_healthy(stub, killed_at)
    return Scenario(
        "a. kill a worker rank", len(prompts),
        sum(r.code == "OK" and r.token_ids == b.token_ids for r, b in zip(results, baseline)),
        sum(len(set(r.replicas)) > 1 for r in results), Counter(r.code for r in results),
        await blocks_in_use(stub), recovery_s,
        p99([r.seconds for r in results if r.code == "OK"]), p99([b.seconds for b in baseline]),
        divergences(list(zip(results, baseline))),
    )


async def scenario_cancels(stub, prompts: list[list[int]], max_tokens: int, rng: random.Random) -> Scenario:
    baseline = await asyncio.gather(*(one_stream(stub, p, max_tokens) for p in prompts))
    kinds = [rng.choice(("cancel", "deadline", "complete")) for _ in prompts]
    results = await asyncio.gather(*(
        one_stream(stub, p, max_tokens, cancel_after=1) if kind == "cancel"
        else one_stream(stub, p, max_tokens, timeout=rng.uniform(0.2, 1.0)) if kind == "deadline"
        else one_stream(stub, p, max_tokens)
        for p, kind in zip(prompts, kinds)
    ))
    completed = [(r, b) for r, b in zip(results, baseline) if r.code == "OK"]
    return Scenario(
        "c. cancels and deadlines", len(prompts), sum(r.token_ids == b.token_ids for r, b in completed),
        0, Counter(r.code for r in results), await blocks_in_use(stub), None,
        p99([r.seconds for r, _ in completed]), p99([b.seconds for b in baseline]), divergences(completed),
    )


async def scenario_overload(stub, prompts: list[list[int]], max_tokens: int) -> Scenario:
    """Ten times the concurrency limit at once (``prompts``); the admitted ones run again alone after."""
    results = await asyncio.gather(*(one_stream(stub, p, max_tokens) for p in prompts))
    admitted = [(p, r) for p, r in zip(prompts, results) if r.code == "OK"]
    # Salted: computed afresh, as the overload computed them, not over a prefix-cache hit.
    baseline = await asyncio.gather(*(one_stream(stub, p, max_tokens, cache_salt="baseline") for p, _ in admitted))
    if any(b.code != "OK" for b in baseline):
        raise RuntimeError("the cluster did not serve the admitted prompts again after the overload")
    return Scenario(
        "d. 10x overload", len(results), sum(r.token_ids == b.token_ids for (_, r), b in zip(admitted, baseline)),
        0, Counter(r.code for r in results), await blocks_in_use(stub), None,
        p99([r.seconds for _, r in admitted]), p99([b.seconds for b in baseline]),
        divergences([(r, b) for (_, r), b in zip(admitted, baseline)]),
    )


def table(scenarios: list[Scenario]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = [
        [s.name, s.sent, s.correct, s.moved, ", ".join(f"{code} {n}" for code, n in sorted(s.codes.items())),
         s.blocks_in_use, seconds(s.recovery_s), seconds(s.p99_s), seconds(s.baseline_p99_s),
         "-" if not (s.p99_s and s.baseline_p99_s) else f"{s.p99_s / s.baseline_p99_s:.2f}x"]
        for s in scenarios
    ]
    return format_table(
        ["scenario", "sent", "completed correctly", "moved", "ended with", "blocks in use after idle",
         "s to full capacity", "p99 s", "baseline p99 s", "p99 vs baseline"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=100, help="streams of the kill scenario (default 100)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens each stream asks for (default 48)")
    parser.add_argument("--scenarios", default="acd", help="which scenarios to run (default acd)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.streams < 3 or args.max_tokens < 1:
        parser.error("--streams must be >= 3 and --max-tokens >= 1")
    import ray

    from kvserve.cluster.config import ClusterConfig, ParallelConfig, ServerConfig
    from kvserve.cluster.launcher import init_local_ray, start_cluster
    from kvserve.cluster.server import start_server
    from kvserve.worker.tiny_model import create_tiny_model

    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 64))] for _ in range(n)]

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = create_tiny_model(Path(scratch) / "tiny", "llama", seed=0)
        print("starting a local cluster: 2 replicas x TP 2 on CPU ...", flush=True)
        init_local_ray(num_worker_slots=NUM_REPLICAS * TP_SIZE)
        server_loop = ServerLoop()
        handle = None
        try:
            handle = start_cluster(ClusterConfig(
                model_dir=str(model_dir), parallel=ParallelConfig(tensor_parallel_size=TP_SIZE, num_replicas=NUM_REPLICAS),
                device="cpu", num_blocks=2048, routing="round_robin",
            ))

            async def on_server_loop(coro):  # the server runs on its own loop, as `kvserve serve` runs it
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, server_loop.loop))

            async def run_all() -> list[Scenario]:
                done = []
                server = await on_server_loop(start_server(
                    handle.scheduler, handle.model_info, ServerConfig(port=0, max_concurrent_requests=max(1024, 2 * args.streams))
                ))
                try:
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                        stub = generate_pb2_grpc.GenerationStub(channel)
                        if "a" in args.scenarios:
                            done.append(await scenario_kill(stub, prompts(args.streams), args.max_tokens))
                            print(f"  {done[-1].name}: done", flush=True)
                        if "c" in args.scenarios:
                            done.append(await scenario_cancels(stub, prompts(2 * args.streams), args.max_tokens, rng))
                            print(f"  {done[-1].name}: done", flush=True)
                finally:
                    await on_server_loop(server.stop(grace_s=1.0))
                if "d" in args.scenarios:
                    server = await on_server_loop(start_server(
                        handle.scheduler, handle.model_info,
                        ServerConfig(port=0, max_concurrent_requests=OVERLOAD_MAX_CONCURRENT_REQUESTS),
                    ))
                    try:
                        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                            stub = generate_pb2_grpc.GenerationStub(channel)
                            done.append(await scenario_overload(
                                stub, prompts(10 * OVERLOAD_MAX_CONCURRENT_REQUESTS), args.max_tokens
                            ))
                            print(f"  {done[-1].name}: done", flush=True)
                    finally:
                        await on_server_loop(server.stop(grace_s=1.0))
                return done

            scenarios = asyncio.run(run_all())
        finally:
            server_loop.close()
            if handle is not None:
                handle.shutdown()
            ray.shutdown()
    print()
    print(table(scenarios))
    for s in scenarios:
        if s.divergences:
            print(f"{s.name}: streams that differ from their baseline first differ at tokens {sorted(s.divergences)} "
                  f"of {args.max_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
