"""The pacing of one stream's messages: first tokens and the end at once, the rest once per interval."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.cluster.messages import RequestDelta
from kvserve.cluster.output_stream import OutputStream, StreamPacing
from kvserve.scheduler.logprobs import TokenLogprobs

INTERVAL_S = 0.2


async def next_message_within(stream: OutputStream, timeout_s: float) -> RequestDelta | None:
    """The next message if it comes within ``timeout_s``, else ``None`` (the wait is cancelled)."""
    try:
        return await asyncio.wait_for(stream.next_message(), timeout_s)
    except asyncio.TimeoutError:
        return None


def test_the_first_tokens_go_out_at_once() -> None:
    async def scenario() -> None:
        stream = OutputStream("r", StreamPacing(INTERVAL_S, None))
        waiting = asyncio.ensure_future(stream.next_message())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        stream.add([5, 6], replica=1)
        message = await asyncio.wait_for(waiting, 0.05)
        assert (message.token_ids, message.replica, message.is_last) == ([5, 6], 1, False)

    asyncio.run(scenario())


def test_tokens_within_the_interval_wait_for_its_end_and_travel_together() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        stream = OutputStream("r", StreamPacing(INTERVAL_S, None))
        stream.add([1], replica=0)
        await stream.next_message()
        sent = loop.time()
        for token in (2, 3, 4):
            stream.add([token], replica=0)
        assert await next_message_within(stream, INTERVAL_S / 2) is None
        message = await stream.next_message()
        assert message.token_ids == [2, 3, 4]
        assert loop.time() - sent >= INTERVAL_S * 0.95

    asyncio.run(scenario())


def test_after_a_quiet_interval_the_next_tokens_go_out_at_once() -> None:
    async def scenario() -> None:
        stream = OutputStream("r", StreamPacing(INTERVAL_S, None))
        stream.add([1], replica=0)
        await stream.next_message()
        await asyncio.sleep(INTERVAL_S * 1.1)
        stream.add([2], replica=0)
        message = await next_message_within(stream, 0.05)
        assert message is not None and message.token_ids == [2]

    asyncio.run(scenario())


@pytest.mark.parametrize("ends", ["while awaited", "before awaited"])
def test_the_end_goes_out_at_once_with_the_tokens_held_back(ends: str) -> None:
    async def scenario() -> None:
        stream = OutputStream("r", StreamPacing(INTERVAL_S, None))
        stream.add([1], replica=2)
        await stream.next_message()
        stream.add([2, 3], replica=2)
        end = RequestDelta("r", [4], finish_reason="length", num_prompt_tokens=7, num_output_tokens=4, replica=2)
        if ends == "before awaited":
            stream.end(end)
        waiting = asyncio.ensure_future(stream.next_message())
        await asyncio.sleep(0.01)
        if ends == "while awaited":
            stream.end(end)
        last = await asyncio.wait_for(waiting, 0.05)
        assert last.token_ids == [2, 3, 4]
        assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens, last.replica) == ("length", 7, 4, 2)
        assert last.is_last

    asyncio.run(scenario())


def test_logprobs_travel_with_their_tokens_into_the_last_message() -> None:
    first, second, third = TokenLogprobs(-0.1), TokenLogprobs(-0.2, (5,), (-0.2,)), TokenLogprobs(-0.3)

    async def scenario() -> None:
        stream = OutputStream("r", StreamPacing(INTERVAL_S, None))
        stream.add([1], replica=0, logprobs=[first])
        assert (await stream.next_message()).logprobs == [first]
        stream.add([2], replica=0, logprobs=[second])
        stream.end(RequestDelta("r", [3], finish_reason="length", logprobs=[third]))
        last = await asyncio.wait_for(stream.next_message(), 0.05)
        assert (last.token_ids, last.logprobs) == ([2, 3], [second, third])

    asyncio.run(scenario())


def test_a_request_that_did_not_ask_gets_no_logprobs() -> None:
    async def scenario() -> None:
        stream = OutputStream("r", StreamPacing(0.0, None))
        stream.add([1, 2], replica=0)
        assert (await stream.next_message()).logprobs is None
        stream.add([3], replica=0)
        stream.end(RequestDelta("r", [4], finish_reason="length"))
        assert (await stream.next_message()).logprobs is None

    asyncio.run(scenario())


def test_an_error_ends_the_stream_at_once() -> None:
    async def scenario() -> None:
        stream = OutputStream("r", StreamPacing(INTERVAL_S, None))
        waiting = asyncio.ensure_future(stream.next_message())
        await asyncio.sleep(0.01)
        stream.end(RequestDelta("r", error="replica 0 failed"))
        message = await asyncio.wait_for(waiting, 0.05)
        assert message.error == "replica 0 failed" and message.is_last

    asyncio.run(scenario())


def test_an_interval_of_zero_sends_each_batch_of_tokens_at_once() -> None:
    async def scenario() -> None:
        stream = OutputStream("r", StreamPacing(0.0, None))
        for batch in ([1], [2, 3], [4]):
            stream.add(batch, replica=0)
            message = await next_message_within(stream, 0.05)
            assert message is not None and message.token_ids == batch

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "num_streams, interval_s", [(1, 0.02), (40, 0.02), (100, 0.05), (256, 0.128)]
)
def test_the_interval_grows_with_the_streams_to_keep_within_the_message_budget(num_streams, interval_s) -> None:
    pacing = StreamPacing(0.02, max_messages_per_s=2000)
    pacing.set_num_streams(num_streams)
    assert pacing.interval_s == pytest.approx(interval_s)


def test_without_a_budget_the_interval_is_the_minimum() -> None:
    pacing = StreamPacing(0.02, max_messages_per_s=None)
    pacing.set_num_streams(10_000)
    assert pacing.interval_s == 0.02
