"""Chaos against ``kvserve serve --replicas 2 --tp 2`` behind TLS and bearer tokens: what its clients see.

    python -m kvserve.bench.chaos [--streams 12] [--max-tokens 32] [--fuzz-requests 100]
                                  [--good-streams 4] [--recovery-timeout 60] [--seed 0]

Starts ``kvserve serve --replicas 2 --tp 2`` on CPU (a tiny Llama made for the run, the default
routing) in a process and a Ray instance of its own, on a free port of 127.0.0.1, with a
self-signed TLS certificate for 127.0.0.1 and an auth token file of two tenants
(``tenant-a``, ``tenant-b``), both made for the run.  Then, in this order, with gRPC clients of
its own (greedy requests, EOS ignored):

1. auth: Generate and GetStats without a token and with a wrong one end UNAUTHENTICATED;
   health answers SERVING without a token; a plaintext client on the TLS port gets UNAVAILABLE
   (health, and Generate carrying a good token); streams with tenant A's token over TLS get
   ``--max-tokens`` tokens each, the same tokens as tenant B's streams of the same prompts;
2. tenants: tenant A sends a prompt of four blocks twice, then tenant B: A's second reports
   cached prompt tokens, B's none;
3. worker kill by name: ``ray.kill`` of actor ``kvserve-worker-r1-t0`` (namespace ``kvserve``)
   once a third of ``--streams`` streams have their first tokens: every stream ends OK with
   exactly the tokens of an undisturbed run of the same prompts just before, and within
   ``--recovery-timeout`` s of the kill GetStats says a replica went down and every replica is
   healthy again, health says SERVING, a new process holds the actor's name, and no KV block
   is held once idle;
4. worker kill by PID: the same, with SIGKILL of the process of ``kvserve-worker-r0-t1``
   (its PID from Ray's actor table, checked against ``ps``: a WorkerActor of serve's session);
5. fuzz: ``--fuzz-requests`` fuzzed Generate bodies (``fuzzed_requests.py``) with tenant A's
   token while ``--good-streams`` good streams run (``fault_fuzz.py``): every bad one is
   refused with a clear status code, the odd but valid ones and the good streams get their
   tokens, the server lives and holds no KV block once idle;
6. scheduler kill by name: ``ray.kill`` of ``kvserve-scheduler`` while ``--streams`` streams of
   ``4 x --max-tokens`` tokens run (``fault_scheduler_kill.py``): serve exits non-zero within
   10 s saying the scheduler died, health stops saying SERVING within those 10 s and
   never says it again, no process of serve's session is left, and every stream ends OK with
   its tokens or UNAVAILABLE.

The kills by name and the PID lookups go through a Ray driver in a child process, connected to
serve's Ray instance (its GCS address is on serve's Ray daemons' command lines).  Every scenario
is bounded in time; one that breaks or times out is a failed row, and the next still run; one that
sent nothing (no odd case among a few ``--fuzz-requests``) is NOT EXERCISED, a failure too: exit
code 0 vouches for every check.  Prints progress, then one table and notes under it.  Exits 1 when
a check failed or was not exercised, or serve or the Ray driver could not start, 2 on bad flags.
Loopback only; a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.bench.arg_types import int_at_least
from kvserve.bench.fault_streams import (
    Endpoint, StreamResult, blocks_in_use, generate_request, one_stream, random_prompts, read_stream,
)
from kvserve.bench.chaos_credentials import TENANT_A, TENANT_B, write_self_signed_certificate, write_token_file
from kvserve.bench.serve_process import RayDriver, ServeProcess, serve_args
from kvserve.experiments.report import format_table
from kvserve.proto import generate_pb2, generate_pb2_grpc

NUM_REPLICAS, TP_SIZE = 2, 2
# NOTE: the actor names (kvserve.cluster.scheduler_actor, kvserve.cluster.worker_actor) are imported
# where used, as they import Ray: the Ray driver's process imports this module too (spawn re-imports
# __main__), and must choose Ray's authentication mode before Ray is first imported.
KILLED_BY_NAME, KILLED_BY_PID = (1, 0), (0, 1)  # (replica, rank)
# The tenant probe's prompt: four full blocks of the default block size (16).
PROBE_PROMPT_TOKENS = 64
CALL_TIMEOUT_S = 10.0
STREAM_TIMEOUT_S = 60.0
POLL_S = 0.1
# Scenario 6: serve must have exited, and health stopped saying SERVING, this soon after the kill.
EXIT_LIMIT_S = 10.0
# What a scenario may take beyond its recovery timeout.
SCENARIO_TIMEOUT_S = 240.0


@dataclass(frozen=True, slots=True)
class Check:
    """One row of the table: one check of one scenario (``sent``/``ok`` None where no requests count);
    ``passed``: observed as expected, but one that sent none (``sent`` 0) was not exercised and fails."""

    scenario: str
    sent: int | None
    ok: int | None
    expected: str
    observed: str
    passed: bool

    @property
    def result(self) -> str:
        return "NOT EXERCISED" if self.sent == 0 else "pass" if self.passed else "FAIL"


# A scenario's rows, and its notes for under the table.
Outcome = tuple[list[Check], list[str]]


def table(checks: list[Check]) -> str:
    def count(value: int | None) -> str:
        return "-" if value is None else str(value)

    return format_table(
        ["scenario", "sent", "ok", "expected", "observed", "result"],
        [[c.scenario, count(c.sent), count(c.ok), c.expected, c.observed, c.result] for c in checks],
    )


def codes_text(codes: Counter) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(codes.items()))


# -- the scenarios ------------------------------------------------------------------------------------


@dataclass
class Chaos:
    """What every scenario reaches: serve, how to reach it, the Ray driver, the flags."""

    serve: ServeProcess
    target: str
    root_certificates: bytes
    tokens: dict[str, str]
    driver: RayDriver
    args: argparse.Namespace
    rng: random.Random
    vocab_size: int
    max_model_len: int

    def endpoint(self, token: str | None) -> Endpoint:
        return Endpoint(self.target, self.root_certificates, token)

    def tenant(self, tenant: str) -> Endpoint:
        return self.endpoint(self.tokens[tenant])


async def health_status(channel: grpc.aio.Channel) -> str:
    """The whole server's health status, or the status code of the failed call."""
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


