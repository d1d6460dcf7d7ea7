"""Fault e: fuzzed ``Generate`` requests while good streams run.

The bodies (``fuzzed_requests.py``) are bad in every field, or garbage: each must
end with a clear refusal (``CLEAR_REFUSALS``), never crash or stall the server; a
few are odd but valid, and must be served with the tokens their plain form gets.
Each kind is sent once, then kinds are drawn at random from a seeded ``Random``,
by a client process of its own, ``FUZZ_CONCURRENCY`` requests at a time, in
``FUZZ_BURSTS`` bursts with quiet spells before, between and after them.  Meanwhile good streams run back to back,
one lane per prompt: the p99 latency of those that overlap a burst is compared
with that of those that overlap none (the baseline), interleaved over the same
minutes so that the load of whatever else runs on the machine falls on both.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kvserve.bench.fault_streams import (
    Endpoint, Scenario, StreamResult, blocks_in_use, divergences, one_stream, p99, read_stream,
)
from kvserve.bench.fuzzed_requests import ODD_MAX_TOKENS, FuzzedRequests
from kvserve.proto import generate_pb2, generate_pb2_grpc

GENERATE_METHOD = "/kvserve.v1.Generation/Generate"
# What a refusal of a bad request may end with: the client is told what is wrong.
CLEAR_REFUSALS = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE", "FAILED_PRECONDITION"})
FUZZ_TIMEOUT_S = 30.0
# Requests in flight from the fuzz client: this sets the fuzz's rate.  NOTE: every refusal costs
# the front end CPU (about a millisecond) that, where the cluster fills the machine's cores, its
# workers then lack: the good streams' p99 grows with the rate as well as with what requests hold.
FUZZ_CONCURRENCY = 4
# The fuzz comes in bursts; each quiet spell lasts as long as the burst before it, at least MIN_QUIET_S.
FUZZ_BURSTS = 5
MIN_QUIET_S = 2.0


@dataclass(frozen=True, slots=True)
class FuzzEnding:
    """How one fuzzed request ended (its body stays in the client process)."""

    kind: str
    valid: bool
    num_bytes: int
    result: StreamResult


@dataclass
class FuzzOutcome:
    """Every fuzzed request's ending, and whether the server process was still there after."""

    endings: list[FuzzEnding]
    server_alive: bool

    def bad(self) -> list[FuzzEnding]:
        return [e for e in self.endings if not e.valid]

    def odd(self) -> list[FuzzEnding]:
        return [e for e in self.endings if e.valid]

    def unclear(self) -> list[FuzzEnding]:
        """Bad requests that did not end with a clear refusal."""
        return [e for e in self.bad() if e.result.code not in CLEAR_REFUSALS]


async def send_raw(channel, data: bytes, timeout: float = FUZZ_TIMEOUT_S) -> StreamResult:
    """``Generate`` with ``data`` as the request body, unchecked (an identity serializer)."""
    method = channel.unary_stream(
        GENERATE_METHOD, request_serializer=None, response_deserializer=generate_pb2.GenerateResponse.FromString
    )
    return await read_stream(method(data, timeout=timeout))


async def good_lanes(stub, prompts: list[list[int]], max_tokens: int, *, min_rounds: int,
                     until: asyncio.Event | None = None) -> list[tuple[int, StreamResult]]:
    """Each prompt's stream run back to back, ``min_rounds`` times and then until ``until`` is set."""

    async def lane(index: int) -> list[tuple[int, StreamResult]]:
        done = []
        while len(done) < min_rounds or (until is not None and not until.is_set()):
            done.append((index, await one_stream(stub, prompts[index], max_tokens)))
        return done

    lanes = await asyncio.gather(*(lane(i) for i in range(len(prompts))))
    return [item for one in lanes for item in one]


