"""What every fault scenario (``bench/faults.py``) measures: streams, their endings, the table.

A ``Scenario`` is one row of the faults table; ``notes`` are the lines printed
under it (what a row's columns cannot say: an exit code, a health timeline);
``requirements`` are what it checks, each with whether it held: the row's verdict.
An ``Endpoint`` says how a client reaches the server: plaintext, or TLS with a
bearer token on every call.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from kvserve.experiments.report import format_table
from kvserve.proto import generate_pb2

RPC_TIMEOUT_S = 120.0
# How long a scenario that measures recovery waits for every replica to serve again.
RECOVERY_TIMEOUT_S = 90.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A server's ``target`` (``host:port``) and how to reach it: plaintext, or TLS trusting
    ``root_certificates`` (PEM), with ``token`` sent as ``authorization: Bearer`` on every call.

    Picklable, so that a client process of its own can open the same channel.
    """

    target: str
    root_certificates: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and self.root_certificates is None:
            # NOTE: gRPC sends call credentials over secure channels only.
            raise ValueError("a bearer token is sent over TLS only: give root_certificates too")

    def channel(self) -> grpc.aio.Channel:
        if self.root_certificates is None:
            return grpc.aio.insecure_channel(self.target)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
        if self.token is not None:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.token)
            )
        return grpc.aio.secure_channel(self.target, credentials)


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    code: str = "OK"
    details: str = ""
    started_at: float = 0.0  # time.monotonic()
    seconds: float = 0.0

    def overlaps(self, windows: list[tuple[float, float]]) -> bool:
        """Whether the stream ran during any of ``windows`` (monotonic start and end)."""
        end = self.started_at + self.seconds
        return any(self.started_at < window_end and end > window_start for window_start, window_end in windows)


@dataclass
class Scenario:
    name: str
    sent: int
    # Completed with exactly the baseline's tokens (None: nothing to compare with, as for refused requests).
    correct: int | None
    moved: int
    codes: Counter
    # None: nothing left to ask (the server is gone).
    blocks_in_use: int | None
    recovery_s: float | None
    p99_s: float | None
    baseline_p99_s: float | None
    # For each completed stream whose tokens differ from its baseline's: the index of the first difference.
    divergences: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What the row checks, each with whether it held.
    requirements: list[tuple[str, bool]] = field(default_factory=list)
    # Set where the row measures recovery: then a ``recovery_s`` of None means it timed out after this long.
    recovery_timeout_s: float | None = None

    @property
    def unmet(self) -> list[str]:
        return [text for text, met in self.requirements if not met]

    @property
    def exercised(self) -> bool:
        """Whether the row sent anything: one that sent nothing checked nothing."""
        return self.sent > 0

    @property
    def passed(self) -> bool:
        return self.exercised and not self.unmet

    def verdict(self) -> str:
        if self.unmet:
            return "FAIL: " + "; ".join(self.unmet)
        return "pass" if self.exercised else "NOT EXERCISED (nothing sent)"


def failed_scenario(name: str, exc: BaseException) -> Scenario:
    """The row of a scenario that raised ``exc`` instead of finishing."""
    return Scenario(name, 0, None, 0, Counter(), None, None, None, None,
                    requirements=[(f"completes ({type(exc).__name__}: {exc})"[:200], False)])


def random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """``n`` prompts of 8 to 63 random token ids."""
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 64))] for _ in range(n)]


def generate_request(prompt: list[int], max_tokens: int, cache_salt: str = "") -> generate_pb2.GenerateRequest:
    """A greedy request for ``max_tokens`` tokens, EOS ignored: its tokens are the same on every run."""
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling_params=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=cache_salt,
    )


async def read_stream(call, *, cancel_after: int | None = None, started: asyncio.Event | None = None) -> StreamResult:
    """Read ``call`` (a ``Generate`` call) to its end: its tokens, replicas, status code and time."""
    result = StreamResult(started_at=time.monotonic())
    start = time.perf_counter()
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
        result.details = exc.details() or ""
    except asyncio.CancelledError:
        result.code = "CANCELLED"
    result.seconds = time.perf_counter() - start
    return result


async def one_stream(stub, prompt: list[int], max_tokens: int, *, timeout: float = RPC_TIMEOUT_S,
                     cancel_after: int | None = None, started: asyncio.Event | None = None,
                     cache_salt: str = "") -> StreamResult:
    call = stub.Generate(generate_request(prompt, max_tokens, cache_salt), timeout=timeout)
    return await read_stream(call, cancel_after=cancel_after, started=started)


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
        await asyncio.sleep(0.1)


async def until_all_healthy(stub, since: float, timeout_s: float = RECOVERY_TIMEOUT_S) -> float | None:
    """Seconds from ``since`` until every replica is healthy; None when that took over ``timeout_s``."""
    while time.monotonic() - since < timeout_s:
        stats = (await stub.GetStats(generate_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S)).replicas
        if all(s.healthy for s in stats):
            return time.monotonic() - since
        await asyncio.sleep(0.2)
    return None


def table(scenarios: list[Scenario]) -> str:
    """The faults table: one row per scenario, its verdict last ("-": the column does not apply)."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    def recovery(s: Scenario) -> str:
        if s.recovery_s is None and s.recovery_timeout_s is not None:
            return f"TIMED OUT (> {s.recovery_timeout_s:.0f})"
        return seconds(s.recovery_s)

    def count(value: int | None) -> str:
        return "-" if value is None else str(value)

    rows = [
        [s.name, s.sent, count(s.correct), s.moved, ", ".join(f"{code} {n}" for code, n in sorted(s.codes.items())),
         count(s.blocks_in_use), recovery(s), seconds(s.p99_s), seconds(s.baseline_p99_s),
         "-" if not (s.p99_s and s.baseline_p99_s) else f"{s.p99_s / s.baseline_p99_s:.2f}x", s.verdict()]
        for s in scenarios
    ]
    return format_table(
        ["scenario", "sent", "completed correctly", "moved", "ended with", "blocks in use after idle",
         "s to full capacity", "p99 s", "baseline p99 s", "p99 vs baseline", "verdict"],
        rows,
    )