async def stats_code(stub: generate_pb2_grpc.GenerationStub) -> str:
    try:
        await stub.GetStats(generate_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def streams(endpoint: Endpoint, prompts: list[list[int]], max_tokens: int) -> list[StreamResult]:
    async with endpoint.channel() as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(one_stream(stub, p, max_tokens, timeout=STREAM_TIMEOUT_S) for p in prompts))


async def check_auth(chaos: Chaos, prompts: list[list[int]]) -> Outcome:
    name, max_tokens = "1. auth", chaos.args.max_tokens
    checks = []
    for label, token in (("no token", None), ("wrong token", "wrong-" + secrets.token_hex(16))):
        async with chaos.endpoint(token).channel() as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            codes = [(await one_stream(stub, prompts[0], 2, timeout=CALL_TIMEOUT_S)).code, await stats_code(stub)]
        checks.append(Check(f"{name}: {label}", 2, codes.count("UNAUTHENTICATED"),
                            "Generate, GetStats: UNAUTHENTICATED", ", ".join(codes),
                            codes == ["UNAUTHENTICATED"] * 2))
    async with chaos.endpoint(None).channel() as channel:
        status = await health_status(channel)
    checks.append(Check(f"{name}: health, no token", 1, int(status == "SERVING"), "SERVING", status,
                        status == "SERVING"))
    async with grpc.aio.insecure_channel(chaos.target) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(
            generate_request(prompts[0], 2), timeout=CALL_TIMEOUT_S,
            metadata=(("authorization", f"Bearer {chaos.tokens[TENANT_A]}"),),
        )
        codes = [await health_status(channel), (await read_stream(call)).code]
    checks.append(Check(f"{name}: plaintext on the TLS port", 2, codes.count("UNAVAILABLE"),
                        "health, Generate+token: UNAVAILABLE", ", ".join(codes), codes == ["UNAVAILABLE"] * 2))
    a = await streams(chaos.tenant(TENANT_A), prompts, max_tokens)
    b = await streams(chaos.tenant(TENANT_B), prompts, max_tokens)
    ok = sum(r.code == "OK" and len(r.token_ids) == max_tokens and r.token_ids == rb.token_ids for r, rb in zip(a, b))
    checks.append(Check(
        f"{name}: good token over TLS", len(a), ok, f"OK, {max_tokens} tokens, = tenant B's",
        f"{codes_text(Counter(r.code for r in a))}; {sum(len(r.token_ids) == max_tokens for r in a)} with "
        f"{max_tokens} tokens; {sum(r.token_ids == rb.token_ids for r, rb in zip(a, b))} = B's", ok == len(a),
    ))
    return checks, []


