"""The OpenAI-compatible HTTP API's messages, and their conversion to and from ``generate_pb2``.

The HTTP front door shares the gRPC one's pipeline (``Frontend.responses``):
a ``CompletionRequest`` becomes a ``GenerateRequest`` here, is validated and
served exactly as a gRPC call is, and each ``GenerateResponse`` becomes a
completion chunk.  This is the only module that knows both shapes.

Accepted beyond OpenAI's fields: kvserve's ``top_k``, ``ignore_eos``,
``cache_salt`` and ``stop_token_ids``.  ``stop`` strings are matched on the
detokenized text by the shared pipeline and never sent.  OpenAI fields that kvserve does not
implement yet are refused with a 400 naming them unless they have their
neutral value (``n`` 1, ``echo`` false, penalties 0, ...), so that a client
never gets silently different semantics.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.cluster.frontend import InvalidRequestError
from kvserve.proto import generate_pb2

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}
# OpenAI's default, not kvserve's gRPC default (which is the same today).
DEFAULT_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields that completions and chat completions share; unknown fields are refused (a typo would
    otherwise change nothing)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    stop: str | list[str] | None = None
    # Neutral values only, for now.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # kvserve's extras.
    top_k: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported_fields(self) -> dict[str, bool]:
        """Each field kvserve does not implement yet, and whether this request sets it."""
        return {
            "n": self.n != 1,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported_fields(self) -> dict[str, bool]:
        return {
            **super().unsupported_fields(),
            "best_of": self.best_of not in (None, 1),
            "echo": self.echo,
            "logprobs": self.logprobs is not None,
            "suffix": bool(self.suffix),
        }


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


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


def to_generate_request(
    request: SamplingRequest, prompt: str | list[int] | list[str] | list[list[int]], max_tokens: int | None
) -> generate_pb2.GenerateRequest:
    """``request`` as the gRPC API's request; ``InvalidRequestError`` for what kvserve cannot serve."""
    for name, used in request.unsupported_fields().items():
        if used:
            raise InvalidRequestError(f"{name}: not supported by kvserve yet; leave it out or at its default")
    generate = generate_pb2.GenerateRequest()
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError(f"prompt: one prompt per request, got a batch of {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        generate.text = prompt
    else:
        generate.token_ids.SetInParent()
        generate.token_ids.ids.extend(prompt)
    params = generate.sampling_params
    fields = {"max_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
              "top_k": request.top_k, "seed": request.seed}
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
    generate.cache_salt = request.cache_salt or ""
    return generate


def finish_reason(response: generate_pb2.GenerateResponse) -> str | None:
    return _FINISH_REASONS.get(response.finish_reason)


def to_usage(response: generate_pb2.GenerateResponse) -> CompletionUsage:
    usage = response.usage
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
    )


class TextCompletionShape:
    """The messages of ``/v1/completions``: the whole completion, its chunks, its usage chunk."""

    def __init__(self, model: str) -> None:
        self.model = model

    def whole(self, request_id: str, text: str, last: generate_pb2.GenerateResponse) -> Completion:
        return Completion(
            id=f"cmpl-{request_id}",
            model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason(last))],
            usage=to_usage(last),
        )

    def chunk(self, request_id: str, created: int, text: str, reason: str | None, first: bool) -> Completion | None:
        if not text and reason is None:
            return None
        return Completion(
            id=f"cmpl-{request_id}",
            created=created,
            model=self.model,
            choices=[CompletionChoice(text=text, finish_reason=reason)],
        )

    def usage_chunk(self, request_id: str, created: int, last: generate_pb2.GenerateResponse) -> Completion:
        return Completion(id=f"cmpl-{request_id}", created=created, model=self.model, choices=[], usage=to_usage(last))
