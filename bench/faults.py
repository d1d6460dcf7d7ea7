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
   scheduler's only poller); the admitted prompts are then run again (the baseline), in batches
   the server admits (short streams end during the burst: more than 32 can be admitted in all);
e. fuzz: ``--fuzz-requests`` fuzzed requests (every field, garbage bodies) while
   ``--good-streams`` good streams of ``FUZZ_MAX_TOKENS`` tokens run; every bad one must be
   refused with a clear status code (``fault_fuzz.py``).

a, c and d run against a server in this process; b and e against ``kvserve serve`` in a
process (and a Ray instance) of its own, after the first cluster is stopped: b because the
server's exit is what it measures, e because a request that crashed the server must show as a
process gone.  e runs first, as b ends that server.

Printed for each: requests sent, completed with exactly the baseline's tokens, moved to
another replica mid-stream, the status codes they ended with, KV blocks in use once
idle (must be 0), seconds until every replica serves again (TIMED OUT past
``RECOVERY_TIMEOUT_S``), the p99 latency of the streams that completed against the
baseline's, and the verdict: pass, or FAIL and which of its checks did not hold (a row
that sent nothing is NOT EXERCISED, and fails too); under the table, what each row checks
and what a row cannot say.  A scenario that raises is a failed row; the others still run.
Exits 1 when a row did not pass, 2 on bad flags.  Loopback only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from kvserve.bench.arg_types import int_at_least
from kvserve.bench.e2e_throughput import ServerLoop
from kvserve.bench.fault_streams import (
    RECOVERY_TIMEOUT_S, RPC_TIMEOUT_S, Scenario, StreamResult, blocks_in_use, divergences, failed_scenario,
    one_stream, p99, random_prompts, table, until_all_healthy,
)
from kvserve.proto import generate_pb2, generate_pb2_grpc

NUM_REPLICAS, TP_SIZE = 2, 2
# The overload scenario's server admits this many streams; the others' admit every stream they send.
OVERLOAD_MAX_CONCURRENT_REQUESTS = 32
# What each good stream of the fuzz scenario asks for: few, so that the fuzz, not decoding, loads the server.
FUZZ_MAX_TOKENS = 16
SCENARIOS = "abcde"
# Each scenario's row name (fault e has three rows, all starting with its name).
NAMES = {"a": "a. kill a worker rank", "b": "b. kill the scheduler", "c": "c. cancels and deadlines",
         "d": "d. 10x overload", "e": "e. fuzz"}