async def cached_prompt_tokens(endpoint: Endpoint, prompt: list[int]) -> tuple[str, int | None]:
    """A 2-token request's status code, and its usage's cached prompt tokens (None: no usage came)."""
    cached = None
    async with endpoint.channel() as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(generate_request(prompt, 2), timeout=STREAM_TIMEOUT_S)
        try:
            async for message in call:
                if message.HasField("usage"):
                    cached = message.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, None
    return "OK", cached


async def check_tenants(chaos: Chaos) -> Outcome:
    prompt = [chaos.rng.randrange(3, 1000) for _ in range(PROBE_PROMPT_TOKENS)]
    first = await cached_prompt_tokens(chaos.tenant(TENANT_A), prompt)
    again = await cached_prompt_tokens(chaos.tenant(TENANT_A), prompt)
    other = await cached_prompt_tokens(chaos.tenant(TENANT_B), prompt)
    sent = [first, again, other]
    passed = all(code == "OK" for code, _ in sent) and (again[1] or 0) > 0 and other[1] == 0
    return [Check(
        "2. two tenants, one prompt", 3, sum(code == "OK" for code, _ in sent), "cached tokens: A 2nd > 0, B 0",
        f"cached tokens: A {first[1]}, A 2nd {again[1]}, B {other[1]}"
        + "".join(f"; {code}" for code, _ in sent if code != "OK"), passed,
    )], []


async def replica_outage(stub: generate_pb2_grpc.GenerationStub, since: float,
                         timeout_s: float) -> tuple[float | None, float | None]:
    """Seconds from ``since`` until GetStats first says a replica is unhealthy, and until every
    replica is healthy again after that (None: not within ``timeout_s``)."""
    down_s = None
    while (now := time.monotonic() - since) < timeout_s:
        try:
            replicas = (await stub.GetStats(generate_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S)).replicas
        except grpc.aio.AioRpcError:
            replicas = None
        if replicas is not None:
            healthy = all(r.healthy for r in replicas)
            if down_s is None and not healthy:
                down_s = now
            elif down_s is not None and healthy:
                return down_s, now
        await asyncio.sleep(POLL_S)
    return down_s, None


