"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.scheduler.stop_strings import MAX_STOP_STRINGS, check_stop_strings

# The most alternatives a request may ask for at each position (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# OpenAI's bounds: penalties in [-2, 2], at most 300 biased tokens, each bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0


def first_outside_vocabulary(token_ids: Sequence[int], vocab_size: int) -> int | None:
    """The first of ``token_ids`` outside the vocabulary ``[0, vocab_size)``, or ``None``."""
    # NOTE: min/max run in C (a prompt may be long); the loop only runs to name the offending id.
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        return next(t for t in token_ids if not 0 <= t < vocab_size)
    return None


def check_token_ids_in_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """``ValueError`` naming the first token id of ``params`` outside the vocabulary ``[0, vocab_size)``:
    a stop id the model cannot sample would never stop anything, a bias on one would bias nothing."""
    if (bad := first_outside_vocabulary(params.stop_token_ids, vocab_size)) is not None:
        raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab_size})")
    biased = [token_id for token_id, _ in params.logit_bias]
    if (bad := first_outside_vocabulary(biased, vocab_size)) is not None:
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")


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
    (``log_softmax`` of the raw logits, before penalties, biases, temperature,
    top-k, top-p or min-p).  ``prompt_logprobs`` asks the same of the prompt:
    for every prompt token after the first, its logprob given the tokens before
    it and, for ``k``, the ``k`` most likely tokens there (such a request reads
    from the prefix cache only what it has logprobs for: cached tokens have no
    logits).

    The logits are adjusted before anything else (greedy requests too), as
    OpenAI's API defines it: ``presence_penalty`` is subtracted from the logit
    of every token the request has generated so far, ``frequency_penalty``
    times the number of times it generated it (its prompt does not count);
    ``logit_bias`` adds to the logits of the tokens it names (given as a
    mapping or pairs of token id and bias; kept as pairs sorted by token id).
    ``repetition_penalty`` (vLLM's and transformers', > 0; 1 for none) divides
    the positive logits, and multiplies the negative ones, of every token in
    the prompt or generated so far: above 1 it discourages repeats, below 1 it
    encourages them.  The order is vLLM's: biases, repetition penalty, then
    presence and frequency penalties.
    ``min_tokens``: the stop tokens (``stop_token_ids`` and, unless
    ``ignore_eos``, the model's end-of-sequence tokens) cannot be sampled, and
    stop strings do not stop, before that many tokens were generated.

    ``stop`` (vLLM's): strings that end the output when its text produces one (a
    string or a list of them; at most ``MAX_STOP_STRINGS`` of at most
    ``MAX_STOP_STRING_CHARS`` characters).  They are matched on the detokenized
    text, by whoever detokenizes it (the servers' front end, ``LLM``), never by
    the workers: the text ends before the stop string, the tokens with the one
    that completed it, and the finish reason is ``"stop"``.

    ``min_p`` (vLLM's and transformers', in [0, 1]; 0 for none) drops, after
    temperature, top-k and top-p, every token whose probability is below
    ``min_p`` times the most likely token's (which always stays; 1 keeps only
    the most likely tokens).  Greedy requests ignore it, as they do top-k and
    top-p.

    ``n`` (vLLM's): completions of the prompt that ``LLM.generate`` returns, each
    a request of its own; with a ``seed``, completion ``i`` samples with ``seed + i``
    (as the servers' OpenAI API does).  The scheduler runs one sequence a request:
    it refuses a request whose ``n`` is not 1.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    n: int = 1

    def __post_init__(self) -> None:
        max_tokens = _integer("max_tokens", self.max_tokens)
        n = _integer("n", self.n)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
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
        # NOTE: a seed is 64 bits wherever it goes (the gRPC API's int64, torch's generators): a larger one
        # wrapped around, 2**64 sampling as 0 does.  Completion i samples with seed + i, which must fit too.
        if seed is not None and not MIN_SEED <= seed <= MAX_SEED - (n - 1):
            largest = f"{MAX_SEED}"
            if n > 1:
                largest += f" - (n - 1) = {MAX_SEED - (n - 1)}: completion i samples with seed + i"
            raise ValueError(f"seed must be a 64-bit signed integer, from {MIN_SEED} to {largest}; got {seed}")
        logprobs = None if self.logprobs is None else _integer("logprobs", self.logprobs)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {logprobs}")
        prompt_logprobs = None if self.prompt_logprobs is None else _integer("prompt_logprobs", self.prompt_logprobs)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {prompt_logprobs}"
            )
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
        presence_penalty = _penalty("presence_penalty", self.presence_penalty)
        frequency_penalty = _penalty("frequency_penalty", self.frequency_penalty)
        repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < repetition_penalty < math.inf:  # NaN fails too
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:  # NaN fails too
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        stop = _stop_strings(self.stop)
        logit_bias = _logit_bias(self.logit_bias)
        min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
        # NOTE: numpy integers become ints: the fields travel in messages and hashes.
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "logprobs", logprobs)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        object.__setattr__(self, "presence_penalty", presence_penalty)
        object.__setattr__(self, "frequency_penalty", frequency_penalty)
        object.__setattr__(self, "repetition_penalty", repetition_penalty)
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", logit_bias)
        object.__setattr__(self, "min_tokens", min_tokens)
        object.__setattr__(self, "prompt_logprobs", prompt_logprobs)
        object.__setattr__(self, "n", n)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens generated so far (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def penalizes_prompt(self) -> bool:
        """Whether sampling depends on the prompt's tokens too (a repetition penalty)."""
        return self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, biases, ``min_tokens``)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


def _real(name: str, value: object) -> float:
    """``value`` as a float; ``ValueError`` for anything but a real number (a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _penalty(name: str, value: object) -> float:
    penalty = _real(name, value)
    if not -MAX_PENALTY <= penalty <= MAX_PENALTY:  # NaN fails too
        raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    return penalty


def _stop_strings(value: object) -> tuple[str, ...]:
    """``stop`` as a tuple of strings, from one string or a sequence of them (bounded)."""
    if isinstance(value, str):
        stop: tuple = (value,)
    elif isinstance(value, (bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    else:
        stop = tuple(value)
    # NOTE: the count first: a list of 100,000 is refused before it is walked.
    wrong = next((text for text in stop if not isinstance(text, str)), None) if len(stop) <= MAX_STOP_STRINGS else None
    if wrong is not None:
        raise ValueError(f"stop must be a string or a list of strings, got an element {wrong!r}")
    check_stop_strings(stop)
    return stop


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as pairs ``(token id, bias)`` sorted by token id, from a mapping or from pairs."""
    if isinstance(value, Mapping):
        # NOTE: counted before anything is copied: a request may send a map of 100,000 entries.
        _check_num_biased(len(value))
        items = list(value.items())
    else:
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            items = [tuple(item) for item in value]  # type: ignore[union-attr]
            if any(len(item) != 2 for item in items):
                raise TypeError
        except TypeError:
            raise ValueError(f"logit_bias must map token ids to biases, got {value!r}") from None
        _check_num_biased(len(items))
    biases: dict[int, float] = {}
    for token_id, bias in items:
        token_id = _integer("logit_bias token id", token_id)
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
        if token_id in biases:
            raise ValueError(f"logit_bias names token {token_id} twice")
        bias = _real(f"logit_bias[{token_id}]", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        biases[token_id] = bias
    return tuple(sorted(biases.items()))


def _check_num_biased(num: int) -> None:
    if num > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {num}")


def _integer(name: str, value: object) -> int:
    """``value`` as an int (numpy integers too); ``ValueError`` for anything else, a bool included."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)