# Tries of an admitted prompt's rerun that the overload server refuses (a slot freed a moment late).
RERUN_TRIES = 3


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
    # The kill lands while replica 1 runs streams (so that some have somewhere to move), unless
    # every stream ends first: on a loaded machine a third may start before it got any.
    while True:
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)).replicas
        if any(s.replica == 1 and s.num_running for s in stats) or all(task.done() for task in tasks):
            break
        await asyncio.sleep(0.01)
    print(f"  killing replica 1 rank 0 while replicas run {[s.num_running for s in stats]} requests", flush=True)
    kill_worker(1, 0)
    killed_at = time.monotonic()
    results = await asyncio.gather(*tasks)
    recovery_s = await until_all_healthy(stub, killed_at)
    correct = sum(r.code == "OK" and r.token_ids == b.token_ids for r, b in zip(results, baseline))
    blocks = await blocks_in_use(stub)
    return Scenario(
        NAMES["a"], len(prompts), correct,
        sum(len(set(r.replicas)) > 1 for r in results), Counter(r.code for r in results), blocks, recovery_s,
        p99([r.seconds for r in results if r.code == "OK"]), p99([b.seconds for b in baseline]),
        divergences(list(zip(results, baseline))),
        requirements=[("every stream OK with the baseline's tokens", correct == len(prompts)),
                      ("0 blocks in use after idle", blocks == 0),
                      (f"every replica serves again within {RECOVERY_TIMEOUT_S:.0f} s", recovery_s is not None)],
        recovery_timeout_s=RECOVERY_TIMEOUT_S,
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
    correct = sum(r.token_ids == b.token_ids for r, b in completed)
    codes = Counter(r.code for r in results)
    blocks = await blocks_in_use(stub)
    return Scenario(
        NAMES["c"], len(prompts), correct, 0, codes, blocks, None,
        p99([r.seconds for r, _ in completed]), p99([b.seconds for b in baseline]), divergences(completed),
        requirements=[("completed streams have the baseline's tokens", correct == len(completed)),
                      ("streams end OK, CANCELLED or DEADLINE_EXCEEDED",
                       set(codes) <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED"}),
                      ("0 blocks in use after idle", blocks == 0)],
    )


def batches(items: list, size: int) -> list[list]:
    """``items`` in order, in lists of at most ``size``."""
    return [items[i : i + size] for i in range(0, len(items), size)]


async def rerun_within_limit(run_one: Callable[[list[int]], Awaitable[StreamResult]], prompts: list[list[int]],
                             limit: int) -> list[StreamResult]:
    """Each prompt run again by ``run_one``, at most ``limit`` at a time: all of a batch end before the next starts.

    NOTE: short streams end during an overload, so more prompts than the server admits at once can
    have been admitted in all; sent together again, the limit would refuse some.  A refusal
    (RESOURCE_EXHAUSTED: a slot freed a moment after its stream ended) is tried again, ``RERUN_TRIES`` in all.
    """
    results: list[StreamResult] = []
    for batch in batches(prompts, limit):
        done = await asyncio.gather(*(run_one(p) for p in batch))
        for _ in range(RERUN_TRIES - 1):
            refused = [i for i, r in enumerate(done) if r.code == "RESOURCE_EXHAUSTED"]
            if not refused:
                break
            await asyncio.sleep(0.2)
            for i, r in zip(refused, await asyncio.gather(*(run_one(batch[i]) for i in refused))):
                done[i] = r
        results += done
    return results


async def scenario_overload(stub, prompts: list[list[int]], max_tokens: int,
                            limit: int = OVERLOAD_MAX_CONCURRENT_REQUESTS) -> Scenario:
    """``prompts`` at once, ten times the server's ``limit``; the admitted ones run again after, within it."""
    results = await asyncio.gather(*(one_stream(stub, p, max_tokens) for p in prompts))
    admitted = [(p, r) for p, r in zip(prompts, results) if r.code == "OK"]
    # Salted: computed afresh, as the overload computed them, not over a prefix-cache hit.
    baseline = await rerun_within_limit(
        lambda p: one_stream(stub, p, max_tokens, cache_salt="baseline"), [p for p, _ in admitted], limit
    )
    served_again = sum(b.code == "OK" for b in baseline)
    # A stream that differs from its own baseline: does it carry another prompt's tokens (outputs
    # delivered to the wrong stream), miss some of its own (a lost delta), or its own prompt's,
    # computed differently?  Only streams whose baseline was served can be compared.
    compared = [((p, r), b) for (p, r), b in zip(admitted, baseline) if b.code == "OK"]
    differing = [i for i, ((_, r), b) in enumerate(compared) if r.token_ids != b.token_ids]
    foreign = sum(
        any(compared[i][0][1].token_ids == b.token_ids for j, (_, b) in enumerate(compared) if j != i)
        for i in differing
    )
    short = sum(len(compared[i][0][1].token_ids) < len(compared[i][1].token_ids) for i in differing)
    codes = Counter(r.code for r in results)
    blocks = await blocks_in_use(stub)
    notes = [f"{NAMES['d']}: {len(admitted)} admitted in all (the server admits {limit} at a time), "
             f"run again in batches of {limit}: {served_again} served again"]
    if differing:
        notes.append(f"{NAMES['d']}: of {len(differing)} stream(s) that differ from their baseline, {foreign} carry "
                     f"another admitted prompt's tokens, {short} have fewer tokens than it")
    return Scenario(
        NAMES["d"], len(results), len(compared) - len(differing),
        0, codes, blocks, None,
        p99([r.seconds for _, r in admitted]), p99([b.seconds for b in baseline if b.code == "OK"]),
        divergences([(r, b) for (_, r), b in compared]),
        notes=notes,
        requirements=[("some admitted, the rest RESOURCE_EXHAUSTED",
                       bool(admitted) and set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}),
                      ("the admitted served again within the limit", served_again == len(admitted)),
                      ("admitted streams have their prompt's tokens", not differing),
                      ("0 blocks in use after idle", blocks == 0)],
    )


async def guarded(name: str, scenario: Awaitable[Scenario | list[Scenario]]) -> list[Scenario]:
    """``scenario``'s rows, or one failed row if it raises: the scenarios after it still run."""
    try:
        done = await scenario
    except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a failed row
        print(f"  {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        return [failed_scenario(name, exc)]
    rows = done if isinstance(done, list) else [done]
    print(f"  {name}: done", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int_at_least(3), default=100,
                        help="streams of the kill scenarios (default 100)")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=48,
                        help="tokens each stream asks for (default 48)")
    parser.add_argument("--scenarios", default=SCENARIOS, help=f"which scenarios to run (default {SCENARIOS})")
    parser.add_argument("--fuzz-requests", type=int_at_least(1), default=1000,
                        help="fuzzed requests of e (default 1000)")
    parser.add_argument("--good-streams", type=int_at_least(1), default=20,
                        help="good streams beside the fuzz (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.scenarios or set(args.scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios: letters of {SCENARIOS}, got {args.scenarios!r}")
    from kvserve.worker.tiny_model import create_tiny_model

    rng = random.Random(args.seed)
    scenarios = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = create_tiny_model(Path(scratch) / "tiny", "llama", seed=0)
        for letters, run in (("acd", run_in_process), ("be", run_served)):
            chosen = [letter for letter in letters if letter in args.scenarios]
            if not chosen:
                continue
            try:
                scenarios += run(args, model_dir, rng)
            except Exception as exc:  # noqa: BLE001 - a cluster that would not start fails its scenarios only
                print(f"  {', '.join(NAMES[c] for c in chosen)}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                scenarios += [failed_scenario(NAMES[c], exc) for c in chosen]
    scenarios.sort(key=lambda s: s.name)
    print()
    print(table(scenarios))
    for s in scenarios:
        if s.requirements and s.sent:
            print(f"{s.name}: checks: {'; '.join(text for text, _ in s.requirements)}")
        if s.divergences:
            print(f"{s.name}: streams that differ from their baseline first differ at tokens {sorted(s.divergences)}")
        for note in s.notes:
            print(note)
    failed = sum(not s.passed for s in scenarios)
    idle = [s.name for s in scenarios if not s.exercised and not s.unmet]
    print(f"\n{len(scenarios) - failed}/{len(scenarios)} rows passed"
          + (f"; not exercised (sent nothing): {', '.join(idle)}: raise --fuzz-requests" if idle else ""), flush=True)
    return 1 if failed else 0


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
                        done += await guarded(NAMES["a"], scenario_kill(
                            stub, random_prompts(rng, args.streams), args.max_tokens
                        ))
                    if "c" in args.scenarios:
                        done += await guarded(NAMES["c"], scenario_cancels(
                            stub, random_prompts(rng, 2 * args.streams), args.max_tokens, rng
                        ))
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
                        done += await guarded(NAMES["d"], scenario_overload(
                            stub, random_prompts(rng, 10 * OVERLOAD_MAX_CONCURRENT_REQUESTS), args.max_tokens
                        ))
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

                    async def fuzz() -> list[Scenario]:
                        rows, _ = await scenario_fuzz(
                            f"127.0.0.1:{port}", requests, random_prompts(rng, args.good_streams), FUZZ_MAX_TOKENS,
                            args.fuzz_requests, server_alive=lambda: serve.proc.poll() is None, name=NAMES["e"],
                        )
                        return rows

                    done += await guarded(NAMES["e"], fuzz())
                if "b" in args.scenarios:

                    async def scheduler_kill() -> Scenario:
                        scenario, _ = await scenario_scheduler_kill(
                            serve, channel, stub, random_prompts(rng, args.streams), args.max_tokens, name=NAMES["b"]
                        )
                        return scenario

                    done += await guarded(NAMES["b"], scheduler_kill())
            return done

        return asyncio.run(run_all())


if __name__ == "__main__":
    raise SystemExit(main())