async def check_worker_kill(chaos: Chaos, name: str, actor: str, kill: Callable[[], Awaitable[str]]) -> Outcome:
    """Streams, ``kill`` (of ``actor``) once a third have their first tokens; then the replica's recovery."""
    args = chaos.args
    prompts = random_prompts(chaos.rng, args.streams)
    endpoint = chaos.tenant(TENANT_A)
    baseline = await streams(endpoint, prompts, args.max_tokens)
    if any(b.code != "OK" for b in baseline):
        raise RuntimeError(f"the undisturbed run failed: {codes_text(Counter(b.code for b in baseline))}")
    pid_before = await chaos.driver.pid(actor)
    async with endpoint.channel() as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        started = [asyncio.Event() for _ in prompts]
        tasks = [asyncio.create_task(one_stream(stub, p, args.max_tokens, timeout=STREAM_TIMEOUT_S, started=e))
                 for p, e in zip(prompts, started)]
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while sum(e.is_set() for e in started) < len(prompts) // 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        running = sum(not t.done() for t in tasks)
        killed_at = time.monotonic()
        outage = asyncio.create_task(replica_outage(stub, killed_at, args.recovery_timeout))
        print(f"  {await kill()} while {running} of {len(tasks)} streams ran", flush=True)
        results = await asyncio.gather(*tasks)
        down_s, back_s = await outage
        status = await health_status(channel)
        blocks = await blocks_in_use(stub) if back_s is not None else None
    try:
        pid_after: int | str = await chaos.driver.pid(actor)
    except RuntimeError as exc:
        pid_after = str(exc)
    correct = sum(r.code == "OK" and r.token_ids == b.token_ids for r, b in zip(results, baseline))
    moved = sum(len(set(r.replicas)) > 1 for r in results)
    recovered = (down_s is not None and back_s is not None and status == "SERVING" and blocks == 0
                 and isinstance(pid_after, int) and pid_after != pid_before)
    return [
        Check(f"{name}: streams", len(results), correct, "all OK, the undisturbed tokens",
              f"{codes_text(Counter(r.code for r in results))}; {correct} same tokens; {moved} moved replica",
              correct == len(results)),
        Check(f"{name}: recovery", None, None, f"down, back < {args.recovery_timeout:g} s; new pid; 0 blocks",
              f"down at {_seconds(down_s)} s, back at {_seconds(back_s)} s; health {status}; "
              f"pid {pid_before} -> {pid_after}; {'-' if blocks is None else blocks} blocks held", recovered),
    ], []


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


async def check_kill_by_name(chaos: Chaos) -> Outcome:
    from kvserve.cluster.worker_actor import worker_actor_name

    actor = worker_actor_name(*KILLED_BY_NAME)

    async def kill() -> str:
        await chaos.driver.kill(actor)
        return f"ray.kill({actor!r})"

    return await check_worker_kill(chaos, "3. worker kill by name", actor, kill)


async def check_kill_by_pid(chaos: Chaos) -> Outcome:
    from kvserve.cluster.worker_actor import worker_actor_name

    actor = worker_actor_name(*KILLED_BY_PID)

    async def kill() -> str:
        pid = await chaos.driver.pid(actor)
        command = dict(chaos.serve.session_processes()).get(pid)
        if command is None or "WorkerActor" not in command:
            raise RuntimeError(f"pid {pid} of {actor} is no WorkerActor process of serve's session: {command!r}")
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL of {actor}'s pid {pid} ({command.split()[0]})"

    return await check_worker_kill(chaos, "4. worker kill by PID", actor, kill)


async def check_fuzz(chaos: Chaos) -> Outcome:
    from kvserve.bench.fault_fuzz import scenario_fuzz
    from kvserve.bench.faults import FUZZ_MAX_TOKENS
    from kvserve.bench.fuzzed_requests import FuzzedRequests

    args, name = chaos.args, "5. fuzz"
    requests = FuzzedRequests(chaos.rng.randrange(2**32), random_prompts(chaos.rng, 1)[0],
                              chaos.vocab_size, chaos.max_model_len)
    (bad, odd, good), outcome = await scenario_fuzz(
        chaos.tenant(TENANT_A), requests, random_prompts(chaos.rng, args.good_streams), FUZZ_MAX_TOKENS,
        args.fuzz_requests, server_alive=lambda: chaos.serve.proc.poll() is None, name=name,
    )
    clear = bad.sent - len(outcome.unclear())
    return [
        Check(f"{name}: bad requests", bad.sent, clear, "100% refused, clear code; server alive",
              f"{codes_text(bad.codes)}; server {'alive' if outcome.server_alive else 'GONE'}",
              clear == bad.sent and outcome.server_alive),
        Check(f"{name}: odd, valid requests", odd.sent, odd.correct, "OK, the plain request's tokens",
              codes_text(odd.codes), odd.correct == odd.sent),
        Check(f"{name}: good streams beside", good.sent, good.correct, "OK, the undisturbed tokens; 0 blocks",
              f"{codes_text(good.codes)}; {good.blocks_in_use} blocks held",
              good.correct == good.sent and good.blocks_in_use == 0),
    ], bad.notes


