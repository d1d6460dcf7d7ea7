"""The front end <-> scheduler actor dataclasses survive Ray's pickling unchanged."""

from __future__ import annotations

import dataclasses
import pickle

import ray.cloudpickle

from kvserve.cluster.messages import OutputBatch, RequestDelta
from kvserve.scheduler.logprobs import TokenLogprobs

LOGPROBS = [TokenLogprobs(-0.5, (4, 9), (-0.5, -1.5)), TokenLogprobs(-2.0)]


def test_a_delta_with_every_field_set_round_trips_through_pickle():
    delta = RequestDelta(
        "r1", [4, 5], finish_reason="stop", error="boom", num_prompt_tokens=7, num_cached_tokens=6,
        num_output_tokens=2, replica=3, logprobs=LOGPROBS,
    )
    # RequestDelta pickles through a hand-written __reduce__: it must name every field.
    assert len(delta.__reduce__()[1]) == len(dataclasses.fields(RequestDelta))
    assert pickle.loads(pickle.dumps(delta)) == delta
    assert pickle.loads(ray.cloudpickle.dumps(delta)) == delta


def test_an_output_batch_holds_each_request_once_and_yields_its_deltas():
    running = RequestDelta("a", [1, 2], replica=0)
    ended = RequestDelta("b", [3], finish_reason="stop", num_prompt_tokens=4, num_output_tokens=9, replica=1)
    failed = RequestDelta("c", error="replica 1 failed", replica=1)
    batch = OutputBatch.from_deltas([running, ended, failed])
    assert (batch.req_ids, batch.token_ids, batch.replicas) == (["a"], [[1, 2]], [0])
    assert batch.last_deltas == [ended, failed]
    assert len(batch) == 3
    assert list(batch) == [running, ended, failed]
    assert list(OutputBatch()) == [] and len(OutputBatch()) == 0


def test_an_output_batch_round_trips_through_rays_pickling():
    batch = OutputBatch.from_deltas(
        [RequestDelta(f"r{i}", [i, i + 1], replica=i % 2) for i in range(5)]
        + [RequestDelta("done", [7], finish_reason="length", num_output_tokens=3)]
    )
    assert pickle.loads(ray.cloudpickle.dumps(batch)) == batch


def test_an_output_batch_keeps_the_logprobs_of_the_requests_that_asked():
    asking = RequestDelta("a", [1, 2], replica=0, logprobs=LOGPROBS)
    plain = RequestDelta("b", [3], replica=0)
    ended = RequestDelta("c", [4], finish_reason="stop", logprobs=LOGPROBS[:1])
    batch = OutputBatch.from_deltas([asking, plain, ended])
    assert batch.logprobs == {"a": LOGPROBS}
    assert list(pickle.loads(ray.cloudpickle.dumps(batch))) == [asking, plain, ended]
