"""The ``n`` choices of one OpenAI request: ``n`` pipelines of the front end, read as one stream.

Each choice is one request of ``Frontend.responses``, with its own validation,
limits, stop strings and logprobs.  ``interleave`` gives their messages in the
order they come, each with its choice's index.  The choices live and die
together: an error in one, or the reader leaving (a client that disconnects),
closes every pipeline, which aborts the requests not yet finished and frees
their blocks, as it does for a single request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from kvserve.proto import generate_pb2

# A choice's index and its next message; an exception that ended it, or None once it is over.
_Item = tuple[int, generate_pb2.GenerateResponse | Exception | None]


async def interleave(
    pipelines: Sequence[AsyncIterator[generate_pb2.GenerateResponse]],
) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
    """The messages of ``pipelines`` (one per choice, in index order) as they come, with their choice's index.

    The first error of any pipeline is raised here and ends every other one; closing this before the
    end (``contextlib.aclosing``) ends them all too.
    """
    if len(pipelines) == 1:
        # NOTE: one choice, nearly every request: read it directly, with no task and no queue.
        async with aclosing(pipelines[0]) as responses:
            async for response in responses:
                yield 0, response
        return
    # NOTE: bounded, so a client that reads slowly slows the pipelines as it slows a single one.
    queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=len(pipelines))
    pumps = [asyncio.create_task(_pump(index, pipeline, queue)) for index, pipeline in enumerate(pipelines)]
    try:
        num_running = len(pumps)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        # NOTE: cancelled, not awaited: this may run while the reader is being cancelled (a client that
        # left). Each cancelled pump closes its own pipeline, which aborts its request.
        for pump in pumps:
            pump.cancel()


async def _pump(
    index: int, pipeline: AsyncIterator[generate_pb2.GenerateResponse], queue: asyncio.Queue[_Item]
) -> None:
    """Move ``pipeline``'s messages into ``queue``, then its end: None, or the exception that ended it."""
    try:
        async with aclosing(pipeline):
            async for response in pipeline:
                await queue.put((index, response))
    except Exception as exc:  # noqa: BLE001 - raised again by the reader, whatever it is
        await queue.put((index, exc))
        return
    await queue.put((index, None))
