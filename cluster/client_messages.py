"""What the Python client sends and returns, and their conversion to and from ``generate_pb2``.

This is the client's one protobuf boundary (the server's is ``frontend.py``):
``to_generate_request`` builds a ``GenerateRequest`` from a prompt and
keyword arguments, checking the keywords' names and types here so that a typo
fails at once with ``TypeError`` instead of reaching the server;
``to_delta`` turns each streamed ``GenerateResponse`` into a
``CompletionDelta``.  The values themselves (``top_p`` in (0, 1], ...) are
validated by the server, which answers ``INVALID_ARGUMENT`` naming the field.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from kvserve.proto import generate_pb2
from kvserve.scheduler.logprobs import TokenLogprobs

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


class SamplingKwargs(TypedDict, total=False):
    """The keyword arguments of ``generate`` and ``stream``: ``SamplingParams``' fields and the request's own.

    Unset ones take the server's defaults (``max_tokens`` 16, ``temperature``
    1.0, ``top_p`` 1.0, no ``top_k``).  ``stop``: strings that end the
    completion once its text contains one (not sent).  ``logprobs``: 0 for each
    token's log-probability, k (at most 20) for it and the k most likely tokens
    at its position (``Completion.logprobs``); ``prompt_logprobs`` the same of
    each prompt token given the tokens before it (``Completion.prompt_logprobs``).
    ``presence_penalty`` and
    ``frequency_penalty`` (each in [-2, 2]) penalize the tokens the completion
    has generated so far, as OpenAI's do; ``logit_bias`` adds a bias in
    [-100, 100] to the logits of up to 300 token ids (``{token_id: bias}``, or
    ``(token_id, bias)`` pairs; the ids are ints, not OpenAI's strings);
    ``min_tokens`` (at most ``max_tokens``) keeps stop tokens, EOS and stop
    strings from ending the completion before that many tokens.
    ``repetition_penalty`` (vLLM's, > 0; 1 for none) divides the positive
    logits, and multiplies the negative ones, of the tokens in the prompt or
    the completion so far.
    ``min_p`` (vLLM's, in [0, 1]; 0 for none) samples only the tokens at least
    ``min_p`` times as probable as the most likely one (after temperature, top-k, top-p).
    ``cache_salt`` isolates a tenant's cached prefixes; ``request_id`` must be
    unique among the requests in flight (the server assigns one when unset).
    """

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: Sequence[int]
    stop: str | Sequence[str]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]]
    min_tokens: int
    repetition_penalty: float
    min_p: float
    cache_salt: str
    request_id: str


SAMPLING_KEYWORDS = frozenset(generate_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
REQUEST_KEYWORDS = frozenset(("cache_salt", "request_id"))
KEYWORDS = SAMPLING_KEYWORDS | REQUEST_KEYWORDS
# NOTE: protobuf takes True for a double (as 1.0); the server refuses a bool for a number, and so does the client.
_REAL_KEYWORDS = frozenset(
    field.name for field in generate_pb2.SamplingParams.DESCRIPTOR.fields if field.type == field.TYPE_DOUBLE
)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one finished request; ``cached_prompt_tokens`` of the prompt came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class CompletionDelta:
    """What one streamed message adds: new tokens and their text.

    Only the last delta of a stream has ``finish_reason`` ("stop", "length" or
    "abort") and ``usage``; ``replica`` is the replica that computed its tokens (the
    server sets it on every message; ``None`` only from a server that does not).
    ``logprobs`` parallels ``token_ids`` when the request asked for them
    (``logprobs=k``), else it is ``None``.  ``prompt_logprobs`` is set on the
    first delta only, when the request asked for them (``prompt_logprobs=k``):
    one entry per prompt token, the first ``None`` (nothing comes before it),
    as ``kvserve.llm.GenerationOutput.prompt_logprobs``; else it is ``None``.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    replica: int | None
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole completion: the concatenation of its stream's deltas (``logprobs`` and ``prompt_logprobs``
    as in ``CompletionDelta``)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    replica: int | None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """Load and cache figures of one replica, as ``GetStats`` reports them.

    ``num_failures``: times it failed (and was started again) since the server started;
    ``step_age_s``: how long its oldest step in flight has run (0 when none; a hung worker
    shows here before the server's step timeout fails it).
    """

    replica: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_kv_blocks: int
    healthy: bool
    num_failures: int = 0
    step_age_s: float = 0.0


class RequestError(Exception):
    """The server refused or failed a request; ``code`` is the gRPC status name (``INVALID_ARGUMENT``, ...).

    ``UNAVAILABLE`` after a stream yielded deltas: the stream was cut (its replica failed and no
    other could go on with it); the deltas received stand, and a retry starts over from the prompt.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[RequestError], tuple[str, str]]:
        # NOTE: else pickling (a process pool, a Ray task) re-created it from its one
        # formatted argument, and failed with TypeError.
        return type(self), (self.code, self.message)


def to_generate_request(prompt: str | Sequence[int], kwargs: dict[str, Any]) -> generate_pb2.GenerateRequest:
    """``prompt`` and ``kwargs`` (``SamplingKwargs``) as a request.

    ``TypeError`` for an unknown keyword (with the likeliest meant one), a
    value of the wrong type, or a prompt that is neither text nor token ids;
    ``ValueError`` for an integer its field cannot hold.
    """
    unknown = sorted(set(kwargs) - KEYWORDS)
    if unknown:
        raise TypeError(_unknown_keywords_message(unknown))
    request = generate_pb2.GenerateRequest()
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray, dict)):
        request.token_ids.SetInParent()  # an empty list is the server's "token_ids is empty"
        _set_field(request.token_ids, "ids", list(prompt), label="prompt")
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    params = request.sampling_params
    for name, value in kwargs.items():
        if value is None:  # the server's default, as when not given
            continue
        if name in REQUEST_KEYWORDS:
            _set_field(request, name, value)
        elif name == "stop":
            stop = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else None
            if stop is None or not all(isinstance(s, str) for s in stop):
                raise TypeError(f"stop must be a string or a sequence of strings, got {value!r}")
            _set_field(params, name, stop)
        elif name == "stop_token_ids":
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise TypeError(f"stop_token_ids must be a sequence of token ids, got {value!r}")
            _set_field(params, name, list(value))
        elif name == "ignore_eos" and not isinstance(value, bool):
            # NOTE: protobuf takes 0 and 1 for a bool; ignore_eos="no" would be True.
            raise TypeError(f"ignore_eos must be True or False, got {value!r}")
        elif name in _REAL_KEYWORDS and isinstance(value, bool):
            raise TypeError(f"{name} must be a number, got {value!r}")
        elif name == "logit_bias":
            _set_logit_bias(params, value)
        else:
            _set_field(params, name, value)
    return request


def to_delta(response: generate_pb2.GenerateResponse, *, with_prompt_logprobs: bool = False) -> CompletionDelta:
    """``response`` as a delta; ``with_prompt_logprobs``: it is the first message of a request that asked for
    its prompt's logprobs (the server leaves out the first prompt token's entry, which is ``None`` here)."""
    finish_reason = _FINISH_REASONS.get(response.finish_reason)
    usage = None
    if finish_reason is not None:
        usage = Usage(
            prompt_tokens=response.usage.prompt_tokens,
            completion_tokens=response.usage.completion_tokens,
            cached_prompt_tokens=response.usage.cached_prompt_tokens,
        )
    return CompletionDelta(
        request_id=response.request_id,
        text=response.text,
        token_ids=tuple(response.token_ids),
        replica=response.replica if response.HasField("replica") else None,
        finish_reason=finish_reason,
        usage=usage,
        logprobs=tuple(_token_logprobs(token) for token in response.logprobs) if response.logprobs else None,
        prompt_logprobs=(
            (None, *(_token_logprobs(token) for token in response.prompt_logprobs)) if with_prompt_logprobs else None
        ),
    )


def _token_logprobs(token: generate_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token.logprob,
        tuple(top.token_id for top in token.top_logprobs),
        tuple(top.logprob for top in token.top_logprobs),
    )


def to_replica_stats(response: generate_pb2.GetStatsResponse) -> tuple[ReplicaStats, ...]:
    return tuple(
        ReplicaStats(
            replica=s.replica,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            num_kv_blocks=s.num_kv_blocks,
            healthy=s.healthy,
            num_failures=s.num_failures,
            step_age_s=s.step_age_seconds,
        )
        for s in response.replicas
    )


class CompletionBuilder:
    """Concatenates the deltas of one stream into a ``Completion``."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] | None = None
        self._prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
        self._last: CompletionDelta | None = None

    def add(self, delta: CompletionDelta) -> None:
        self._texts.append(delta.text)
        self._token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self._logprobs = [*(self._logprobs or ()), *delta.logprobs]
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        self._last = delta

    def build(self) -> Completion:
        last = self._last
        if last is None or last.finish_reason is None or last.usage is None:
            raise RequestError("UNKNOWN", "the stream ended without a finish reason")
        return Completion(
            request_id=last.request_id,
            text="".join(self._texts),
            token_ids=tuple(self._token_ids),
            finish_reason=last.finish_reason,
            usage=last.usage,
            replica=last.replica,
            logprobs=tuple(self._logprobs) if self._logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs,
        )


def _set_field(message: Any, name: str, value: Any, *, label: str | None = None) -> None:
    """``message.name = value`` (or its repeated field extended), naming the field in protobuf's type errors."""
    try:
        if isinstance(value, list):
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    except TypeError as exc:
        raise TypeError(f"{label or name}: {exc}") from None
    except ValueError as exc:  # an integer out of the field's range
        raise ValueError(f"{label or name}: {exc}") from None


def _set_logit_bias(params: generate_pb2.SamplingParams, value: Any) -> None:
    """``params.logit_bias`` from ``{token_id: bias}`` or ``(token_id, bias)`` pairs; ``TypeError`` for another
    shape, an id that is not an int or a bias that is not a number, ``ValueError`` for an id given twice."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        items = list(value)
        if not all(isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) == 2
                   for item in items):
            items = None
    else:
        items = None
    if items is None:
        raise TypeError(f"logit_bias must be {{token_id: bias}} or (token_id, bias) pairs, got {value!r}")
    for token_id, bias in items:
        # NOTE: OpenAI's JSON spells ids as strings ("50256"); here they are ints, as everywhere in this API.
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TypeError(f"logit_bias: token ids must be ints, got {token_id!r}")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real):
            raise TypeError(f"logit_bias[{token_id}] must be a number, got {bias!r}")
        if int(token_id) in params.logit_bias:
            raise ValueError(f"logit_bias names token {token_id} twice")
        try:
            params.logit_bias[int(token_id)] = float(bias)
        except ValueError as exc:  # an id past int64
            raise ValueError(f"logit_bias: {exc}") from None


def _unknown_keywords_message(unknown: list[str]) -> str:
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, KEYWORDS, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unexpected keyword argument {', '.join(parts)}; the keywords are: {', '.join(sorted(KEYWORDS))}"