async def run_fuzz(channel, requests: FuzzedRequests, num_requests: int) -> list[FuzzEnding]:
    """``num_requests`` cases, ``FUZZ_CONCURRENCY`` at a time, each drawn when its turn comes (memory stays small)."""
    endings: list[FuzzEnding] = []
    remaining = iter(range(num_requests))

    async def sender() -> None:
        for _ in remaining:
            case = requests.draw()
            endings.append(FuzzEnding(case.kind, case.valid, len(case.data), await send_raw(channel, case.data)))

    await asyncio.gather(*(sender() for _ in range(FUZZ_CONCURRENCY)))
    return endings


# The fuzz client process's cases, kept across its calls: the bursts continue one sequence.
_client_requests: FuzzedRequests | None = None


def fuzz_client(endpoint: Endpoint, args: tuple, num_requests: int) -> list[FuzzEnding]:
    """A client process's work: the next ``num_requests`` cases of ``FuzzedRequests(*args)``, sent to ``endpoint``."""
    global _client_requests
    if _client_requests is None or _client_requests.args != args:
        _client_requests = FuzzedRequests(*args)
    requests = _client_requests

    async def run() -> list[FuzzEnding]:
        async with endpoint.channel() as channel:
            return await run_fuzz(channel, requests, num_requests)

    return asyncio.run(run())


async def scenario_fuzz(target: str | Endpoint, requests: FuzzedRequests, good_prompts: list[list[int]],
                        max_tokens: int, num_requests: int, server_alive: Callable[[], bool],
                        name: str = "e. fuzz") -> tuple[list[Scenario], FuzzOutcome]:
    """The fault e rows (the fuzzed requests, the good streams beside them) and every fuzzed request's ending.

    The fuzz comes from a client process of its own, so that building and sending it does not
    delay this process reading the good streams.  Each good stream must get the tokens its
    prompt got before the fuzz, the last ones after the last burst.  ``target``: ``host:port``
    in plaintext, or an ``Endpoint`` (TLS, a bearer token) that every request goes to.  ``name``
    begins the rows' names and notes.
    """
    endpoint = Endpoint(target) if isinstance(target, str) else target
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as client:
        await loop.run_in_executor(client, int)  # the client process started before anything is timed
        async with endpoint.channel() as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            plain = await one_stream(stub, requests.plain, ODD_MAX_TOKENS)
            # Warm, so that every stream compared hits the prefix cache; its tokens are the ones to get.
            warm = await good_lanes(stub, good_prompts, max_tokens, min_rounds=1)
            if plain.code != "OK" or any(r.code != "OK" for _, r in warm):
                raise RuntimeError(f"{name}: the good requests failed before the fuzz")
            expected = {index: r.token_ids for index, r in warm}
            stop = asyncio.Event()
            lanes = asyncio.create_task(good_lanes(stub, good_prompts, max_tokens, min_rounds=1, until=stop))
            bursts: list[tuple[float, float]] = []
            endings: list[FuzzEnding] = []
            try:
                for burst in range(FUZZ_BURSTS):
                    await asyncio.sleep(max(MIN_QUIET_S, bursts[-1][1] - bursts[-1][0] if bursts else 0.0))
                    count = num_requests * (burst + 1) // FUZZ_BURSTS - num_requests * burst // FUZZ_BURSTS
                    start = time.monotonic()
                    endings += await loop.run_in_executor(client, fuzz_client, endpoint, requests.args, count)
                    bursts.append((start, time.monotonic()))
                await asyncio.sleep(max(MIN_QUIET_S, bursts[-1][1] - bursts[-1][0]))
            finally:
                stop.set()
            good = await lanes
            outcome = FuzzOutcome(endings, server_alive())
            blocks = await blocks_in_use(stub)
    beside = [r for _, r in good if r.overlaps(bursts) and r.code == "OK"]
    quiet = [r for _, r in good if not r.overlaps(bursts) and r.code == "OK"]
    bad, odd = outcome.bad(), outcome.odd()
    plain_result = StreamResult(token_ids=plain.token_ids)
    rows = [
        Scenario(f"{name}: bad requests", len(bad), None, 0, Counter(e.result.code for e in bad), blocks,
                 None, None, None),
        Scenario(f"{name}: odd, valid requests", len(odd),
                 sum(e.result.code == "OK" and e.result.token_ids == plain.token_ids for e in odd), 0,
                 Counter(e.result.code for e in odd), blocks, None, None, None,
                 divergences([(e.result, plain_result) for e in odd])),
        Scenario(f"{name}: good streams", len(good),
                 sum(r.code == "OK" and r.token_ids == expected[i] for i, r in good),
                 sum(len(set(r.replicas)) > 1 for _, r in good), Counter(r.code for _, r in good), blocks, None,
                 p99([r.seconds for r in beside]), p99([r.seconds for r in quiet]),
                 divergences([(r, StreamResult(token_ids=expected[i])) for i, r in good])),
    ]
    rows[0].requirements = [("every one refused with a clear code", not outcome.unclear()),
                            ("the server alive after", outcome.server_alive)]
    rows[1].requirements = [("every one served as its plain form", rows[1].correct == rows[1].sent)]
    rows[2].requirements = [("every one OK with its tokens", rows[2].correct == rows[2].sent),
                            ("0 blocks in use after idle", blocks == 0)]
    fuzz_s = sum(end - start for start, end in bursts)
    rows[0].notes = fuzz_notes(name, outcome, requests, fuzz_s, plain.token_ids)
    rows[0].notes.append(
        f"{name}: good streams: {len(beside)} overlapped a burst (p99), {len(quiet)} ran in the quiet spells "
        f"between (baseline p99); {len(good_prompts)} lanes of {max_tokens} tokens"
    )
    return rows, outcome


