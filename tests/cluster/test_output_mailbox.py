"""The scheduler actor's outputs reach the newest poll, and only it."""

from __future__ import annotations

import asyncio
import time

from kvserve.cluster.output_mailbox import OutputMailbox
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams


def test_a_poll_takes_every_pending_output_once() -> None:
    async def scenario() -> None:
        mailbox = OutputMailbox()
        mailbox.entry("a", 0).token_ids.append(5)
        mailbox.entry("a", 0).token_ids.append(6)
        mailbox.entry("b", 1).finish(Request("b", [1, 2, 3], SamplingParams(max_tokens=2)), reason="stop")
        taken = await mailbox.take(1.0)
        assert taken is not None
        assert {req_id: entry.token_ids for req_id, entry in taken.items()} == {"a": [5, 6], "b": []}
        assert taken["b"].to_delta("b").finish_reason == "stop"
        assert taken["b"].to_delta("b").replica == 1
        start = time.monotonic()
        assert await mailbox.take(0.05) == {}  # nothing new: an empty answer after the timeout
        assert time.monotonic() - start >= 0.04

    asyncio.run(scenario())


def test_a_poll_superseded_while_it_waits_leaves_the_outputs_to_the_newer_one() -> None:
    """A front end that stopped (or died) mid-poll left its poll waiting: it must not take
    the next outputs, which belong to the front end polling now."""

    async def scenario() -> None:
        mailbox = OutputMailbox()
        stale = asyncio.create_task(mailbox.take(5.0))
        await asyncio.sleep(0.01)
        current = asyncio.create_task(mailbox.take(5.0))
        await asyncio.sleep(0.01)
        mailbox.entry("a", 0).token_ids.append(7)
        mailbox.notify()
        assert await stale is None
        taken = await current
        assert taken is not None and taken["a"].token_ids == [7]

    asyncio.run(scenario())


def test_outputs_count_as_unfetched_only_while_no_poll_waits() -> None:
    async def scenario() -> None:
        mailbox = OutputMailbox()
        assert mailbox.unfetched_s() == 0.0  # nothing pending
        waiting = asyncio.create_task(mailbox.take(0.2))
        await asyncio.sleep(0.01)
        mailbox.entry("a", 0).token_ids.append(1)
        assert mailbox.unfetched_s() == 0.0  # a poll waits for them
        await waiting
        mailbox.entry("b", 0).token_ids.append(2)
        await asyncio.sleep(0.05)
        assert mailbox.unfetched_s() >= 0.04

    asyncio.run(scenario())
