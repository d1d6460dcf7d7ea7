"""The OpenAI-compatible HTTP API's messages, and their conversion to and from ``generate_pb2``.

The HTTP front door shares the gRPC one's pipeline (``Frontend.responses``):
a ``CompletionRequest`` becomes a ``GenerateRequest`` here, is validated and
served exactly as a gRPC call is, and each ``GenerateResponse`` becomes a
completion chunk.  This is the only module that knows both shapes.

``logprobs`` come back in OpenAI's shapes: the legacy one for completions
(``openai_text_completion``: ``{tokens, token_logprobs, top_logprobs,
text_offset}``; ``top_logprobs`` maps each alternative's text, and the sampled
token's, to its log-probability), and the chat one (``openai_chat``).  A token's
text is its own decoding, which for a token holding part of a UTF-8 character
is a replacement character; its bytes and text offset are ``openai_tokens``'.

``presence_penalty`` and ``frequency_penalty`` (each in [-2, 2]) and
``logit_bias`` (an object of token ids spelled as decimal strings, ``{"50256":
-100}``, to biases in [-100, 100]; at most 300) have OpenAI's semantics; a key
that is not a token id is a 400 naming ``logit_bias``.

Accepted beyond OpenAI's fields: kvserve's ``top_k``, ``ignore_eos``,
``cache_salt`` and ``stop_token_ids``, and vLLM's ``min_tokens`` (no stop
token, EOS or stop string ends the completion before that many tokens),
``repetition_penalty`` (> 0: the prompt's and the completion's tokens' positive
logits divided by it, negative ones multiplied) and ``min_p`` (in [0, 1]: only
tokens at least ``min_p`` times as probable as the likeliest are sampled).
``stop`` strings are matched on the detokenized text by the shared pipeline
and never sent.  ``echo: true`` (completions) puts the prompt, and with
``logprobs`` its tokens' logprobs, in front of each choice's (``openai_echo``);
vLLM's ``prompt_logprobs: k`` gives them in vLLM's shape (``openai_prompt_logprobs``).
OpenAI fields that kvserve does not implement yet are refused
with a 400 naming them unless they have their neutral value (``best_of`` 1,
``response_format`` text, no ``tools``, ...), so that a client never gets
silently different semantics;
unknown fields are refused too.  Types are strict, as OpenAI's are
(``"max_tokens": "5"`` or ``true`` is a 400), and an explicit ``null`` is
the default of any field that has one, as OpenAI's nullable fields are.

``n`` choices are ``n`` requests of the pipeline (``to_generate_requests``):
choice ``i`` samples with ``seed + i``, so each choice is reproducible and the
choices differ; the usage counts the prompt once and sums the completions.
A batch of prompts is refused, with ``n`` or without.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvserve.cluster.frontend import InvalidRequestError
from kvserve.cluster.openai_prompt_logprobs import PromptLogprobs
from kvserve.proto import generate_pb2

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}
# OpenAI's default, not kvserve's gRPC default (which is the same today).
DEFAULT_MAX_TOKENS = 16
# The most choices (``n``) one request may ask for; each is one of the server's concurrent requests.
MAX_CHOICES = 16
_MAX_SEED = 2**63 - 1  # the gRPC API's int64
_MAX_TOKEN_ID_DIGITS = 18  # every such id fits the gRPC API's int64


# Requests are validated strictly: OpenAI refuses "5" or true for an integer, and so does kvserve.
REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)


def one_of(what: str) -> WrapValidator:
    """A union type's refusal in one sentence (``prompt: must be ...``), not one per branch named by its type
    (``prompt.str: Input should be a valid string``)."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("one_of", "must be {what}", {"what": what}) from None

    return WrapValidator(validate)


Prompt = Annotated[
    str | list[int] | list[str] | list[list[int]],
    one_of("a string, a list of token ids (integers), or a list of those (a batch of prompts)"),
]
# One prompt of a request: its text, or its token ids.
OnePrompt = str | list[int]
Stop = Annotated[str | list[str], one_of("a string or a list of strings")]


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    # OpenAI's obfuscation of deltas and vLLM's usage in every chunk are not implemented: only their neutral
    # values pass (``SamplingRequest.unsupported_fields``).
    NEUTRAL_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {
        "include_obfuscation": (False,),
        "continuous_usage_stats": (False,),
    }

    include_usage: bool = False
    include_obfuscation: Any = None
    continuous_usage_stats: Any = None


