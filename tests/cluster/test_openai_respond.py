"""A streamed completion whose client leaves between events: closed at once, not at its next event."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.cluster.openai_errors import COMPLETION_FIELDS
from kvserve.cluster.openai_respond import ChoicePrompt, _stream, _until_the_client_leaves, _wait_for_disconnect


class LeavingClient:
    """What a streaming response reads of its request: nothing until the client leaves (uvicorn's
    receive once the body is read)."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict] = asyncio.Queue()

    async def receive(self) -> dict:
        return await self.messages.get()

    def leave(self) -> None:
        self.messages.put_nowait({"type": "http.disconnect"})


def test_a_stream_the_client_leaves_between_events_is_closed_at_once() -> None:
    # Its requests kept their place until its next event: a stream queued behind others was
    # computed up to its first token after its client had gone.
    closed_at: list[float] = []

    async def events():  # noqa: ANN202
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(60)  # a request waiting for a slot, or a long prefill
            yield "data: 2\n\n"
        finally:
            closed_at.append(time.monotonic())  # closing the pipelines aborts the requests

    async def scenario() -> float:
        client = LeavingClient()
        stream = _until_the_client_leaves(events(), asyncio.ensure_future(_wait_for_disconnect(client)))
        assert await anext(stream) == "data: 1\n\n"
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        client.leave()
        left_at = time.monotonic()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, 5)
        await asyncio.sleep(0.1)  # the events close in a task of their own
        return left_at

    left_at = asyncio.run(scenario())
    assert len(closed_at) == 1 and closed_at[0] - left_at < 1.0


def test_a_stream_the_client_stays_for_ends_with_its_last_event() -> None:
    async def events():  # noqa: ANN202
        for i in range(3):
            await asyncio.sleep(0.01)
            yield f"data: {i}\n\n"

    async def scenario() -> list[str]:
        watching = asyncio.ensure_future(_wait_for_disconnect(LeavingClient()))
        return [event async for event in _until_the_client_leaves(events(), watching)]

    assert asyncio.run(scenario()) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]


def test_a_client_that_leaves_before_its_streams_first_message_gets_its_requests_aborted() -> None:
    # A request queued behind others sends nothing before its first token: nothing noticed the client leave.
    closed: list[bool] = []

    async def choices():  # noqa: ANN202
        try:
            await asyncio.sleep(60)  # queued: no message yet
            yield 0, None
        finally:
            closed.append(True)

    async def scenario():  # noqa: ANN202
        client = LeavingClient()
        answer = asyncio.ensure_future(
            _stream("cmpl-1", choices(), [None], None, False, COMPLETION_FIELDS, [ChoicePrompt()], client)
        )
        await asyncio.sleep(0.05)
        client.leave()
        response = await asyncio.wait_for(answer, 5)
        await asyncio.sleep(0.1)  # the choices close in the task that waited for their first message
        return response

    response = asyncio.run(scenario())
    assert response.status_code == 499
    assert closed == [True]
