"""The front end <-> scheduler actor dataclasses survive Ray's pickling unchanged."""

from __future__ import annotations

import dataclasses
import pickle

import ray.cloudpickle

from kvserve.cluster.messages import RequestDelta


def test_a_delta_with_every_field_set_round_trips_through_pickle():
    delta = RequestDelta(
        "r1", [4, 5], finish_reason="stop", error="boom", num_prompt_tokens=7, num_cached_tokens=6,
        num_output_tokens=2, replica=3,
    )
    # RequestDelta pickles through a hand-written __reduce__: it must name every field.
    assert len(delta.__reduce__()[1]) == len(dataclasses.fields(RequestDelta))
    assert pickle.loads(pickle.dumps(delta)) == delta
    assert pickle.loads(ray.cloudpickle.dumps(delta)) == delta
