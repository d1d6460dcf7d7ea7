"""RequestAdder: requests sent to the scheduler in batches, and their aborts sent after their add.

The scheduler is an async Ray actor, which may run an abort sent later before an add still in
flight, and ignores an abort of an id it does not know yet: the request would then run to its
end (the flake of test_a_choice_refused_for_the_limit_of_concurrent_requests_aborts_the_others).
Here a stand-in for the actor handle answers each ``add_requests`` call when the test says so.
"""

from __future__ import annotations

import asyncio

from kvserve import SamplingParams
from kvserve.cluster.messages import RequestSpec
from kvserve.cluster.request_adder import RequestAdder


class ScriptedScheduler:
    """``add_requests.remote(specs)`` returns a future the test resolves; the calls are kept in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], asyncio.Future]] = []
        self.add_requests = self

    def remote(self, specs: list[RequestSpec]) -> asyncio.Future:
        answer = asyncio.get_running_loop().create_future()
        self.calls.append(([spec.req_id for spec in specs], answer))
        return answer


def spec(req_id: str) -> RequestSpec:
    return RequestSpec(req_id, [1, 2, 3], SamplingParams())


def run(scenario) -> None:  # noqa: ANN001
    asyncio.run(asyncio.wait_for(scenario(), timeout=5))


def test_an_abort_asked_while_the_add_is_in_flight_is_sent_after_the_answer() -> None:
    async def scenario() -> None:
        scheduler, aborted, events = ScriptedScheduler(), [], []
        adder = RequestAdder(scheduler, abort=lambda ids: (aborted.append(list(ids)), events.append("abort")),
                             on_refused_after_leaving=lambda req_id: None)
        adds = [asyncio.create_task(adder.add(spec(r))) for r in ("a", "b")]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        (req_ids, answer), = scheduler.calls
        assert req_ids == ["a", "b"]
        adder.abort(["a", "never-sent"])
        assert aborted == [["never-sent"]]  # what is not in flight goes at once
        events.append("answered")
        answer.set_result([0, 1])
        assert await asyncio.gather(*adds) == [0, 1]
        assert aborted == [["never-sent"], ["a"]] and events == ["abort", "answered", "abort"]
        adder.abort(["b"])  # answered by now: at once
        assert aborted[-1] == ["b"]
        await adder.stop()

    run(scenario)


def test_a_request_the_scheduler_refused_is_not_aborted() -> None:
    async def scenario() -> None:
        scheduler, aborted, refused_after_leaving = ScriptedScheduler(), [], []
        adder = RequestAdder(scheduler, abort=aborted.append, on_refused_after_leaving=refused_after_leaving.append)
        add = asyncio.create_task(adder.add(spec("a")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        add.cancel()  # its caller leaves while the call is in flight, and aborts it
        adder.abort(["a"])
        (_, answer), = scheduler.calls
        answer.set_result([ValueError("no room")])
        await asyncio.sleep(0)
        assert aborted == [] and refused_after_leaving == ["a"]
        await adder.stop()

    run(scenario)


def test_aborts_asked_for_a_call_that_never_answers_are_sent_when_the_adder_stops() -> None:
    async def scenario() -> None:
        scheduler, aborted = ScriptedScheduler(), []
        adder = RequestAdder(scheduler, abort=aborted.append, on_refused_after_leaving=lambda req_id: None)
        add = asyncio.create_task(adder.add(spec("a")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        adder.abort(["a"])
        assert aborted == []
        await adder.stop()
        assert aborted == [["a"]]
        add.cancel()

    run(scenario)
