"""The front end's traffic with the scheduler actor and its pacing of stream messages.

A fake scheduler stands in for the actor (its methods return awaitables as
Ray's ``.remote`` does), so that every remote call can be counted.  The
end-to-end behaviour over real gRPC and Ray is in test_end_to_end.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from kvserve.cluster.failure_log import FailureLog
from kvserve.cluster.frontend import Frontend
from kvserve.cluster.messages import ModelInfo, OutputBatch, RequestDelta, RequestSpec
from kvserve.cluster.request_limits import RequestLimits
from kvserve.proto import generate_pb2

MODEL_INFO = ModelInfo(model_dir="unused", vocab_size=1000, max_model_len=256, eos_token_ids=(1,), num_replicas=1)


class _Remote:
    def __init__(self, fn: Callable[..., Awaitable]) -> None:
        self._fn = fn

    def remote(self, *args: object) -> asyncio.Future:
        return asyncio.ensure_future(self._fn(*args))


# The request ids the fake refuses start with this (a random id once began with "bad", which it refused).
REFUSED = "refused"


class FakeScheduler:
    """Records every remote call; ``emit`` queues outputs for the next ``poll_outputs``.

    As the actor does, aborting a request it knows emits its last delta (``finish_reason``
    "abort"), unless ``hold_aborts`` keeps those back until ``release_aborts``.
    """

    def __init__(self) -> None:
        self.added: list[list[str]] = []
        self.known: set[str] = set()
        self.hold_aborts = False
        self.held_aborts: list[RequestDelta] = []
        self.num_healthy_replicas: int | None = None
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
        # NOTE: a prefix no request id the front end makes (hexadecimal) can start with.
        self.known.update(spec.req_id for spec in specs if not spec.req_id.startswith(REFUSED))
        return [ValueError(f"request_id {s.req_id!r} is refused") if s.req_id.startswith(REFUSED) else 0 for s in specs]

    async def _abort_requests(self, req_ids: list[str]) -> None:
        self.aborted.extend(req_ids)
        aborts = [RequestDelta(req_id, [], finish_reason="abort", replica=0) for req_id in req_ids if req_id in self.known]
        self.known.difference_update(req_ids)
        if self.hold_aborts:
            self.held_aborts.extend(aborts)
        elif aborts:
            self.emit(*aborts)

    def release_aborts(self) -> None:
        aborts, self.held_aborts = self.held_aborts, []
        self.emit(*aborts)

    async def _poll_outputs(self, timeout_s: float) -> OutputBatch:
        self.num_polls += 1
        if not self._outputs:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        outputs, self._outputs = self._outputs, []
        return OutputBatch.from_deltas(outputs, num_healthy_replicas=self.num_healthy_replicas)

    def emit(self, *deltas: RequestDelta) -> None:
        self._outputs.extend(deltas)
        self.known.difference_update(d.req_id for d in deltas if d.is_last)  # ended: aborts ignore them
        self._ready.set()

    def set_healthy(self, num_replicas: int) -> None:
        """From the next poll on, ``num_replicas`` replicas are healthy."""
        self.num_healthy_replicas = num_replicas
        self._ready.set()


class Aborted(Exception):
    def __init__(self, code, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class FakeContext:
    async def abort(self, code, details: str) -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None  # a call without a deadline


def request(req_id: str) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=generate_pb2.SamplingParams(max_tokens=8),
        request_id=req_id,
    )


async def collect(frontend: Frontend, req_id: str) -> list[generate_pb2.GenerateResponse]:
    return [message async for message in frontend.Generate(request(req_id), FakeContext())]


def serve(scenario: Callable[[Frontend, FakeScheduler], Awaitable[None]], **options: object) -> None:
    async def run() -> None:
        scheduler = FakeScheduler()
        frontend = Frontend(scheduler, MODEL_INFO, None, max_concurrent_requests=64, **options)
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
        bad = asyncio.ensure_future(collect(frontend, REFUSED))
        with pytest.raises(Aborted, match=f"INVALID_ARGUMENT.*request_id '{REFUSED}' is refused"):
            await bad
        scheduler.emit(RequestDelta("good", [4, 5], finish_reason="length", replica=0))
        messages = await good
        assert [list(m.token_ids) for m in messages] == [[4, 5]]

    serve(scenario)


def test_a_call_reusing_the_id_of_one_just_cancelled_gets_only_its_own_outputs() -> None:
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        scheduler.hold_aborts = True  # the abort's last delta comes late
        first = asyncio.ensure_future(collect(frontend, "retry"))
        await asyncio.sleep(0.05)  # sent to the scheduler
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        again = asyncio.ensure_future(collect(frontend, "retry"))  # a client retrying with the same id
        await asyncio.sleep(0.05)
        # What the cancelled request still produced arrives after the retry started.
        scheduler.emit(RequestDelta("retry", [9, 9], replica=0))
        await asyncio.sleep(0.05)
        assert scheduler.added == [["retry"]]  # the retry waits for the cancelled request to drain
        scheduler.release_aborts()
        await asyncio.sleep(0.05)
        assert scheduler.added == [["retry"], ["retry"]]
        scheduler.emit(RequestDelta("retry", [4, 5], finish_reason="length", replica=0))
        messages = await again
        assert [list(m.token_ids) for m in messages] == [[4, 5]]
        assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert scheduler.aborted == ["retry"]  # once: its late outputs were not aborted again

    serve(scenario)


def test_a_call_whose_id_never_drains_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvserve.cluster.frontend.DRAIN_TIMEOUT_S", 0.1)

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        scheduler.hold_aborts = True
        first = asyncio.ensure_future(collect(frontend, "stuck"))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        with pytest.raises(Aborted, match="INVALID_ARGUMENT.*request_id 'stuck' is still being cancelled after 0.1 s"):
            await collect(frontend, "stuck")

    serve(scenario)


def test_a_call_that_ends_after_its_request_did_leaves_its_id_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvserve.cluster.frontend.DRAIN_TIMEOUT_S", 0.5)

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        call = frontend.Generate(request("done"), FakeContext())
        scheduler.emit(RequestDelta("done", [4], replica=0))
        await call.__anext__()  # the first tokens went out
        # Its last delta reaches the stream, and the call ends before it reads it.
        scheduler.emit(RequestDelta("done", [5], finish_reason="length", replica=0))
        await asyncio.sleep(0.05)
        await call.aclose()
        again = asyncio.ensure_future(collect(frontend, "done"))
        await asyncio.sleep(0.05)
        assert scheduler.added == [["done"], ["done"]]  # no drain to wait for
        scheduler.emit(RequestDelta("done", [5], finish_reason="length", replica=0))
        assert [list(m.token_ids) for m in await again] == [[5]]

    serve(scenario)


def test_a_second_call_with_the_id_of_one_in_flight_is_refused() -> None:
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        first = asyncio.ensure_future(collect(frontend, "same"))
        await asyncio.sleep(0.05)
        with pytest.raises(Aborted, match="ALREADY_EXISTS.*request_id 'same' is already in flight"):
            await collect(frontend, "same")
        scheduler.emit(RequestDelta("same", [4], finish_reason="length", replica=0))
        assert [list(m.token_ids) for m in await first] == [[4]]

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
        # Its id is free at once: nothing of it is in the scheduler to drain.
        again = asyncio.ensure_future(collect(frontend, "gone"))
        await asyncio.sleep(0.05)
        assert scheduler.added == [["first"], ["gone"]]
        first.cancel()
        again.cancel()
        await asyncio.gather(first, gone, again, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert scheduler.added == [["first"], ["gone"]]
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


def test_the_server_hears_when_no_replica_is_healthy_and_when_one_is_again(caplog) -> None:
    heard: list[bool] = []

    async def on_serving_changed(serving: bool) -> None:
        heard.append(serving)

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        for num_healthy in (2, 1, 0, 0, 1):
            scheduler.set_healthy(num_healthy)
            await asyncio.sleep(0.05)

    with caplog.at_level(logging.INFO, logger="kvserve.cluster.frontend"):
        serve(scenario, on_serving_changed=on_serving_changed)
    assert heard == [False, True]
    # The replica's failure has its one ERROR (the scheduler's); that it left none is a WARNING.
    said = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records if r.name == "kvserve.cluster.frontend"]
    assert said == [("WARNING", "no replica is healthy"), ("INFO", "a replica is healthy again")]


def test_a_long_text_is_tokenized_off_the_event_loop() -> None:
    from kvserve.worker.tiny_model import ensure_default_tiny_model
    from kvserve.worker.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ensure_default_tiny_model())

    class NoVocabulary:
        """The tokenizer without its vocabulary, so that no length bound refuses the text untokenized."""

        def __call__(self, text: str) -> dict:
            return tokenizer(text)

    text = "hello world " * 150_000  # 1.8 MB
    start = time.perf_counter()
    tokenizer(text)
    tokenize_s = time.perf_counter() - start
    gaps: list[float] = []

    async def scenario() -> None:
        # A prompt-bytes limit above the text's 1.8 MB (the default, 1 MiB, would refuse it untokenized).
        frontend = Frontend(
            FakeScheduler(), MODEL_INFO, NoVocabulary(), max_concurrent_requests=4,
            limits=RequestLimits(max_prompt_bytes=4 << 20),
        )

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        with pytest.raises(Aborted, match="INVALID_ARGUMENT: text: the prompt has"):
            async for _ in frontend.Generate(generate_pb2.GenerateRequest(text=text), FakeContext()):
                pass
        ticker.cancel()

    asyncio.run(scenario())
    # On the loop, one gap was the whole tokenization.
    assert max(gaps) < 0.3 * tokenize_s, (max(gaps), tokenize_s)


def test_a_failed_replicas_internals_go_to_the_log_and_the_client_gets_its_request_id(caplog) -> None:
    internals = "replica 1 rank 0 failed at step 68: actor_id 0a538afe57c3 pid 12673 ip 10.0.0.7"

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        call = asyncio.ensure_future(collect(frontend, "r-failed"))
        await asyncio.sleep(0.05)
        scheduler.emit(RequestDelta("r-failed", [], error=internals, replica=1))
        with pytest.raises(Aborted) as info:
            await call
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        message = str(info.value)
        assert "request r-failed" in message and "server log" in message
        assert "actor_id" not in message and "10.0.0.7" not in message and "pid" not in message

    with caplog.at_level("WARNING", logger="kvserve.cluster.frontend"):
        serve(scenario)
    assert any("r-failed" in record.getMessage() and internals in record.getMessage() for record in caplog.records)


def test_the_requests_of_a_failed_replica_are_one_warning_with_their_count_and_each_a_debug_line(caplog) -> None:
    internals = "replica 1 rank 0 failed at step 68: actor_id 0a538afe57c3"
    req_ids = [f"r{i}" for i in range(60)]

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        calls = [asyncio.ensure_future(collect(frontend, req_id)) for req_id in req_ids]
        await asyncio.sleep(0.05)
        scheduler.emit(*(RequestDelta(req_id, [], error=internals, replica=1) for req_id in req_ids))
        for req_id, outcome in zip(req_ids, await asyncio.gather(*calls, return_exceptions=True)):
            assert isinstance(outcome, Aborted) and outcome.code == grpc.StatusCode.UNAVAILABLE
            assert str(outcome).endswith(
                f"request {req_id}: its replica failed and no other could go on with it "
                "(details in the server log under this request id)"
            )

    with caplog.at_level("DEBUG", logger="kvserve.cluster.frontend"):
        serve(scenario)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    # Every id is in the one warning (up to FailureLog.NUM_EXAMPLE_IDS): the client was told to look for it.
    assert warnings == [f"60 requests ({', '.join(req_ids)}): its replica failed and no other could go on with it: {internals}"]
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG" and internals in r.getMessage()]
    assert sorted(debug) == sorted(f"request {req_id}: its replica failed and no other could go on with it: {internals}"
                                   for req_id in req_ids)


def test_a_burst_of_failures_is_logged_once_its_window_has_passed(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr("kvserve.cluster.frontend.FAILURE_LOG_WINDOW_S", 0.2)

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        for burst in ("a", "b"):
            calls = [asyncio.ensure_future(collect(frontend, f"{burst}{i}")) for i in range(2)]
            await asyncio.sleep(0.02)
            scheduler.emit(*(RequestDelta(f"{burst}{i}", [], error="rank 0 died", replica=0) for i in range(2)))
            await asyncio.gather(*calls, return_exceptions=True)
            await asyncio.sleep(0.3)  # past the burst's window: logged
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"2 requests ({burst}0, {burst}1): its replica failed and no other could go on with it: rank 0 died"
            for burst in ("a", "b")
        ]

    with caplog.at_level("WARNING", logger="kvserve.cluster.frontend"):
        serve(scenario)


def test_a_burst_of_failures_for_many_reasons_is_a_few_warning_lines(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(FailureLog, "NUM_EXAMPLE_IDS", 3)

    async def fail_for_six_reasons() -> None:
        failures = FailureLog(window_s=60.0)
        for i in range(6):
            for j in range(6 - i):
                failures.add(f"r{i}-{j}", "its replica failed", f"replica {i} died")
        failures.flush()

    with caplog.at_level("WARNING", logger="kvserve.cluster.frontend"):
        asyncio.run(fail_for_six_reasons())
    assert [r.getMessage() for r in caplog.records] == [
        "6 requests (r0-0, r0-1, r0-2 and 3 more (every id at DEBUG)): its replica failed: replica 0 died",
        "5 requests (r1-0, r1-1, r1-2 and 2 more (every id at DEBUG)): its replica failed: replica 1 died",
        "4 requests (r2-0, r2-1, r2-2 and 1 more (every id at DEBUG)): its replica failed: replica 2 died",
        "3 requests (r3-0, r3-1, r3-2): its replica failed: replica 3 died",
        "3 more requests failed for 2 other reasons (each at DEBUG)",
    ]


def test_one_tenant_cannot_take_more_than_its_share_of_concurrent_requests() -> None:
    # A tenant holding every slot of max_concurrent_requests made every other tenant's call fail.
    from kvserve.cluster.auth import Tenant
    from kvserve.cluster.frontend_errors import OverloadedError
    from kvserve.cluster.request_conversion import scheduled_request_id

    a, b = Tenant("team-a"), Tenant("team-b")

    async def drain(responses) -> None:
        async for _ in responses:
            pass

    def finish(scheduler: FakeScheduler, *ids: str) -> None:
        scheduler.emit(*(RequestDelta(req_id, [4], finish_reason="length", replica=0) for req_id in ids))

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        first = [asyncio.ensure_future(drain(frontend.responses(request(f"a{i}"), tenant=a))) for i in range(2)]
        await asyncio.sleep(0.05)  # both in flight
        with pytest.raises(OverloadedError, match="this tenant is at its limit of 2 concurrent requests"):
            await drain(frontend.responses(request("a2"), tenant=a))
        other = asyncio.ensure_future(drain(frontend.responses(request("b0"), tenant=b)))
        await asyncio.sleep(0.05)
        added = [req_id for batch in scheduler.added for req_id in batch]
        assert sorted(added) == sorted(scheduled_request_id(t, i) for t, i in ((a, "a0"), (a, "a1"), (b, "b0")))
        finish(scheduler, scheduled_request_id(a, "a0"), scheduled_request_id(a, "a1"))
        await asyncio.gather(*first)
        # team-a's ended streams free its slots: it is served again.
        again = asyncio.ensure_future(drain(frontend.responses(request("a3"), tenant=a)))
        await asyncio.sleep(0.05)
        finish(scheduler, scheduled_request_id(b, "b0"), scheduled_request_id(a, "a3"))
        await asyncio.gather(other, again)
        assert not frontend._tenant_streams  # nothing counted once every stream ended

    serve(scenario, max_concurrent_requests_per_tenant=2)


def test_a_request_no_replica_took_is_told_so_not_that_its_replica_failed() -> None:
    # It waited for a replica in a total outage (replica_wait_queue) and none came back in time.
    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        call = asyncio.ensure_future(collect(frontend, "waited"))
        await asyncio.sleep(0.05)
        scheduler.emit(RequestDelta("waited", [], error="none of the 1 replicas is available; it waited 30.0 s"))
        with pytest.raises(Aborted) as info:
            await call
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert str(info.value).endswith(
            "request waited: no replica can take it now (details in the server log under this request id)"
        )

    serve(scenario)


@pytest.mark.parametrize(("left_s", "code"), [(0.0, "504"), (0.02, "504"), (0.5, "499"), (None, "499")])
def test_a_call_closed_at_or_near_its_deadline_counts_as_expired_one_closed_earlier_as_left(
    left_s: float | None, code: str
) -> None:
    # A client's deadline starts before the server's (the call's transit, a busy server's reading it), so
    # the client's fires first: 19 of 40 concurrent expiries were counted 499 with 0-20 ms of the server's left.
    class ClosedWithTimeLeft(FakeContext):
        def time_remaining(self) -> float | None:
            return left_s

    async def scenario(frontend: Frontend, scheduler: FakeScheduler) -> None:
        messages = frontend.Generate(request("r"), ClosedWithTimeLeft())
        first = asyncio.ensure_future(anext(messages))
        await asyncio.sleep(0.05)
        scheduler.emit(RequestDelta("r", [3], replica=0))
        await first
        await messages.aclose()  # the call ends: cancelled by its client, or past its deadline
        counted = {labels["code"]: value for labels, value in requests_counted(frontend)}
        assert counted == {code: 1.0}

    serve(scenario)


def requests_counted(frontend: Frontend) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for metric in frontend.metrics.requests.collect() for sample in metric.samples
        if sample.name == "kvserve_requests_total"
    ]
