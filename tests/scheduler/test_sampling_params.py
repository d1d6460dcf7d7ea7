"""SamplingParams and configs reject bad values with a message naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.sampling_params import SamplingParams


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16 and params.top_k is None and not params.is_greedy
    assert params.logprobs is None


@pytest.mark.parametrize("logprobs", [0, 1, 20])
def test_logprobs_from_0_to_20_are_accepted(logprobs: int) -> None:
    assert SamplingParams(logprobs=logprobs).logprobs == logprobs


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        # Any object was truthy or not, and float() read strings: all three were accepted.
        ({"ignore_eos": "no"}, "ignore_eos must be True or False"),
        ({"temperature": "0.5"}, "temperature must be a number"),
        ({"top_p": True}, "top_p must be a number"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a sequence of token ids, got 5"),  # a TypeError
        ({"stop_token_ids": (1, True)}, "stop_token_ids must be an integer, got True"),
        # A dict's keys and a string's characters were taken as the ids.
        ({"stop_token_ids": {3: "x"}}, "stop_token_ids must be a sequence of token ids, got {3: 'x'}"),
        ({"stop_token_ids": "34"}, "stop_token_ids must be a sequence of token ids, got '34'"),
        ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\], got -1"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
        ({"logprobs": True}, "logprobs must be an integer, got True"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": math.nan}, "frequency_penalty must be in"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a number"),
        ({"logit_bias": {5: 100.5}}, r"logit_bias\[5\] must be in \[-100, 100\], got 100.5"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be non-negative, got -1"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias token id must be an integer, got '5'"),
        ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias names token 1 twice"),
        ({"logit_bias": [(1, 1.0, 3)]}, "logit_bias must map token ids to biases"),
        ({"logit_bias": "ab"}, "logit_bias must map token ids to biases"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias may name at most 300 tokens, got 301"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, max_tokens=16\], got -1"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be finite and > 0, got 0.0"),
        ({"repetition_penalty": -1.2}, r"repetition_penalty must be finite and > 0, got -1.2"),
        ({"repetition_penalty": math.inf}, r"repetition_penalty must be finite and > 0, got inf"),
        ({"repetition_penalty": math.nan}, r"repetition_penalty must be finite and > 0, got nan"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty must be a number, got '1.2'"),
        ({"repetition_penalty": True}, "repetition_penalty must be a number, got True"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\], got -0.1"),
        ({"min_p": 1.0000001}, r"min_p must be in \[0, 1\], got 1.0000001"),
        ({"min_p": math.inf}, r"min_p must be in \[0, 1\], got inf"),
        ({"min_p": math.nan}, r"min_p must be in \[0, 1\], got nan"),
        ({"min_p": True}, "min_p must be a number, got True"),
        ({"min_p": "0.1"}, "min_p must be a number, got '0.1'"),
        ({"min_p": None}, "min_p must be a number, got None"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be in \[0, max_tokens=4\], got 5"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "largest"),
    [
        ({"seed": 2**64}, "9223372036854775807;"),  # sampled as seed 0 did
        ({"seed": 2**63}, "9223372036854775807;"),
        ({"seed": -(2**63) - 1}, "9223372036854775807;"),
        ({"seed": 2**63 - 2, "n": 3}, "9223372036854775807 - (n - 1) = 9223372036854775805: completion i samples"),
    ],
)
def test_a_seed_past_64_bits_is_refused_not_wrapped(kwargs: dict, largest: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert f"seed must be a 64-bit signed integer, from -9223372036854775808 to {largest}" in str(info.value)


@pytest.mark.parametrize(("seed", "n"), [(2**63 - 1, 1), (-(2**63), 1), (2**63 - 3, 3), (0, 16)])
def test_every_64_bit_seed_is_taken(seed: int, n: int) -> None:
    assert SamplingParams(seed=seed, n=n).seed == seed


def test_logit_bias_is_kept_as_pairs_sorted_by_token_id() -> None:
    from_mapping = SamplingParams(logit_bias={9: -1, 2: 0.5})
    assert from_mapping.logit_bias == ((2, 0.5), (9, -1.0))
    assert SamplingParams(logit_bias=[(9, -1.0), (2, 0.5)]) == from_mapping  # and compare (and hash) as such
    assert hash(from_mapping) == hash(SamplingParams(logit_bias=from_mapping.logit_bias))


def test_which_params_adjust_the_logits() -> None:
    assert not SamplingParams().adjusts_logits
    assert SamplingParams(frequency_penalty=0.1).has_penalties
    assert SamplingParams(logit_bias={1: 1.0}).adjusts_logits and not SamplingParams(logit_bias={1: 1.0}).has_penalties
    assert SamplingParams(min_tokens=1).adjusts_logits
    assert not SamplingParams(frequency_penalty=0.1).penalizes_prompt
    repeated = SamplingParams(repetition_penalty=1.1)
    assert repeated.has_penalties and repeated.penalizes_prompt and repeated.adjusts_logits
    assert not SamplingParams(repetition_penalty=1).adjusts_logits  # 1 is none


def test_any_finite_positive_repetition_penalty_is_taken_as_a_float() -> None:
    # vLLM's bounds: > 0, no upper one (below 1 rewards repeats).
    for penalty in (1e-9, 0.5, 1, 2.5, 1e9):
        params = SamplingParams(repetition_penalty=penalty)
        assert params.repetition_penalty == penalty and type(params.repetition_penalty) is float


def test_any_min_p_from_0_to_1_is_taken_as_a_float() -> None:
    import numpy as np

    for min_p in (0, 0.0, 1e-300, 0.05, 0.5, 1, np.float32(0.25)):
        params = SamplingParams(min_p=min_p)
        assert params.min_p == min_p and type(params.min_p) is float
    assert SamplingParams().min_p == 0.0  # none
    assert not SamplingParams(min_p=0.5).adjusts_logits  # a filter on the probabilities, as top_p is


@pytest.mark.parametrize("top_k", [-1, 0])
def test_disabled_top_k_spellings_normalise_to_none(top_k: int) -> None:
    assert SamplingParams(top_k=top_k).top_k is None


def test_zero_temperature_is_greedy_and_params_are_frozen() -> None:
    params = SamplingParams(temperature=0, stop_token_ids=[3, 4])
    assert params.is_greedy and params.stop_token_ids == (3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(num_blocks=1), "num_blocks"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(max_num_seqs=-1), "max_num_seqs"),
        (lambda: SchedulerConfig(max_model_len=0), "max_model_len"),
        (
            lambda: SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False),
            "max_num_batched_tokens",
        ),
        (lambda: SchedulerConfig(long_prefill_token_threshold=0), "long_prefill_token_threshold"),
        (
            lambda: SchedulerConfig(
                max_num_batched_tokens=4096, enable_chunked_prefill=False, long_prefill_token_threshold=8
            ),
            "long_prefill_token_threshold",
        ),
    ],
)
def test_bad_configs_name_the_field(factory, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        factory()


def test_derived_config_is_validated_too() -> None:
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(CacheConfig(), block_size=-4)


def test_numpy_integers_are_integers() -> None:
    # Refused before ("max_tokens must be an integer, got np.int64(3)"), while prompts took them.
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(3), top_k=np.int32(5), seed=np.int64(1),
                            stop_token_ids=np.array([1, 2]))
    assert (params.max_tokens, params.top_k, params.seed, params.stop_token_ids) == (3, 5, 1, (1, 2))
    assert all(type(v) is int for v in (params.max_tokens, params.top_k, params.seed, *params.stop_token_ids))