class SamplingRequest(BaseModel):
    """The fields that completions and chat completions share; unknown fields are refused (a typo would
    otherwise change nothing).

    ``NEUTRAL_VALUES``: each field that kvserve accepts but does not implement, and the values that ask
    for nothing it lacks; any other value is refused (``unsupported_fields``).
    """

    model_config = REQUEST_CONFIG

    NEUTRAL_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (False,),
        "service_tier": ("auto", "default"),
        # vLLM's extras that clients written for it send, often at these defaults.
        "skip_special_tokens": (True,),
        "spaces_between_special_tokens": (True,),
        "include_stop_str_in_output": (False,),
        "use_beam_search": (False,),
        "length_penalty": (1,),
        "priority": (0,),
        "return_tokens_as_token_ids": (False,),
        "truncate_prompt_tokens": (),
        "bad_words": ([],),
        "allowed_token_ids": (),
        "guided_json": (),
        "guided_regex": (),
        "guided_choice": (),
        "guided_grammar": (),
        "structured_outputs": (),
    }

    # None (left out): the served model, as vLLM takes it; OpenAI's API requires it.
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    n: int = 1
    # Accepted, and without effect on the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Token ids as decimal strings (JSON's keys are strings) -> biases (``logit_bias_pairs``).
    logit_bias: dict[str, float] | None = None
    # Neutral values only, for now (``NEUTRAL_VALUES``).
    store: bool = False
    service_tier: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    priority: Any = None
    return_tokens_as_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # kvserve's extras.
    top_k: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # vLLM's
    repetition_penalty: float | None = None  # vLLM's
    min_p: float | None = None  # vLLM's

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit ``null`` for a field with a default is that default (OpenAI's nullable fields)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            name: value for name, value in data.items()
            if value is not None or name not in fields or fields[name].is_required()
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        """``logit_bias`` as ``(token id, bias)`` pairs; ``InvalidRequestError`` for a key that is not a token id.

        NOTE: only ASCII digits, where ``int`` would also take ``" 5"``, ``"+5"``, ``"1_0"`` or other scripts' digits.
        """
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(
                    f"logit_bias: keys must be token ids written as decimal strings (such as \"50256\"), got {key!r}"
                )
            if len(key) > _MAX_TOKEN_ID_DIGITS:  # no vocabulary is that large, and int() of a long one is slow
                raise InvalidRequestError(f"logit_bias: the key {key[:24]}... is too long for a token id")
            pairs.append((int(key), bias))
        return pairs

    def unsupported_fields(self) -> dict[str, str]:
        """Each field kvserve does not implement that this request sets to a value other than a neutral one,
        with what to do instead (``leave it out or send "auto"``); ``stream_options``' fields too."""
        refused = _unsupported(self, self.NEUTRAL_VALUES)
        if self.stream_options is not None:
            for name, instead in _unsupported(self.stream_options, StreamOptions.NEUTRAL_VALUES).items():
                refused[f"stream_options.{name}"] = instead
        return refused


def _unsupported(model: BaseModel, neutral_values: dict[str, tuple[Any, ...]]) -> dict[str, str]:
    refused = {}
    for name, neutral in neutral_values.items():
        value = getattr(model, name)
        if value is not None and not any(_same_json(value, allowed) for allowed in neutral):
            spelled = " or ".join(json.dumps(allowed) for allowed in neutral)
            refused[name] = f"leave it out or send {spelled}" if spelled else "leave it out"
    return refused


def _same_json(value: Any, neutral: Any) -> bool:
    """Whether ``value`` is ``neutral`` as JSON values compare (``false`` is not ``0``)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    NEUTRAL_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingRequest.NEUTRAL_VALUES,
        "best_of": (1,),
        "suffix": ("",),
    }

    prompt: Prompt
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @property
    def prompts(self) -> list[OnePrompt]:
        """The request's prompts: one, or each of a batch (a list of strings or of token-id lists), whose
        ``n`` choices each come in turn (choice ``k * n + i`` is prompt ``k``'s ``i``-th, as OpenAI numbers
        them).  An empty list is one prompt, refused as empty."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The legacy completions API's logprobs: per token its text, log-probability, alternatives and offset."""

    tokens: list[str]
    # null for an echoed prompt's first token (``openai_echo``): nothing predicts it.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's; left out unless the request asks, so that OpenAI's shape is unchanged.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda value: value is None)


class Completion(BaseModel):
    """A whole completion, and, with ``stream: true``, each of its chunks (same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


def error_body(message: str, *, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def request_limit(max_concurrent_requests: int, max_concurrent_requests_per_tenant: int | None = None) -> int:
    """The most requests (choices, of every prompt of a batch) one completion of a server with these limits
    of concurrent requests may be: more never could run at once."""
    return min(max_concurrent_requests, max_concurrent_requests_per_tenant or max_concurrent_requests)


def choice_limit(max_concurrent_requests: int, max_concurrent_requests_per_tenant: int | None = None) -> int:
    """The largest ``n`` a server with these limits of concurrent requests serves: a larger one never could."""
    return min(MAX_CHOICES, request_limit(max_concurrent_requests, max_concurrent_requests_per_tenant))


def check_batch_size(num_prompts: int, n: int, max_requests: int) -> None:
    """``InvalidRequestError`` for a batch of prompts whose choices are more requests than ``max_requests``."""
    if num_prompts > 1 and num_prompts * n > max_requests:
        raise InvalidRequestError(
            f"prompt: a batch of {num_prompts} prompts with n={n} is {num_prompts * n} requests; this server "
            f"runs at most {max_requests} at a time (send smaller batches)"
        )


def to_generate_requests(
    request: SamplingRequest,
    prompt: OnePrompt,
    max_tokens: int | None,
    logprobs: int | None = None,
    *,
    request_id: str,
    max_choices: int,
    prompt_logprobs: int | None = None,
) -> list[generate_pb2.GenerateRequest]:
    """``request`` as the gRPC API's requests, one per choice; ``InvalidRequestError`` for what kvserve
    cannot serve, ``n`` over ``max_choices`` included.

    Choice ``i``'s request id is ``{request_id}-{i}`` (``request_id`` itself when ``n`` is 1) and its
    seed, when the request has one, ``seed + i``.  ``logprobs``: how many alternatives per token the
    endpoint's own fields ask for (``None``: no logprobs); ``prompt_logprobs`` the same of the prompt's tokens.
    """
    n = request.n
    if not 1 <= n <= max_choices:
        message = f"n: must be an integer in [1, {max_choices}], got {n}"
        if max_choices < MAX_CHOICES:
            message += f" (each choice is a request, and this server runs {max_choices} at a time)"
        raise InvalidRequestError(message)
    generate = _to_generate_request(request, prompt, max_tokens, logprobs, prompt_logprobs)
    params = generate.sampling_params
    if params.HasField("seed") and params.seed > _MAX_SEED - (n - 1):
        raise InvalidRequestError(
            f"seed: choice i samples with seed + i, so with n={n} it must be at most {_MAX_SEED - (n - 1)}"
        )
    choices = []
    for index in range(n):
        choice = generate_pb2.GenerateRequest()
        choice.CopyFrom(generate)
        choice.request_id = request_id if n == 1 else f"{request_id}-{index}"
        if params.HasField("seed"):
            choice.sampling_params.seed = params.seed + index
        choices.append(choice)
    return choices


def _to_generate_request(
    request: SamplingRequest,
    prompt: OnePrompt,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> generate_pb2.GenerateRequest:
    for name, instead in request.unsupported_fields().items():
        raise InvalidRequestError(f"{name}: kvserve does not support this field yet; {instead}")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options: only allowed with stream: true")
    generate = generate_pb2.GenerateRequest()
    if isinstance(prompt, str):
        generate.text = prompt
    else:
        generate.token_ids.SetInParent()
        generate.token_ids.ids.extend(prompt)
    params = generate.sampling_params
    fields = {"max_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
              "top_k": request.top_k, "seed": request.seed, "logprobs": logprobs,
              "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
              "min_tokens": request.min_tokens, "prompt_logprobs": prompt_logprobs,
              "repetition_penalty": request.repetition_penalty, "min_p": request.min_p}
    for name, value in fields.items():
        if value is not None:
            try:
                setattr(params, name, value)
            except ValueError as exc:  # an integer past its protobuf field's range
                raise InvalidRequestError(f"{name}: {exc}") from None
    params.ignore_eos = request.ignore_eos
    params.stop.extend([request.stop] if isinstance(request.stop, str) else request.stop or ())
    try:
        params.stop_token_ids.extend(request.stop_token_ids or ())
    except ValueError as exc:
        raise InvalidRequestError(f"stop_token_ids: {exc}") from None
    for token_id, bias in request.logit_bias_pairs():
        params.logit_bias[token_id] = bias
    generate.cache_salt = request.cache_salt or ""
    return generate


def finish_reason(response: generate_pb2.GenerateResponse) -> str | None:
    return _FINISH_REASONS.get(response.finish_reason)


def to_usage(lasts: Sequence[generate_pb2.GenerateResponse], prompt_of: Sequence[int]) -> CompletionUsage:
    """The usage of one request's choices, from each one's last message; ``prompt_of``: the index of each
    choice's prompt (in a batch of prompts; all 0 for one).

    Each prompt is counted once, as OpenAI counts it, and the completions are summed; a prompt's cached
    tokens are the fewest any of its choices found cached, so that they never claim a saving that some
    choice did not make.
    """
    by_prompt: dict[int, list[generate_pb2.GenerateResponse]] = {}
    for last, prompt in zip(lasts, prompt_of, strict=True):
        by_prompt.setdefault(prompt, []).append(last)
    prompt_tokens = sum(choices[0].usage.prompt_tokens for choices in by_prompt.values())
    completion_tokens = sum(last.usage.completion_tokens for last in lasts)
    cached_tokens = sum(min(last.usage.cached_prompt_tokens for last in choices) for choices in by_prompt.values())
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One choice's whole completion: its text, finish reason and logprobs (in its endpoint's shape)."""

    text: str
    finish_reason: str | None
    logprobs: BaseModel | None = None
    prompt_logprobs: PromptLogprobs | None = None
