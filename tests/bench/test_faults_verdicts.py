"""``bench.faults``' verdicts, on fakes (no cluster): the overload's rerun stays within the server's
limit at any stream length, a scenario that raises is a failed row, and the table tells a recovery
that timed out from one that does not apply."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import grpc

from kvserve.bench.fault_streams import Scenario, StreamResult, failed_scenario, table
from kvserve.bench.faults import batches, guarded, rerun_within_limit, scenario_overload


class LimitedServer:
    """A fake ``Generation`` stub that admits at most ``limit`` streams at a time, as the overload's server does.

    The first ``staggered`` calls arrive spread out (0.5 ms apart), so that short streams end while
    later ones arrive: more than ``limit`` are admitted in all.  Each stream's tokens follow from its prompt.
    """

    def __init__(self, limit: int, staggered: int = 0) -> None:
        self.limit, self.staggered = limit, staggered
        self.num_calls = self.in_flight = self.max_in_flight = 0

    def Generate(self, request, timeout: float):  # noqa: N802 - the gRPC method's name
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return FakeCall(self, list(request.token_ids.ids), request.sampling_params.max_tokens,
                        delay_s=0.0005 * index if index < self.staggered else 0.0)

    async def GetStats(self, request, timeout: float):  # noqa: N802
        return SimpleNamespace(replicas=[])


class FakeCall:
    def __init__(self, server: LimitedServer, prompt: list[int], max_tokens: int, delay_s: float) -> None:
        self.server, self.prompt, self.max_tokens, self.delay_s = server, prompt, max_tokens, delay_s

    def cancel(self) -> None:
        pass

    def __aiter__(self):
        return self.messages()

    async def messages(self):
        server = self.server
        await asyncio.sleep(self.delay_s)
        if server.in_flight >= server.limit:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "too many requests")
        server.in_flight += 1
        server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            for i in range(self.max_tokens):
                await asyncio.sleep(0.001)
                yield SimpleNamespace(token_ids=[(sum(self.prompt) + i) % 997], replica=0)
        finally:
            server.in_flight -= 1


def test_batches_keep_the_order_and_hold_at_most_the_size() -> None:
    assert batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert batches([], 3) == []


def test_the_rerun_never_has_more_than_the_limit_in_flight() -> None:
    server = LimitedServer(limit=4)

    async def run_one(prompt: list[int]) -> StreamResult:
        from kvserve.bench.fault_streams import one_stream

        return await one_stream(server, prompt, 3)

    results = asyncio.run(rerun_within_limit(run_one, [[i, i + 1] for i in range(10)], limit=4))
    assert [r.code for r in results] == ["OK"] * 10
    assert server.max_in_flight == 4


def test_a_refused_rerun_is_tried_again() -> None:
    tries: Counter = Counter()

    async def run_one(prompt: list[int]) -> StreamResult:
        tries[prompt[0]] += 1
        refused = prompt[0] == 1 and tries[1] == 1  # a slot freed a moment late, once
        return StreamResult(code="RESOURCE_EXHAUSTED" if refused else "OK")

    results = asyncio.run(rerun_within_limit(run_one, [[0], [1], [2]], limit=2))
    assert [r.code for r in results] == ["OK", "OK", "OK"]
    assert tries == Counter({0: 1, 1: 2, 2: 1})


def test_the_overload_passes_when_short_streams_let_more_than_the_limit_in() -> None:
    # The finding: at a small --max-tokens more than the limit get admitted over the burst, and
    # rerunning them all at once was refused.  Here 80 streams of 4 tokens against a limit of 8.
    prompts = [[3 + i, 7, 11 + i] for i in range(80)]
    server = LimitedServer(limit=8, staggered=len(prompts))
    scenario = asyncio.run(scenario_overload(server, prompts, max_tokens=4, limit=8))
    assert scenario.codes["OK"] > 8  # more admitted in all than the limit
    assert server.max_in_flight <= 8
    assert scenario.correct == scenario.codes["OK"]
    assert scenario.passed, scenario.verdict()


def test_a_scenario_that_raises_is_a_failed_row() -> None:
    async def breaks() -> Scenario:
        raise RuntimeError("the baseline run failed")

    (row,) = asyncio.run(guarded("b. kill the scheduler", breaks()))
    assert row.name == "b. kill the scheduler" and not row.passed
    assert row.verdict() == "FAIL: completes (RuntimeError: the baseline run failed)"


def cells(text: str, name: str) -> list[str]:
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()]
    (row,) = [row for row in rows if row[0] == name]
    return row


def test_a_recovery_that_timed_out_shows_as_one_and_fails_while_not_applicable_is_a_dash() -> None:
    timed_out = Scenario("a. kill a worker rank", 9, 9, 1, Counter({"OK": 9}), 0, None, 1.0, 1.0,
                         requirements=[("every replica serves again within 90 s", False)], recovery_timeout_s=90.0)
    not_applicable = Scenario("c. cancels and deadlines", 6, 2, 0, Counter({"OK": 2, "CANCELLED": 4}), 0, None,
                              1.0, 1.0, requirements=[("0 blocks in use after idle", True)])
    text = table([timed_out, not_applicable])
    assert cells(text, "a. kill a worker rank")[6] == "TIMED OUT (> 90)"
    assert cells(text, "a. kill a worker rank")[-1] == "FAIL: every replica serves again within 90 s"
    assert cells(text, "c. cancels and deadlines")[6] == "-"
    assert cells(text, "c. cancels and deadlines")[-1] == "pass"


def test_a_row_that_sent_nothing_is_not_exercised_and_does_not_pass() -> None:
    odd = Scenario("e. fuzz: odd, valid requests", 0, 0, 0, Counter(), 0, None, None, None,
                   requirements=[("every one served as its plain form", True)])
    assert not odd.passed
    assert cells(table([odd]), "e. fuzz: odd, valid requests")[-1] == "NOT EXERCISED (nothing sent)"
    assert failed_scenario("d. 10x overload", ValueError("x")).verdict() == "FAIL: completes (ValueError: x)"
