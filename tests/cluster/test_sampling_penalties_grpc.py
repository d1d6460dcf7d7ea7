"""Penalties (OpenAI's and vLLM's ``repetition_penalty``), ``logit_bias`` and ``min_tokens`` through the gRPC front door and the Python client: what a
``SamplingParams`` message becomes, what is refused (naming the field), and what the client's keywords send.

No server runs: the front end's conversion (``RequestConversion``) and the client's (``to_generate_request``)
are called directly, as ``Frontend.responses`` and ``Client.stream`` call them.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.cluster.client_messages import KEYWORDS, to_generate_request
from kvserve.cluster.frontend_errors import InvalidRequestError
from kvserve.cluster.messages import ModelInfo
from kvserve.cluster.request_conversion import RequestConversion
from kvserve.cluster.request_limits import RequestLimits
from kvserve.proto import generate_pb2
from kvserve.scheduler.sampling_params import SamplingParams

VOCAB_SIZE = 1000
MODEL_INFO = ModelInfo(model_dir="unused", vocab_size=VOCAB_SIZE, max_model_len=64, eos_token_ids=(1,), num_replicas=1)


@pytest.fixture(scope="module")
def conversion() -> RequestConversion:
    return RequestConversion(MODEL_INFO, None, RequestLimits())


def sampling_params(conversion: RequestConversion, **fields) -> SamplingParams:
    return conversion.to_sampling_params(generate_pb2.SamplingParams(**fields))


# -- the server's conversion ------------------------------------------------------------


def test_the_new_fields_arrive_exactly(conversion):
    params = sampling_params(
        conversion, max_tokens=8, presence_penalty=0.5, frequency_penalty=-1.25, logit_bias={7: -100.0, 3: 2.5},
        min_tokens=4, repetition_penalty=1.15,
    )

    assert params == SamplingParams(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=-1.25, logit_bias=((3, 2.5), (7, -100.0)), min_tokens=4,
        repetition_penalty=1.15,
    )


def test_unset_new_fields_change_no_logit(conversion):
    params = sampling_params(conversion)

    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias, params.min_tokens) == (0, 0, (), 0)
    assert params.repetition_penalty == 1.0
    assert not params.adjusts_logits


@pytest.mark.parametrize("penalty", [1e-6, 0.5, 1.0, 2.5, 1e6])
def test_any_finite_repetition_penalty_above_0_is_taken_as_vllm_takes_it(conversion, penalty):
    assert sampling_params(conversion, repetition_penalty=penalty).repetition_penalty == penalty


def test_a_whole_request_carries_them_to_its_spec(conversion):
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5, 6]),
        sampling_params=generate_pb2.SamplingParams(
            max_tokens=4, presence_penalty=2, logit_bias={999: 1}, min_tokens=4
        ),
    )

    params = conversion.to_request_spec(request).sampling_params

    assert (params.presence_penalty, params.logit_bias, params.min_tokens) == (2.0, ((999, 1.0),), 4)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"presence_penalty": 2.5}, "sampling_params.presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -2.01}, "sampling_params.frequency_penalty must be in [-2, 2], got -2.01"),
        ({"presence_penalty": float("nan")}, "sampling_params.presence_penalty must be in [-2, 2], got nan"),
        ({"logit_bias": {5: 100.5}}, "sampling_params.logit_bias[5] must be in [-100, 100], got 100.5"),
        ({"logit_bias": {VOCAB_SIZE: 1}},
         f"sampling_params.logit_bias: token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})"),
        ({"logit_bias": {-1: 1}}, "sampling_params.logit_bias token ids must be non-negative, got -1"),
        ({"logit_bias": {i: 1 for i in range(301)}},
         "sampling_params.logit_bias may name at most 300 tokens, got 301"),
        ({"max_tokens": 8, "min_tokens": 9}, "sampling_params.min_tokens must be in [0, max_tokens=8], got 9"),
        ({"min_tokens": 17}, "sampling_params.min_tokens must be in [0, max_tokens=16], got 17"),
        ({"min_tokens": -1}, "sampling_params.min_tokens must be in [0, max_tokens=16], got -1"),
        ({"repetition_penalty": 0}, "sampling_params.repetition_penalty must be finite and > 0, got 0.0"),
        ({"repetition_penalty": -1.5}, "sampling_params.repetition_penalty must be finite and > 0, got -1.5"),
        ({"repetition_penalty": float("inf")}, "sampling_params.repetition_penalty must be finite and > 0, got inf"),
        ({"repetition_penalty": float("nan")}, "sampling_params.repetition_penalty must be finite and > 0, got nan"),
    ],
)
def test_a_value_out_of_its_range_is_refused_naming_the_field(conversion, fields, message):
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(conversion, **fields)

    assert str(info.value) == message


def test_the_bounds_themselves_are_accepted(conversion):
    params = sampling_params(
        conversion, presence_penalty=-2, frequency_penalty=2, logit_bias={0: -100, VOCAB_SIZE - 1: 100},
        max_tokens=5, min_tokens=5,
    )

    assert params.logit_bias == ((0, -100.0), (VOCAB_SIZE - 1, 100.0))
    assert params.min_tokens == params.max_tokens == 5


# -- the client's keywords ----------------------------------------------------------------


def test_the_client_sends_each_keyword_in_its_field():
    request = to_generate_request(
        "hi", {"presence_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {5: -100, 2: 1.5}, "min_tokens": 3,
               "repetition_penalty": 1.25}
    )

    params = request.sampling_params
    assert (params.presence_penalty, params.frequency_penalty, params.min_tokens) == (0.5, -1.0, 3)
    assert params.repetition_penalty == 1.25
    assert dict(params.logit_bias) == {5: -100.0, 2: 1.5}


@pytest.mark.parametrize(
    "logit_bias", [{5: -100, 2: 1.5}, [(5, -100), (2, 1.5)], ((np.int64(5), np.float32(-100)), [2, 1.5])]
)
def test_the_client_takes_logit_bias_as_a_mapping_or_as_pairs(logit_bias):
    request = to_generate_request("hi", {"logit_bias": logit_bias})

    assert dict(request.sampling_params.logit_bias) == {5: -100.0, 2: 1.5}


def test_without_the_keywords_the_fields_stay_unset():
    params = to_generate_request("hi", {"max_tokens": 4}).sampling_params

    assert not any(params.HasField(name) for name in ("presence_penalty", "frequency_penalty", "min_tokens",
                                                      "repetition_penalty"))
    assert not params.logit_bias


def test_what_the_client_sends_is_what_the_server_samples_with(conversion):
    kwargs = {"max_tokens": 8, "presence_penalty": 1.5, "frequency_penalty": 0.25, "logit_bias": [(9, -3.5)],
              "min_tokens": 8, "repetition_penalty": 0.8}

    request = to_generate_request([5, 6], kwargs)

    assert conversion.to_request_spec(request).sampling_params == SamplingParams(
        max_tokens=8, presence_penalty=1.5, frequency_penalty=0.25, logit_bias=((9, -3.5),), min_tokens=8,
        repetition_penalty=0.8,
    )


def test_the_new_keywords_are_known_and_a_typo_is_told_the_likeliest():
    assert {"presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "repetition_penalty"} <= KEYWORDS
    with pytest.raises(TypeError, match="'min_token' \\(did you mean 'min_tokens'\\?\\)"):
        to_generate_request("hi", {"min_token": 3})


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"logit_bias": {"50256": -100}}, TypeError, "logit_bias: token ids must be ints, got '50256'"),
        ({"logit_bias": {True: 1}}, TypeError, "logit_bias: token ids must be ints, got True"),
        ({"logit_bias": {5: "high"}}, TypeError, "logit_bias[5] must be a number, got 'high'"),
        ({"logit_bias": {5: False}}, TypeError, "logit_bias[5] must be a number, got False"),
        ({"logit_bias": [(5, 1), (5, 2)]}, ValueError, "logit_bias names token 5 twice"),
        ({"logit_bias": 5}, TypeError, "logit_bias must be {token_id: bias} or (token_id, bias) pairs, got 5"),
        ({"logit_bias": [(1, 2, 3)]}, TypeError, "logit_bias must be {token_id: bias} or (token_id, bias) pairs"),
        ({"logit_bias": "5=1"}, TypeError, "logit_bias must be {token_id: bias} or (token_id, bias) pairs"),
        ({"logit_bias": {2**70: 1}}, ValueError, "logit_bias: "),
        ({"presence_penalty": True}, TypeError, "presence_penalty must be a number, got True"),
        ({"frequency_penalty": "high"}, TypeError, "frequency_penalty: "),
        ({"repetition_penalty": True}, TypeError, "repetition_penalty must be a number, got True"),
        ({"repetition_penalty": "1.2"}, TypeError, "repetition_penalty: "),
        ({"min_tokens": 2.5}, TypeError, "min_tokens: "),
        ({"min_tokens": 2**40}, ValueError, "min_tokens: "),
    ],
)
def test_a_keyword_of_the_wrong_type_fails_before_anything_is_sent(kwargs, error, message):
    with pytest.raises(error) as info:
        to_generate_request("hi", kwargs)

    assert str(info.value).startswith(message)