async def check_scheduler_kill(chaos: Chaos) -> Outcome:
    from kvserve.bench.fault_scheduler_kill import scenario_scheduler_kill
    from kvserve.cluster.scheduler_actor import SCHEDULER_ACTOR_NAME

    name = "6. scheduler kill by name"

    async def kill() -> str:
        await chaos.driver.kill(SCHEDULER_ACTOR_NAME)
        return f"ray.kill({SCHEDULER_ACTOR_NAME!r})"

    prompts = random_prompts(chaos.rng, chaos.args.streams)
    try:
        async with chaos.tenant(TENANT_A).channel() as channel:
            scenario, outcome = await scenario_scheduler_kill(
                chaos.serve, channel, generate_pb2_grpc.GenerationStub(channel), prompts, 4 * chaos.args.max_tokens,
                kill=kill, name=name,
            )
    finally:
        chaos.driver.close()
    exited = (outcome.exit_code not in (None, 0) and outcome.exit_s is not None and outcome.exit_s <= EXIT_LIMIT_S
              and "scheduler actor died" in (outcome.error_line or ""))
    stopped = (outcome.first_not_serving_s is not None and outcome.first_not_serving_s <= EXIT_LIMIT_S
               and not outcome.serving_again)
    again = "SERVING AGAIN" if outcome.serving_again else "never again"
    clear = sum(scenario.codes[code] for code in ("OK", "UNAVAILABLE"))
    ended_ok = scenario.codes["OK"]
    return [
        Check(f"{name}: serve", None, None, f"exits non-zero < {EXIT_LIMIT_S:g} s, says why",
              f"exit code {outcome.exit_code} at {_seconds(outcome.exit_s)} s: "
              f"{(outcome.error_line or '(nothing said)')[:70]!r}", exited),
        Check(f"{name}: health", None, None, "not SERVING from the exit on",
              f"SERVING until {_seconds(outcome.last_serving_s)} s, {outcome.first_not_serving} from "
              f"{_seconds(outcome.first_not_serving_s)} s, {again}",
              stopped),
        Check(f"{name}: processes", None, None, "none of serve's session left",
              f"{len(outcome.processes_left)} left" + "".join(f"; {p[:40]}" for p in outcome.processes_left[:3]),
              not outcome.processes_left),
        Check(f"{name}: streams", scenario.sent, clear, "OK with their tokens, or UNAVAILABLE",
              f"{codes_text(scenario.codes)}; {scenario.correct} of the {ended_ok} OK with their tokens",
              clear == scenario.sent and scenario.correct == ended_ok),
    ], scenario.notes


async def bounded(name: str, scenario: Coroutine[Any, Any, Outcome], timeout_s: float) -> Outcome:
    """``scenario``'s outcome, or one failed row saying why it did not finish within ``timeout_s``."""
    print(f"{name} ...", flush=True)
    start = time.monotonic()
    try:
        checks, notes = await asyncio.wait_for(scenario, timeout_s)
    except asyncio.TimeoutError:
        checks, notes = [Check(name, None, None, f"done < {timeout_s:.0f} s", "timed out", False)], []
    except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a failed row; the next ones still run
        checks, notes = [Check(name, None, None, "completes", f"{type(exc).__name__}: {exc}"[:160], False)], []
    passed = [c.result for c in checks].count("pass")
    print(f"{name}: {passed}/{len(checks)} checks passed in {time.monotonic() - start:.0f} s", flush=True)
    return checks, notes


