"""Between the ``generate_pb2`` messages and the scheduler actor's dataclasses: a
``GenerateRequest`` tokenized and validated into a ``RequestSpec``, a ``RequestDelta``
into a ``GenerateResponse``.

Every size a request carries is checked against ``RequestLimits`` before the work
it would cost (tokenizing, walking a list); errors are ``InvalidRequestError``s
that name the field and the limit.
"""

from __future__ import annotations

import unicodedata
import uuid
from typing import Any

from kvserve.cluster.auth import Tenant, tenant_cache_salt
from kvserve.cluster.detokenizer import IncrementalDetokenizer
from kvserve.cluster.frontend_errors import InvalidRequestError
from kvserve.cluster.messages import ModelInfo, ReplicaStatsInfo, RequestDelta, RequestSpec
from kvserve.cluster.request_limits import RequestLimits
from kvserve.proto import generate_pb2
from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.sampling_params import (
    SamplingParams,
    check_token_ids_in_vocabulary,
    first_outside_vocabulary,
)

MAX_REQUEST_ID_LENGTH = 256
# Room in the quick refusal of text too long to fit (see ``_max_text_chars``).
_TEXT_BOUND_FACTOR = 4
# The proto's ``optional`` sampling fields: unset ones take SamplingParams' defaults.
_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty",
    "min_tokens", "prompt_logprobs", "repetition_penalty", "min_p",
)
_FINISH_REASONS = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


