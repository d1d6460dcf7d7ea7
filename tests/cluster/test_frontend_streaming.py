"""The front end's traffic with the scheduler actor and its pacing of stream messages.

A fake scheduler stands in for the actor (its methods return awaitables as
Ray's ``.remote`` does), so that every remote call can be counted.  The
end-to-end behaviour over real gRPC and Ray is in test_end_to_end.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvserve.cluster.frontend import Frontend
from kvserve.cluster.messages import ModelInfo, OutputBatch, RequestDelta, RequestSpec
from kvserve.proto import generate_pb2

MODEL_INFO = ModelInfo(model_dir="unused", vocab_size=1000, max_model_len=256, eos_token_ids=(1,), num_replicas=1)


class _Remote:
    def __init__(self, fn: Callable[..., Awaitable]) -> None:
        self._fn = fn

    def remote(self, *args: object) -> asyncio.Future:
        return asyncio.ensure_future(self._fn(*args))


class FakeScheduler:
    """Records every remote call; ``emit`` queues outputs for the next ``poll_outputs``."""

    def __init__(self) -> None:
        self.added: list[list[str]] = []
        self.aborted: list[str] = []
        self.num_polls = 0
        self._outputs: list[RequestDelta] = []
        self._ready = asyncio.Event()
        self.add_requests = _Remote(self._add_requests)
        self.poll_outputs = _Remote(self._poll_outputs)
        self.abort_requests = _Remote(self._abort_requests)

    async def _add_requests(self, specs: list[RequestSpec]) -> list[int | Exception]:
        await asyncio.sleep(0.01)  # a remote call takes a while: others queue behind it
        self.added.append([spec.req_id for spec in specs])
        return [ValueError(f"request_id {s.req_id!r} is refused") if s.req_id.startswith("bad") else 0 for s in specs]

    async def _abort_requests(self, req_ids: list[str]) -> None:
        self.aborted.extend(req_ids)

    async def _poll_outputs(self, timeout_s: float) -> OutputBatch:
        self.num_polls += 1
        if not self._outputs:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        outputs, self._outputs = self._outputs, []
        return OutputBatch.from_deltas(outputs)

    def emit(self, *deltas: RequestDelta) -> None:
        self._outputs.extend(deltas)
        self._ready.set()


class Aborted(Exception):
    def __init__(self, code, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class FakeContext:
    async def abort(self, code, details: str) -> None:
        raise Aborted(code, details)


def request(req_id: str) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=generate_pb2.SamplingParams(max_tokens=8),
        request_id=req_id,
    )


async def collect(frontend: Frontend, req_id: str) -> list[generate_pb2.GenerateResponse]:
    return [message async for message in frontend.Generate(request(req_id), FakeContext())]


def serve(scenario: Callable[[Frontend, FakeScheduler], Awaitable[None]], **pacing: object) -> None:
    async def run() -> None:
        scheduler = FakeScheduler()
        frontend = Frontend(scheduler, MODEL_INFO, None, max_concurrent_requests=64, **pacing)
        frontend.start()
        try:
            await scenario(frontend, scheduler)
        finally:
            await frontend.stop()

    asyncio.run(run())


def test_requests_that_arrive_while_a_call_is_in_flight_reach_the_scheduler_in_the_next_one() -> None:
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        first = asyncio.ensure_future(collect(frontend, "first"))
        await asyncio.sleep(0)  # "first" is in flight to the scheduler
        others = [asyncio.ensure_future(collect(frontend, f"r{i}")) for i in range(20)]
        await asyncio.sleep(0.1)
        assert scheduler.added == [["first"], [f"r{i}" for i in range(20)]]
        scheduler.emit(*(RequestDelta(f"r{i}", [4], finish_reason="length", replica=0) for i in range(20)))
        scheduler.emit(RequestDelta("first", [4], finish_reason="length", replica=0))
        await asyncio.gather(first, *others)

    serve(scenario)


def test_a_request_refused_by_the_scheduler_is_invalid_argument_and_the_others_go_on() -> None:
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        good = asyncio.ensure_future(collect(frontend, "good"))
        bad = asyncio.ensure_future(collect(frontend, "bad"))
        with pytest.raises(Aborted, match="INVALID_ARGUMENT.*request_id 'bad' is refused"):
            await bad
        scheduler.emit(RequestDelta("good", [4, 5], finish_reason="length", replica=0))
        messages = await good
        assert [list(m.token_ids) for m in messages] == [[4, 5]]

    serve(scenario)


def test_a_request_cancelled_before_it_was_sent_never_reaches_the_scheduler() -> None:
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        first = asyncio.ensure_future(collect(frontend, "first"))
        await asyncio.sleep(0)  # "first" is in flight to the scheduler
        gone = asyncio.ensure_future(collect(frontend, "gone"))
        await asyncio.sleep(0)  # "gone" waits for the next call
        gone.cancel()
        await asyncio.sleep(0.05)
        assert scheduler.added == [["first"]]
        first.cancel()
        await asyncio.gather(first, gone, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert scheduler.added == [["first"]]
        assert "first" in scheduler.aborted

    serve(scenario)


def test_outputs_are_fetched_without_pause_while_a_stream_awaits_its_first_tokens() -> None:
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        stream = asyncio.ensure_future(collect(frontend, "r"))
        await asyncio.sleep(0.05)
        for step in range(5):
            scheduler.emit(RequestDelta("other", [step], replica=0))
            await asyncio.sleep(0.01)
        # Five fetches in 50 ms: no pause of the 1 s interval while "r" has no token.
        assert scheduler.num_polls >= 5
        scheduler.emit(RequestDelta("r", [9], finish_reason="length", replica=0))
        await stream

    serve(scenario, stream_interval_s=1.0)


def test_with_every_stream_served_outputs_are_fetched_once_per_interval() -> None:
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        stream = asyncio.ensure_future(collect(frontend, "r"))
        await asyncio.sleep(0.05)
        scheduler.emit(RequestDelta("r", [3], replica=0))
        await asyncio.sleep(0.05)
        polls = scheduler.num_polls
        for step in range(5):
            scheduler.emit(RequestDelta("r", [step], replica=0))
            await asyncio.sleep(0.02)
        assert scheduler.num_polls - polls <= 1
        scheduler.emit(RequestDelta("r", [9], finish_reason="length", replica=0))
        messages = await stream
        assert [t for m in messages for t in m.token_ids] == [3, 0, 1, 2, 3, 4, 9]

    serve(scenario, stream_interval_s=0.5)