async def run_scenarios(chaos: Chaos) -> Outcome:
    checks: list[Check] = []
    notes: list[str] = []
    auth_prompts = random_prompts(chaos.rng, min(4, chaos.args.streams))
    timeout_s = SCENARIO_TIMEOUT_S + chaos.args.recovery_timeout
    for name, scenario in (
        ("1. auth", check_auth(chaos, auth_prompts)),
        ("2. two tenants", check_tenants(chaos)),
        ("3. worker kill by name", check_kill_by_name(chaos)),
        ("4. worker kill by PID", check_kill_by_pid(chaos)),
        ("5. fuzz", check_fuzz(chaos)),
        ("6. scheduler kill by name", check_scheduler_kill(chaos)),
    ):
        more_checks, more_notes = await bounded(name, scenario, timeout_s)
        checks += more_checks
        notes += more_notes
    return checks, notes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int_at_least(3), default=12,
                        help="streams of scenarios 3, 4 and 6 (default %(default)s)")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=32,
                        help="tokens each stream asks for; 4x in scenario 6 (default %(default)s)")
    parser.add_argument("--fuzz-requests", type=int_at_least(1), default=100,
                        help="fuzzed requests of scenario 5 (default %(default)s)")
    parser.add_argument("--good-streams", type=int_at_least(1), default=4,
                        help="good streams beside the fuzz (default %(default)s)")
    parser.add_argument("--recovery-timeout", type=float, default=60.0, metavar="S",
                        help="seconds a killed worker's replica has to serve again (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the fuzz (default %(default)s)")
    args = parser.parse_args(argv)
    if not 0 < args.recovery_timeout <= 600:
        parser.error(f"--recovery-timeout: expected seconds in (0, 600], got {args.recovery_timeout:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvserve.worker.model_config import ModelConfig
    from kvserve.worker.tiny_model import create_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvserve-chaos-") as scratch:
        directory = Path(scratch)
        model_dir = create_tiny_model(directory / "model", "llama", seed=0)
        model = ModelConfig.from_pretrained(model_dir)
        cert, key = write_self_signed_certificate(directory)
        tokens = write_token_file(directory / "tokens")
        flags = serve_args(model_dir, num_replicas=NUM_REPLICAS, tp_size=TP_SIZE, num_blocks=2048,
                           max_concurrent_requests=1024, routing=None)
        flags += ["--auth-token-file", str(directory / "tokens"), "--tls-cert", str(cert), "--tls-key", str(key)]
        print(f"starting kvserve serve --replicas {NUM_REPLICAS} --tp {TP_SIZE} on CPU with TLS and two tenants ...",
              flush=True)
        with ServeProcess(flags) as serve:
            try:
                target = f"127.0.0.1:{serve.wait_for_port()}"
                driver = RayDriver(serve.ray_address())
            except RuntimeError as exc:
                print(f"chaos: error: {exc}", flush=True)
                return 1
            chaos = Chaos(serve, target, cert.read_bytes(), tokens, driver, args, random.Random(args.seed),
                          model.vocab_size, model.max_model_len)

            async def run() -> Outcome:
                await driver.ping()
                print(f"serving on {target}; a Ray driver is connected to its Ray instance", flush=True)
                return await run_scenarios(chaos)

            try:
                checks, notes = asyncio.run(run())
            except (RuntimeError, TimeoutError) as exc:  # the Ray driver could not connect
                print(f"chaos: error: {exc}", flush=True)
                return 1
            finally:
                driver.close()
    print()
    print(table(checks))
    for note in notes:
        print(note)
    idle = [c.scenario for c in checks if c.result == "NOT EXERCISED"]
    print(f"\n{sum(c.result == 'pass' for c in checks)}/{len(checks)} checks passed"
          + (f"; not exercised (sent nothing): {', '.join(idle)}: raise --fuzz-requests" if idle else ""), flush=True)
    return 0 if all(c.result == "pass" for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
