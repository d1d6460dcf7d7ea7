"""The front end's protobuf <-> dataclass conversion, on the tiny model's real tokenizer.

Over-the-wire status codes for every bad input are tested end to end in
test_end_to_end.py; these tests pin down what a valid request becomes and
what a delta turns into.
"""

from __future__ import annotations

import logging
import time

import pytest

from kvserve.cluster.auth import Tenant, tenant_cache_salt
from kvserve.cluster.frontend import Frontend, InvalidRequestError
from kvserve.cluster.messages import ModelInfo, RequestDelta
from kvserve.cluster.request_limits import RequestLimits
from kvserve.cluster.detokenizer import IncrementalDetokenizer
from kvserve.proto import generate_pb2
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.worker.tokenizer import load_tokenizer

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.worker.tiny_model import ensure_default_tiny_model

    return load_tokenizer(ensure_default_tiny_model())


@pytest.fixture(scope="module")
def frontend(tokenizer) -> Frontend:
    info = ModelInfo(
        model_dir="unused", vocab_size=1000, max_model_len=MAX_MODEL_LEN, eos_token_ids=(1,), num_replicas=1
    )
    # The scheduler is never called by the conversion methods.
    return Frontend(None, info, tokenizer, max_concurrent_requests=1)


def test_a_text_prompt_is_tokenized_as_the_in_process_engine_does(frontend, tokenizer):
    spec = frontend.to_request_spec(generate_pb2.GenerateRequest(text="héllo wörld"))
    assert spec.prompt_token_ids == tokenizer("héllo wörld")["input_ids"]
    assert spec.prompt_token_ids[0] == tokenizer.bos_token_id


def test_unset_sampling_fields_take_the_documented_defaults(frontend):
    spec = frontend.to_request_spec(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6])))
    assert spec.sampling_params == SamplingParams()
    assert spec.sampling_params.max_tokens == 16
    assert spec.cache_salt is None


def test_the_caller_s_tenant_travels_with_the_request_to_the_scheduler(frontend):
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6]), request_id="r1")

    spec = frontend.to_request_spec(request, Tenant("alice"))

    assert (spec.tenant, spec.req_id) == ("alice", "alice r1")
    assert spec.cache_salt == tenant_cache_salt(Tenant("alice"), None)
    assert frontend.to_request_spec(request).tenant is None  # no auth token file: no tenant


def test_every_sampling_field_is_carried_over(frontend):
    params = generate_pb2.SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=-9, stop_token_ids=[4, 2], ignore_eos=True
    )
    spec = frontend.to_request_spec(
        generate_pb2.GenerateRequest(text="x", sampling_params=params, request_id="r1", cache_salt="tenant")
    )
    assert spec.req_id == "r1"
    assert spec.cache_salt == "tenant"
    assert spec.sampling_params == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=-9, stop_token_ids=(4, 2), ignore_eos=True
    )


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_minus_one_and_zero_disable_top_k(frontend, top_k):
    request = generate_pb2.GenerateRequest(text="x", sampling_params=generate_pb2.SamplingParams(top_k=top_k))
    assert frontend.to_request_spec(request).sampling_params.top_k is None


def test_requests_without_an_id_get_distinct_ids(frontend):
    request = generate_pb2.GenerateRequest(text="x")
    ids = {frontend.to_request_spec(request).req_id for _ in range(100)}
    assert len(ids) == 100
    assert all(ids)


def test_a_prompt_that_fills_max_model_len_with_its_tokens_is_accepted(frontend):
    params = generate_pb2.SamplingParams(max_tokens=4)
    ids = generate_pb2.TokenIds(ids=[5] * (MAX_MODEL_LEN - 4))
    spec = frontend.to_request_spec(generate_pb2.GenerateRequest(token_ids=ids, sampling_params=params))
    assert len(spec.prompt_token_ids) + spec.sampling_params.max_tokens == MAX_MODEL_LEN


def test_one_token_past_max_model_len_names_max_tokens(frontend):
    params = generate_pb2.SamplingParams(max_tokens=5)
    ids = generate_pb2.TokenIds(ids=[5] * (MAX_MODEL_LEN - 4))
    with pytest.raises(InvalidRequestError, match=r"^sampling_params\.max_tokens"):
        frontend.to_request_spec(generate_pb2.GenerateRequest(token_ids=ids, sampling_params=params))


def test_a_text_prompt_without_a_tokenizer_is_refused():
    info = ModelInfo(model_dir="unused", vocab_size=10, max_model_len=8, eos_token_ids=(), num_replicas=1)
    frontend = Frontend(None, info, None, max_concurrent_requests=1)
    with pytest.raises(InvalidRequestError, match="token_ids"):
        frontend.to_request_spec(generate_pb2.GenerateRequest(text="x"))


def test_a_middle_delta_carries_tokens_and_text_only(frontend, tokenizer):
    token_ids = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    delta = RequestDelta("r", token_ids=token_ids, replica=1)
    response = frontend.to_response("r", delta, IncrementalDetokenizer(tokenizer))
    assert list(response.token_ids) == token_ids
    assert response.text == "the cat"
    assert response.replica == 1
    assert response.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    assert not response.HasField("usage")


@pytest.mark.parametrize(
    "reason, proto_reason",
    [
        ("stop", generate_pb2.FINISH_REASON_STOP),
        ("length", generate_pb2.FINISH_REASON_LENGTH),
        ("abort", generate_pb2.FINISH_REASON_ABORT),
    ],
)
def test_the_last_delta_carries_finish_reason_and_usage(frontend, tokenizer, reason, proto_reason):
    delta = RequestDelta(
        "r", [1], finish_reason=reason, num_prompt_tokens=9, num_cached_tokens=8, num_output_tokens=3, replica=0
    )
    response = frontend.to_response("r", delta, IncrementalDetokenizer(tokenizer))
    assert response.finish_reason == proto_reason
    assert (response.usage.prompt_tokens, response.usage.cached_prompt_tokens, response.usage.completion_tokens) == (
        9,
        8,
        3,
    )


