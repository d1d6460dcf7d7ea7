"""The OpenAI app of a real front end over a fake scheduler, in this process: one POST, its response."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvserve.cluster.frontend import Frontend
from kvserve.cluster.openai_api import create_app
from tests.cluster.test_frontend_streaming import MODEL_INFO


def post_to_app(scheduler, tokenizer, path: str, body: dict) -> httpx.Response:
    """``body`` POSTed to ``path`` (``model`` added) of an app whose front end runs on ``scheduler``."""

    async def run() -> httpx.Response:
        frontend = Frontend(scheduler, MODEL_INFO, tokenizer, max_concurrent_requests=8)
        frontend.start()
        app = create_app(frontend, max_body_bytes=1 << 20, max_choices=8)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
                return await client.post(
                    path, content=json.dumps({"model": "unused", **body}), headers={"content-type": "application/json"}
                )
        finally:
            await frontend.stop()

    return asyncio.run(run())
