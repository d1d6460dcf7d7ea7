"""Faults on a local cluster: what clients see, what is left behind, how soon it serves again.

    python -m kvserve.bench.faults [--scenarios abcde] [--streams 100] [--max-tokens 48]
                                   [--fuzz-requests 1000] [--good-streams 20]

A local Ray cluster of 2 replicas x tensor-parallel 2 on CPU serving a tiny Llama,
behind the gRPC server as ``kvserve serve`` runs it.  Every scenario first runs its
streams without the fault (the baseline: the tokens each prompt must get, and the
p99 latency of a stream), then with it:

a. kill: one worker rank of replica 1 is killed (``ray.kill``, as SIGKILL) once a third
   of the streams have their first tokens;
b. scheduler kill: the scheduler actor is SIGKILLed once a third of ``--streams`` streams
   have their first tokens; the server must end them, stop saying SERVING and exit
   non-zero at once, leaving no Ray process behind (``fault_scheduler_kill.py``);
c. cancels: ``2 x --streams`` streams, a third cancelled after their first message, a
   third with deadlines of 0.2-1 s;
d. overload: ten times ``max_concurrent_requests`` streams at once, on a server of the same
   cluster admitting 32, started in place of the first (a cluster has one front end: it is the
   scheduler's only poller); the admitted prompts are then run again (the baseline);
e. fuzz: ``--fuzz-requests`` fuzzed requests (every field, garbage bodies) while
   ``--good-streams`` good streams of ``FUZZ_MAX_TOKENS`` tokens run; every bad one must be
   refused with a clear status code (``fault_fuzz.py``).

a, c and d run against a server in this process; b and e against ``kvserve serve`` in a
process (and a Ray instance) of its own, after the first cluster is stopped: b because the
server's exit is what it measures, e because a request that crashed the server must show as a
process gone.  e runs first, as b ends that server.

Printed for each: requests sent, completed with exactly the baseline's tokens, moved to
another replica mid-stream, the status codes they ended with, KV blocks in use once
idle (must be 0), seconds until every replica serves again, and the p99 latency of the
streams that completed against the baseline's; under the table, what a row cannot say.
Loopback only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from kvserve.bench.e2e_throughput import ServerLoop
from kvserve.bench.fault_streams import (
    RPC_TIMEOUT_S, Scenario, blocks_in_use, divergences, one_stream, p99, random_prompts, table, until_all_healthy,
)
from kvserve.proto import generate_pb2, generate_pb2_grpc

NUM_REPLICAS, TP_SIZE = 2, 2
# The overload scenario's server admits this many streams; the others' admit every stream they send.
OVERLOAD_MAX_CONCURRENT_REQUESTS = 32
# What each good stream of the fuzz scenario asks for: few, so that the fuzz, not decoding, loads the server.
FUZZ_MAX_TOKENS = 16
SCENARIOS = "abcde"


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
    # A stream that differs from its own baseline: does it carry another prompt's tokens (outputs
    # delivered to the wrong stream), miss some of its own (a lost delta), or its own prompt's,
    # computed differently?
    differing = [i for i, ((_, r), b) in enumerate(zip(admitted, baseline)) if r.token_ids != b.token_ids]
    foreign = sum(
        any(admitted[i][1].token_ids == b.token_ids for j, b in enumerate(baseline) if j != i) for i in differing
    )
    short = sum(len(admitted[i][1].token_ids) < len(baseline[i].token_ids) for i in differing)
    return Scenario(
        "d. 10x overload", len(results), len(admitted) - len(differing),
        0, Counter(r.code for r in results), await blocks_in_use(stub), None,
        p99([r.seconds for _, r in admitted]), p99([b.seconds for b in baseline]),
        divergences([(r, b) for (_, r), b in zip(admitted, baseline)]),
        notes=[f"d. 10x overload: of {len(differing)} stream(s) that differ from their baseline, {foreign} carry "
               f"another admitted prompt's tokens, {short} have fewer tokens than it"] if differing else [],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=100, help="streams of the kill scenarios (default 100)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens each stream asks for (default 48)")
    parser.add_argument("--scenarios", default=SCENARIOS, help=f"which scenarios to run (default {SCENARIOS})")
    parser.add_argument("--fuzz-requests", type=int, default=1000, help="fuzzed requests of e (default 1000)")
    parser.add_argument("--good-streams", type=int, default=20, help="good streams beside the fuzz (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.streams < 3 or args.max_tokens < 1 or args.fuzz_requests < 1 or args.good_streams < 1:
        parser.error("--streams must be >= 3, --max-tokens, --fuzz-requests and --good-streams >= 1")
    if not args.scenarios or set(args.scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios: letters of {SCENARIOS}, got {args.scenarios!r}")
    from kvserve.worker.tiny_model import create_tiny_model

    rng = random.Random(args.seed)
    scenarios = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = create_tiny_model(Path(scratch) / "tiny", "llama", seed=0)
        if set(args.scenarios) & set("acd"):
            scenarios += run_in_process(args, model_dir, rng)
        if set(args.scenarios) & set("be"):
            scenarios += run_served(args, model_dir, rng)
    scenarios.sort(key=lambda s: s.name)
    print()
    print(table(scenarios))
    for s in scenarios:
        if s.divergences:
            print(f"{s.name}: streams that differ from their baseline first differ at tokens {sorted(s.divergences)}")
        for note in s.notes:
            print(note)
    return 0


def run_in_process(args: argparse.Namespace, model_dir: Path, rng: random.Random) -> list[Scenario]:
    """Scenarios a, c and d: a cluster and its server in this process."""
    import ray

    from kvserve.cluster.config import ClusterConfig, ServerConfig

    from kvserve.scheduler.engine_config import ParallelConfig
    from kvserve.cluster.launcher import init_local_ray, start_cluster
    from kvserve.cluster.server import start_server

    print("starting a local cluster: 2 replicas x TP 2 on CPU ...", flush=True)
    init_local_ray(num_worker_slots=NUM_REPLICAS * TP_SIZE)
    server_loop = ServerLoop()
    handle = None
    try:
        handle = start_cluster(ClusterConfig.from_kwargs(
            str(model_dir), parallel=ParallelConfig(tensor_parallel_size=TP_SIZE, num_replicas=NUM_REPLICAS),
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
                        done.append(await scenario_kill(stub, random_prompts(rng, args.streams), args.max_tokens))
                        print(f"  {done[-1].name}: done", flush=True)
                    if "c" in args.scenarios:
                        done.append(await scenario_cancels(
                            stub, random_prompts(rng, 2 * args.streams), args.max_tokens, rng
                        ))
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
                            stub, random_prompts(rng, 10 * OVERLOAD_MAX_CONCURRENT_REQUESTS), args.max_tokens
                        ))
                        print(f"  {done[-1].name}: done", flush=True)
                finally:
                    await on_server_loop(server.stop(grace_s=1.0))
            return done

        return asyncio.run(run_all())
    finally:
        server_loop.close()
        if handle is not None:
            handle.shutdown()
        ray.shutdown()


def run_served(args: argparse.Namespace, model_dir: Path, rng: random.Random) -> list[Scenario]:
    """Scenarios e, then b: ``kvserve serve`` in a process of its own, the same cluster behind it."""
    from kvserve.bench.fault_fuzz import scenario_fuzz
    from kvserve.bench.fuzzed_requests import FuzzedRequests
    from kvserve.bench.fault_scheduler_kill import scenario_scheduler_kill
    from kvserve.bench.serve_process import ServeProcess, serve_args
    from kvserve.worker.model_config import ModelConfig

    model = ModelConfig.from_pretrained(model_dir)
    print("starting kvserve serve in a process of its own: 2 replicas x TP 2 on CPU ...", flush=True)
    with ServeProcess(serve_args(model_dir, num_replicas=NUM_REPLICAS, tp_size=TP_SIZE, num_blocks=2048,
                                 max_concurrent_requests=max(1024, 2 * args.streams))) as serve:
        port = serve.wait_for_port()

        async def run_all() -> list[Scenario]:
            done = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                if "e" in args.scenarios:
                    requests = FuzzedRequests(
                        rng.randrange(2**32), random_prompts(rng, 1)[0], model.vocab_size, model.max_model_len
                    )
                    rows, _ = await scenario_fuzz(
                        f"127.0.0.1:{port}", requests, random_prompts(rng, args.good_streams), FUZZ_MAX_TOKENS,
                        args.fuzz_requests, server_alive=lambda: serve.proc.poll() is None,
                    )
                    done += rows
                    print(f"  {rows[0].name}: done", flush=True)
                if "b" in args.scenarios:
                    scenario, _ = await scenario_scheduler_kill(
                        serve, channel, stub, random_prompts(rng, args.streams), args.max_tokens
                    )
                    done.append(scenario)
                    print(f"  {scenario.name}: done", flush=True)
            return done

        return asyncio.run(run_all())


if __name__ == "__main__":
    raise SystemExit(main())