class RequestConversion:
    """Requests for one model: its vocabulary and ``max_model_len``, its tokenizer (or
    ``None``), and the server's ``RequestLimits``."""

    def __init__(self, model_info: ModelInfo, tokenizer: Any | None, limits: RequestLimits) -> None:
        self._model_info = model_info
        self._tokenizer = tokenizer
        self.limits = limits
        self._max_text_chars = _max_text_chars(tokenizer, model_info.max_model_len)

    def to_request_spec(self, request: generate_pb2.GenerateRequest, tenant: Tenant | None = None) -> RequestSpec:
        """Tokenize and validate ``request``; ``InvalidRequestError`` names the bad field or limit.

        Every size is checked before the work it would cost (``RequestLimits``).
        """
        model = self._model_info
        limits = self.limits
        vocab_size = model.vocab_size
        req_id = request.request_id or uuid.uuid4().hex
        check_request_id(req_id)
        if len(request.cache_salt.encode()) > limits.max_cache_salt_bytes:
            raise InvalidRequestError(
                f"cache_salt: {len(request.cache_salt.encode())} bytes, over the limit of "
                f"{limits.max_cache_salt_bytes} (max_cache_salt_bytes)"
            )
        num_stop_token_ids = len(request.sampling_params.stop_token_ids)
        if num_stop_token_ids > limits.max_stop_token_ids:
            raise InvalidRequestError(
                f"sampling_params.stop_token_ids: {num_stop_token_ids} ids, over the limit of "
                f"{limits.max_stop_token_ids} (max_stop_token_ids)"
            )
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt is missing: set text or token_ids")
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("text is empty")
            if self._tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer and this model has none: send token_ids")
            # The operator's limit first, so that its refusal names it; both checks are cheap.
            num_bytes = len(request.text.encode())
            if num_bytes > limits.max_prompt_bytes:
                raise InvalidRequestError(
                    f"text: {num_bytes} bytes, over the limit of {limits.max_prompt_bytes} (max_prompt_bytes)"
                )
            if self._max_text_chars is not None and len(request.text) > self._max_text_chars:
                raise InvalidRequestError(
                    f"text: {len(request.text)} characters are far more than max_model_len "
                    f"{model.max_model_len} tokens can hold"
                )
            prompt_token_ids = list(self._tokenizer(request.text)["input_ids"])
            if not prompt_token_ids:
                raise InvalidRequestError("text tokenizes to no tokens")
        else:
            ids = request.token_ids.ids
            num_ids = len(ids)
            if not num_ids:
                raise InvalidRequestError("token_ids is empty")
            # The sizes first: a long list is refused before it is copied or walked (a 4 MiB
            # message of ids took the event loop 84 ms to copy).
            if num_ids >= model.max_model_len:
                raise InvalidRequestError(
                    f"token_ids: the prompt has {num_ids} tokens; max_model_len is {model.max_model_len}, "
                    "which leaves no room for output"
                )
            if limits.max_prompt_tokens is not None and num_ids > limits.max_prompt_tokens:
                raise InvalidRequestError(
                    f"token_ids: {num_ids} prompt tokens, over the limit of {limits.max_prompt_tokens} "
                    "(max_prompt_tokens)"
                )
            prompt_token_ids = list(ids)
            if (bad := first_outside_vocabulary(prompt_token_ids, vocab_size)) is not None:
                raise InvalidRequestError(f"token_ids: {bad} is outside the vocabulary [0, {vocab_size})")
        num_prompt_tokens = len(prompt_token_ids)
        if limits.max_prompt_tokens is not None and num_prompt_tokens > limits.max_prompt_tokens:
            field = "text" if kind == "text" else "token_ids"
            raise InvalidRequestError(
                f"{field}: {num_prompt_tokens} prompt tokens, over the limit of {limits.max_prompt_tokens} "
                "(max_prompt_tokens)"
            )
        sampling_params = self.to_sampling_params(request.sampling_params)
        if num_prompt_tokens + sampling_params.max_tokens > model.max_model_len:
            field = "text" if kind == "text" else "token_ids"
            if num_prompt_tokens >= model.max_model_len:
                raise InvalidRequestError(
                    f"{field}: the prompt has {num_prompt_tokens} tokens; max_model_len is {model.max_model_len}, "
                    "which leaves no room for output"
                )
            default = "" if request.sampling_params.HasField("max_tokens") else " (the default)"
            raise InvalidRequestError(
                f"sampling_params.max_tokens: {num_prompt_tokens} prompt tokens + max_tokens "
                f"{sampling_params.max_tokens}{default} exceed max_model_len {model.max_model_len}"
            )
        return RequestSpec(
            req_id=scheduled_request_id(tenant, req_id),
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params,
            cache_salt=tenant_cache_salt(tenant, request.cache_salt or None),
            tenant=None if tenant is None else tenant.name,
        )

    def to_sampling_params(self, params: generate_pb2.SamplingParams) -> SamplingParams:
        """``params`` checked against the vocabulary and the limits; ``SamplingParams`` validates the rest."""
        if params.stop and self._tokenizer is None:
            raise InvalidRequestError("sampling_params.stop: stop strings need a tokenizer and this model has none")
        kwargs: dict[str, Any] = {
            "stop": params.stop,  # the front end matches them on the text (SamplingParams bounds them)
            "stop_token_ids": tuple(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            "logit_bias": params.logit_bias,  # a Mapping: SamplingParams counts it before copying
        }
        for name in _OPTIONAL_SAMPLING_FIELDS:
            if params.HasField(name):
                kwargs[name] = getattr(params, name)
        try:
            # SamplingParams validates every field and names it in its message.
            sampling_params = SamplingParams(**kwargs)
            check_token_ids_in_vocabulary(sampling_params, self._model_info.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(f"sampling_params.{exc}") from None
        if self._model_info.simulated:
            # NOTE: simulated replicas make up their tokens; logprobs of them would be made up too.
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(sampling_params, name) is not None:
                    raise InvalidRequestError(
                        f"sampling_params.{name}: this server's replicas are simulated (no model), so it has no "
                        "log-probabilities"
                    )
        return sampling_params


def check_request_id(request_id: str) -> None:
    """``InvalidRequestError`` for a request id too long or holding a control character.

    NOTE: ids are echoed back and logged; a newline or an ANSI escape in one let a
    client forge log lines.  Refused: every character of Unicode category C (control,
    format such as bidi overrides, surrogate, private use, unassigned).
    """
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")
    if request_id.isascii() and request_id.isprintable():
        return  # the usual id, at no cost
    for position, char in enumerate(request_id, start=1):
        if unicodedata.category(char).startswith("C"):
            raise InvalidRequestError(
                f"request_id has a control or format character (U+{ord(char):04X} at character {position}); "
                "ids may hold printable characters only"
            )


def scheduled_request_id(tenant: Tenant | None, request_id: str) -> str:
    """The id a request of ``tenant`` is scheduled under: ``request_id`` in its tenant's own namespace.

    NOTE: ids in flight must be unique; shared between tenants, one tenant's ids could
    refuse another's ("already in flight") and tell them apart.  A tenant's name has
    no whitespace (auth token files split on it), so no two tenants' ids meet.
    """
    return request_id if tenant is None else f"{tenant.name} {request_id}"


def client_request_id(tenant: Tenant | None, req_id: str) -> str:
    """The id its client knows a request by: ``scheduled_request_id``'s inverse."""
    return req_id if tenant is None else req_id[len(tenant.name) + 1 :]


def to_response(
    req_id: str, delta: RequestDelta, detokenizer: IncrementalDetokenizer | None
) -> generate_pb2.GenerateResponse:
    """``delta`` as a response: its tokens, their text from ``detokenizer`` (flushed at the
    request's end), its logprobs and its prompt's if it asked (``GenerateResponse.prompt_logprobs``:
    one per prompt token after the first), and its end's reason and usage."""
    text = ""
    if detokenizer is not None:
        text = detokenizer.add(delta.token_ids)
        if delta.is_last:
            text += detokenizer.flush()
    response = generate_pb2.GenerateResponse(
        request_id=req_id, token_ids=delta.token_ids, text=text, replica=delta.replica
    )
    if delta.logprobs:
        response.logprobs.extend([_to_token_logprobs(logprobs) for logprobs in delta.logprobs])
    if delta.prompt_logprobs:
        # NOTE: the first prompt token's entry is None (nothing predicts it): the API leaves it out.
        response.prompt_logprobs.extend([_to_token_logprobs(logprobs) for logprobs in delta.prompt_logprobs[1:]])
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[delta.finish_reason]
        response.usage.prompt_tokens = delta.num_prompt_tokens
        response.usage.cached_prompt_tokens = delta.num_cached_tokens
        response.usage.completion_tokens = delta.num_output_tokens
    return response


def _to_token_logprobs(logprobs: TokenLogprobs) -> generate_pb2.TokenLogprobs:
    return generate_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top_logprobs=[
            generate_pb2.TopLogprob(token_id=token_id, logprob=logprob)
            for token_id, logprob in zip(logprobs.top_token_ids, logprobs.top_logprobs)
        ],
    )


def _max_text_chars(tokenizer: Any | None, max_model_len: int) -> int | None:
    """A length of text that cannot tokenize to ``max_model_len`` tokens or fewer, refused untokenized.

    No token covers more bytes than the longest vocabulary entry's UTF-8
    spelling (byte-level and SentencePiece vocabularies spell each byte with
    at least one byte), and text has at least one byte per character; the
    factor leaves room for normalizers that compose characters or tidy
    whitespace.  ``None`` without a tokenizer or a vocabulary to read.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    longest = max((len(token.encode("utf-8")) for token in get_vocab()), default=0)
    return _TEXT_BOUND_FACTOR * max_model_len * longest if longest else None


def to_stats_response(stats: list[ReplicaStatsInfo]) -> generate_pb2.GetStatsResponse:
    """The actor's figures of every replica as ``GetStats`` answers them."""
    return generate_pb2.GetStatsResponse(
        replicas=[
            generate_pb2.ReplicaStats(
                replica=s.replica,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                kv_cache_usage=s.kv_cache_usage,
                prefix_cache_hit_rate=s.prefix_cache_hit_rate,
                healthy=s.healthy,
                num_kv_blocks=s.num_kv_blocks,
                num_failures=s.num_failures,
                step_age_seconds=s.step_age_s,
            )
            for s in stats
        ]
    )