def fuzz_notes(name: str, outcome: FuzzOutcome, requests: FuzzedRequests, fuzz_s: float,
               plain_token_ids: list[int]) -> list[str]:
    bad = outcome.bad()
    clear = len(bad) - len(outcome.unclear())
    notes = [
        f"{name}: {len(outcome.endings)} fuzzed requests ({sum(e.num_bytes for e in outcome.endings) / 2**20:.0f} "
        f"MiB) in {FUZZ_BURSTS} bursts of {fuzz_s:.1f} s in all ({len(outcome.endings) / fuzz_s:.0f}/s) from a "
        f"client process of its own, {FUZZ_CONCURRENCY} at a time, {len(requests.bad)} kinds of bad and "
        f"{len(requests.odd)} of odd but valid; the server process {'is alive' if outcome.server_alive else 'is GONE'}"
        " after",
        f"{name}: bad requests refused with a clear code ({', '.join(sorted(CLEAR_REFUSALS))}): "
        f"{clear}/{len(bad)} ({100 * clear / max(1, len(bad)):.1f}%)",
    ]
    notes += [f"{name}: NOT REFUSED CLEARLY: {e.kind}: {e.result.code} {e.result.details[:200]!r}"
              for e in outcome.unclear()[:10]]
    notes += [f"{name}: ODD REQUEST NOT SERVED AS ITS PLAIN FORM: {e.kind}: {e.result.code} {e.result.details[:200]!r}"
              for e in outcome.odd() if e.result.code != "OK" or e.result.token_ids != plain_token_ids][:10]
    others = Counter((e.kind, e.result.code, e.result.details) for e in bad if e.result.code != "INVALID_ARGUMENT")
    notes += [f"{name}: {kind}: {code} x{n} ({details[:100]!r})" for (kind, code, details), n in sorted(others.items())]
    slowest = sorted(((statistics.mean(e.result.seconds for e in bad if e.kind == kind), kind)
                      for kind in {e.kind for e in bad}), reverse=True)[:3]
    notes.append(f"{name}: slowest refusals (mean): " + ", ".join(f"{kind} {s * 1000:.0f} ms" for s, kind in slowest))
    return notes