def test_the_last_delta_flushes_text_held_back(frontend, tokenizer):
    first, *rest = tokenizer("日", add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert frontend.to_response("r", RequestDelta("r", token_ids=[first]), detokenizer).text == ""
    last = RequestDelta("r", token_ids=rest, finish_reason="length")
    assert frontend.to_response("r", last, detokenizer).text == "日"


def test_text_far_too_long_to_fit_is_refused_without_tokenizing_it(frontend):
    # 64 tokens of at most 22 bytes each (the tiny vocabulary's longest) cannot hold 1 MB.
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="text: 999996 characters are far more than max_model_len 64 tokens can hold"):
        frontend.to_request_spec(generate_pb2.GenerateRequest(text="hello world " * 83_333))
    assert time.perf_counter() - start < 0.5  # tokenizing it takes a second
    # Over the operator's byte limit, that limit is named.
    with pytest.raises(InvalidRequestError, match=r"text: 4000008 bytes, over the limit of \d+ \(max_prompt_bytes\)"):
        frontend.to_request_spec(generate_pb2.GenerateRequest(text="hello world " * 333_334))
    # Under the bound, the tokens decide.
    with pytest.raises(InvalidRequestError, match="text: the prompt has 1802 tokens; max_model_len is 64"):
        frontend.to_request_spec(generate_pb2.GenerateRequest(text="hello " * 600))


def test_a_prompt_past_the_tokenizers_own_limit_logs_no_warning():
    # The tokenizer warned "Token indices sequence length is longer than the
    # specified maximum sequence length" on the server's log: the served
    # max_model_len is what limits a prompt, and the front end checks it.
    from kvserve.worker.tiny_model import ensure_default_tiny_model

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        ids = load_tokenizer(ensure_default_tiny_model())("hello " * 800)["input_ids"]  # a fresh tokenizer
    finally:
        transformers_logger.removeHandler(handler)
    assert len(ids) == 2402  # past the tiny model's 2048
    assert not [r for r in records if "sequence length" in r.getMessage()]


def test_a_prompt_too_long_for_the_default_max_tokens_says_it_is_the_default(frontend):
    ids = generate_pb2.TokenIds(ids=[5] * (MAX_MODEL_LEN - 10))
    with pytest.raises(InvalidRequestError, match="max_tokens 16 \\(the default\\) exceed max_model_len 64"):
        frontend.to_request_spec(generate_pb2.GenerateRequest(token_ids=ids))
    with pytest.raises(InvalidRequestError, match="max_tokens 20 exceed"):
        frontend.to_request_spec(
            generate_pb2.GenerateRequest(token_ids=ids, sampling_params=generate_pb2.SamplingParams(max_tokens=20))
        )


@pytest.mark.parametrize(
    ("limits", "fields", "message"),
    [
        (RequestLimits(max_prompt_tokens=4), dict(token_ids=generate_pb2.TokenIds(ids=[5] * 5)),
         r"token_ids: 5 prompt tokens, over the limit of 4 \(max_prompt_tokens\)"),
        (RequestLimits(max_prompt_tokens=2), dict(text="hello world, hello world"),
         r"text: \d+ prompt tokens, over the limit of 2 \(max_prompt_tokens\)"),
        (RequestLimits(max_prompt_bytes=8), dict(text="héllo wörld"),
         r"text: 13 bytes, over the limit of 8 \(max_prompt_bytes\)"),
        (RequestLimits(max_stop_token_ids=2), dict(
            token_ids=generate_pb2.TokenIds(ids=[5]),
            sampling_params=generate_pb2.SamplingParams(stop_token_ids=[1, 2, 3])),
         r"sampling_params.stop_token_ids: 3 ids, over the limit of 2 \(max_stop_token_ids\)"),
        (RequestLimits(max_cache_salt_bytes=3), dict(token_ids=generate_pb2.TokenIds(ids=[5]), cache_salt="salt"),
         r"cache_salt: 4 bytes, over the limit of 3 \(max_cache_salt_bytes\)"),
    ],
)
def test_each_request_limit_is_refused_naming_it(tokenizer, limits, fields, message):
    info = ModelInfo(model_dir="unused", vocab_size=1000, max_model_len=MAX_MODEL_LEN, eos_token_ids=(1,), num_replicas=1)
    limited = Frontend(None, info, tokenizer, max_concurrent_requests=1, limits=limits)
    with pytest.raises(InvalidRequestError, match=message):
        limited.to_request_spec(generate_pb2.GenerateRequest(**fields))


def test_limits_below_one_are_refused():
    with pytest.raises(ValueError, match="max_prompt_bytes must be a positive integer"):
        RequestLimits(max_prompt_bytes=0)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_a_simulated_server_refuses_logprobs_it_cannot_compute(field):
    info = ModelInfo(model_dir="unused", vocab_size=1000, max_model_len=64, eos_token_ids=(), num_replicas=1,
                     simulated=True)
    frontend = Frontend(None, info, None, max_concurrent_requests=1)
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5, 6]), sampling_params=generate_pb2.SamplingParams(**{field: 1})
    )
    with pytest.raises(InvalidRequestError, match=f"^sampling_params.{field}: this server's replicas are simulated"):
        frontend.to_request_spec(request)
    plain = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6]))
    assert frontend.to_request_spec(plain).sampling_params == SamplingParams()
