"""How the OpenAI-compatible API reports a failed request: one error object, whether the request failed before
its first token (an error status) or mid-stream (the last event before ``[DONE]``).

The app runs in process over a real ``Frontend`` whose scheduler is the fake of test_frontend_streaming.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx

from kvserve.cluster.frontend import Frontend
from kvserve.cluster.messages import RequestDelta
from kvserve.cluster.openai_api import create_app
from tests.cluster.test_frontend_streaming import MODEL_INFO, FakeScheduler

INTERNALS = "replica 0 rank 1 failed at step 12: actor_id 0a538afe57c3"


class WordTokenizer:
    """Decodes each token id to a word of its own, so that every token makes text (a chunk)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" w{i}" for i in ids)


BODY = {"model": "unused", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True}


def post_completion(scenario: Callable[[FakeScheduler, str], Awaitable[None]]) -> httpx.Response:
    """POST ``BODY`` while ``scenario`` plays the scheduler's part for its request (given its id)."""

    async def run() -> httpx.Response:
        scheduler = FakeScheduler()
        frontend = Frontend(scheduler, MODEL_INFO, WordTokenizer(), max_concurrent_requests=8)
        frontend.start()
        app = create_app(frontend, max_body_bytes=1 << 20, max_choices=8)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
                posting = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
                while not scheduler.added:
                    await asyncio.sleep(0.005)
                await scenario(scheduler, scheduler.added[0][0])
                return await posting
        finally:
            await frontend.stop()

    return asyncio.run(run())


def expected_error(req_id: str) -> dict:
    return {
        "error": {
            "message": f"request {req_id}: its replica failed and no other could go on with it "
            "(details in the server log under this request id)",
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
    }


def test_a_request_failing_before_its_first_token_is_a_503_with_a_null_code() -> None:
    req_ids = []

    async def fail(scheduler: FakeScheduler, req_id: str) -> None:
        req_ids.append(req_id)
        scheduler.emit(RequestDelta(req_id, [], error=INTERNALS, replica=0))

    response = post_completion(fail)

    assert response.status_code == 503
    assert response.json() == expected_error(req_ids[0])


def test_a_stream_failing_mid_way_ends_with_the_same_error_object_then_done() -> None:
    req_ids = []

    async def fail_after_a_token(scheduler: FakeScheduler, req_id: str) -> None:
        req_ids.append(req_id)
        scheduler.emit(RequestDelta(req_id, [42], replica=0))
        await asyncio.sleep(0.05)
        scheduler.emit(RequestDelta(req_id, [], error=INTERNALS, replica=0))

    response = post_completion(fail_after_a_token)

    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert len(events) == 3
    assert json.loads(events[0])["choices"][0]["text"] == " w42"
    assert json.loads(events[1]) == expected_error(req_ids[0])
    assert events[2] == "[DONE]"
