"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# The most alternatives a request may ask for at each position (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20


def first_outside_vocabulary(token_ids: Sequence[int], vocab_size: int) -> int | None:
    """The first of ``token_ids`` outside the vocabulary ``[0, vocab_size)``, or ``None``."""
    # NOTE: min/max run in C (a prompt may be long); the loop only runs to name the offending id.
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        return next(t for t in token_ids if not 0 <= t < vocab_size)
    return None


def check_stop_token_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    """``ValueError`` naming the first stop token id outside the vocabulary ``[0, vocab_size)``:
    an id the model cannot sample would never stop anything."""
    if (bad := first_outside_vocabulary(stop_token_ids, vocab_size)) is not None:
        raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples its tokens and when it stops.

    ``top_k`` of ``None`` disables top-k; ``-1`` and ``0`` are accepted as the
    conventional spellings of "disabled" and normalised to ``None``.
    ``temperature == 0`` means greedy.  A ``seed`` makes the request's samples
    reproducible and independent of the batch it runs in.

    ``logprobs`` asks for log-probabilities: ``None`` for none, ``0`` for the
    sampled token's only, ``k`` for it and the ``k`` most likely tokens at each
    position (at most ``MAX_LOGPROBS``).  They are the model's own distribution
    (``log_softmax`` of the raw logits, before temperature, top-k or top-p).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        max_tokens = _integer("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        temperature = _real("temperature", self.temperature)
        if not math.isfinite(temperature) or temperature < 0.0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        top_p = _real("top_p", self.top_p)
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        top_k = self.top_k
        if top_k is not None:
            top_k = _integer("top_k", top_k)
            if top_k < -1:
                raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {top_k}")
            if top_k in (-1, 0):
                top_k = None
        seed = None if self.seed is None else _integer("seed", self.seed)
        logprobs = None if self.logprobs is None else _integer("logprobs", self.logprobs)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {logprobs}")
        if not isinstance(self.ignore_eos, bool):
            # NOTE: any object is truthy or not; ignore_eos="no" ignored EOS.
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        not_ids = ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        if isinstance(self.stop_token_ids, (Mapping, str, bytes)):  # iterable, but not ids (a dict's keys were taken)
            raise not_ids
        try:
            stop_token_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise not_ids from None
        stop_token_ids = tuple(_integer("stop_token_ids", token_id) for token_id in stop_token_ids)
        if any(token_id < 0 for token_id in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {min(stop_token_ids)}")
        # NOTE: numpy integers become ints: the fields travel in messages and hashes.
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "logprobs", logprobs)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _real(name: str, value: object) -> float:
    """``value`` as a float; ``ValueError`` for anything but a real number (a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _integer(name: str, value: object) -> int:
    """``value`` as an int (numpy integers too); ``ValueError`` for anything else, a bool included."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)
