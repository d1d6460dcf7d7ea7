"""Fuzzed ``Generate`` request bodies: bad ones the server must refuse, odd ones it must serve.

Every field of ``GenerateRequest`` gets values it must refuse: out of range,
NaN and infinities, empty and huge lists and strings, bad UTF-8, wrong wire
types; and whole bodies of garbage, truncated or corrupt wire format, or groups
nested past protobuf's limit.  The odd but valid ones (unknown fields, which
protobuf skips; a field of the wrong wire type, which decodes as unknown;
extreme seeds and ``top_k`` on greedy requests) are the plain request in
another spelling: served, they get its tokens.  Bodies are raw bytes, as a
client of any language could send them; the wire format is written by hand
where the generated code would refuse to.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvserve.proto import generate_pb2

# The share of odd but valid requests among the fuzzed ones, and the tokens each asks for.
ODD_SHARE = 0.05
ODD_MAX_TOKENS = 4
# Over the server's default max_message_bytes (4 MiB).
OVER_MESSAGE_LIMIT_BYTES = 5 * 2**20


@dataclass(frozen=True, slots=True)
class FuzzCase:
    kind: str
    data: bytes
    valid: bool  # odd but valid: must be served, with the plain request's tokens


# -- the wire format, by hand: what the generated code will not write ------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(payload)) + payload


def _any_wire_value(rng: random.Random, number: int) -> bytes:
    """Field ``number`` with a random value of a random wire type (groups included, balanced)."""
    wire_type = rng.choice((0, 1, 2, 3, 5))
    if wire_type == 0:
        return _tag(number, 0) + _varint(rng.getrandbits(64))
    if wire_type == 1:
        return _tag(number, 1) + rng.randbytes(8)
    if wire_type == 5:
        return _tag(number, 5) + rng.randbytes(4)
    if wire_type == 3:
        return _tag(number, 3) + _tag(number, 4)
    return _bytes_field(number, rng.randbytes(rng.randrange(0, 1024)))


def _unknown_number(rng: random.Random, message_type) -> int:
    """A field number that ``message_type`` does not define (up to the largest, 2**29 - 1)."""
    known = max(f.number for f in message_type.DESCRIPTOR.fields)
    return rng.choice((known + 1, rng.randrange(known + 1, 1 << 15), (1 << 29) - 1, rng.randrange(19000, 20000)))


def _decodes_with_prompt(data: bytes) -> bool:
    try:
        return generate_pb2.GenerateRequest.FromString(data).WhichOneof("prompt") is not None
    except DecodeError:
        return False


def _sampling(**fields) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(**({"max_tokens": ODD_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
                                          | fields))


class FuzzedRequests:
    """Bad and odd-but-valid ``GenerateRequest`` bodies for a model of ``vocab_size`` and ``max_model_len``.

    ``plain`` is the prompt every case is built on; an odd case, served, must get its tokens.
    ``draw()`` gives each kind once before it draws kinds at random.
    """

    def __init__(self, seed: int, plain: list[int], vocab_size: int, max_model_len: int) -> None:
        # What a client process needs to draw the same cases.
        self.args = (seed, tuple(plain), vocab_size, max_model_len)
        self.rng = r = random.Random(seed)
        self.plain = plain = list(plain)
        n, v = max_model_len, vocab_size

        def bad_utf8() -> bytes:
            return r.randbytes(r.randrange(0, 8)) + b"\xff\xfe" + r.randbytes(r.randrange(0, 8))

        def ids(*extra: int) -> generate_pb2.TokenIds:
            return generate_pb2.TokenIds(ids=[*plain, *extra])

        def with_params(**fields) -> generate_pb2.GenerateRequest:
            return generate_pb2.GenerateRequest(token_ids=ids(), sampling_params=_sampling(**fields))

        def unknown_fields(message_type, max_count: int) -> bytes:
            return b"".join(
                _any_wire_value(r, _unknown_number(r, message_type)) for _ in range(r.randrange(1, max_count))
            )

        def plain_bytes(bare: bool = False) -> bytes:
            """The plain request (its prompt alone when ``bare``), as bytes to append fields to."""
            request = generate_pb2.GenerateRequest(token_ids=ids())
            if not bare:
                request.sampling_params.CopyFrom(_sampling())
            return request.SerializeToString()

        self.bad: dict[str, Callable[[], bytes | generate_pb2.GenerateRequest]] = {
            # the prompt
            "no prompt": lambda: generate_pb2.GenerateRequest(sampling_params=_sampling()),
            "empty message": lambda: b"",
            "text empty": lambda: generate_pb2.GenerateRequest(text=""),
            "text over max_model_len tokens": lambda: generate_pb2.GenerateRequest(text="hello " * (2 * n)),
            "text of 2 MiB": lambda: generate_pb2.GenerateRequest(text="".join(r.choices("ab c", k=1024)) * 2048),
            "text of bad UTF-8": lambda: _bytes_field(1, bad_utf8()),
            "text over the message limit": lambda: generate_pb2.GenerateRequest(text="a" * OVER_MESSAGE_LIMIT_BYTES),
            "token_ids empty": lambda: generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds()),
            "token_ids negative": lambda: generate_pb2.GenerateRequest(token_ids=ids(-r.randrange(1, 2**63))),
            "token_ids outside the vocabulary": lambda: generate_pb2.GenerateRequest(
                token_ids=ids(r.choice((v, v + 1, r.randrange(v, 2**63)))),
            ),
            "token_ids int64 extremes": lambda: generate_pb2.GenerateRequest(
                token_ids=ids(r.choice((-(2**63), 2**63 - 1))),
            ),
            "token_ids of max_model_len": lambda: generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[r.randrange(3, v) for _ in range(n)]),
            ),
            "token_ids of a million": lambda: generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=[5] * 10**6)
            ),
            "token_ids packed past the end": lambda: _bytes_field(2, _tag(1, 2) + _varint(1000) + bytes(10)),
            "prompt of a wrong wire type": lambda: r.choice((
                _tag(r.choice((1, 2)), 0) + _varint(r.getrandbits(64)),
                _tag(r.choice((1, 2)), 1) + r.randbytes(8),
                _tag(r.choice((1, 2)), 5) + r.randbytes(4),
            )),
            "both prompts, token_ids last and empty": lambda: (
                _bytes_field(1, b"hello") + _bytes_field(2, b"")
            ),
            # sampling_params
            "max_tokens 0": lambda: with_params(max_tokens=0),
            "max_tokens negative": lambda: with_params(max_tokens=r.randrange(-(2**31), 0)),
            "max_tokens int32 max": lambda: with_params(max_tokens=2**31 - 1),
            "max_tokens past max_model_len": lambda: with_params(max_tokens=n),
            "max_tokens as a 64-bit varint": lambda: _bytes_field(2, _tag(1, 0) + _varint(plain[0])) + _bytes_field(
                3, _tag(1, 0) + _varint(r.choice((2**63, 2**64 - 1)))
            ),
            "temperature NaN": lambda: with_params(temperature=math.nan),
            "temperature NaN with payload": lambda: (
                plain_bytes(bare=True) + _bytes_field(3, _tag(2, 1) + struct.pack("<Q", 0x7FF4000000000001))
            ),
            "temperature infinite": lambda: with_params(temperature=r.choice((math.inf, -math.inf))),
            "temperature negative": lambda: with_params(temperature=-r.uniform(1e-300, 1e300)),
            "top_p 0": lambda: with_params(top_p=0.0),
            "top_p out of (0, 1]": lambda: with_params(top_p=r.choice((-1.0, 1.0000001, 2.0, 1e308, -0.0))),
            "top_p NaN or infinite": lambda: with_params(top_p=r.choice((math.nan, math.inf, -math.inf))),
            "top_k below -1": lambda: with_params(top_k=r.randrange(-(2**31), -1)),
            "stop_token_ids negative": lambda: with_params(stop_token_ids=[3, -r.randrange(1, 2**63)]),
            "stop_token_ids outside the vocabulary": lambda: with_params(stop_token_ids=[r.randrange(v, 2**63)]),
            "stop_token_ids over the limit": lambda: with_params(stop_token_ids=[3] * r.choice((257, 10**5))),
            "stop: 17 strings": lambda: with_params(stop=["x"] * 17),
            "stop: an empty string": lambda: with_params(stop=["a", ""]),
            "stop: a string of 257 characters": lambda: with_params(stop=["s" * 257]),
            "stop: a string of 1 MiB": lambda: with_params(stop=["s" * 2**20]),
            "stop: 100,000 strings": lambda: with_params(stop=["s"] * 10**5),
            "stop of bad UTF-8": lambda: plain_bytes(bare=True) + _bytes_field(3, _bytes_field(8, bad_utf8())),
            "sampling_params of garbage": lambda: self._garbage(lambda g: _bytes_field(3, g)),
            # request_id and cache_salt
            "request_id of 257 characters": lambda: generate_pb2.GenerateRequest(
                token_ids=ids(), request_id="r" * 257
            ),
            "request_id of 1 MiB": lambda: generate_pb2.GenerateRequest(token_ids=ids(), request_id="r" * 2**20),
            "request_id of bad UTF-8": lambda: plain_bytes(bare=True) + _bytes_field(4, bad_utf8()),
            "cache_salt over 256 bytes": lambda: generate_pb2.GenerateRequest(
                token_ids=ids(), cache_salt=r.choice(("s" * 257, "é" * 129, "s" * 2**20))
            ),
            "cache_salt of bad UTF-8": lambda: plain_bytes(bare=True) + _bytes_field(5, bad_utf8()),
            # whole messages
            "garbage bytes": lambda: self._garbage(lambda g: g),
            "a truncated request": lambda: self._truncated(),
            "a varint of 11 bytes": lambda: b"\xff" * 11,
            "a length past the end": lambda: (
                _tag(r.choice((1, 3, 4, 5, 100)), 2) + _varint(r.randrange(100, 2**32)) + b"abc"
            ),
            "field number 0": lambda: _tag(0, r.choice((0, 2))) + b"\x01\x01",
            "an end-group without its start": lambda: _tag(r.randrange(1, 200), 4),
            "wire types 6 and 7": lambda: _tag(r.randrange(1, 200), r.choice((6, 7))) + b"\x00",
            "groups nested past the limit": lambda: _tag(100, 3) * 200 + _tag(100, 4) * 200,
            "unknown fields without a prompt": lambda: unknown_fields(generate_pb2.GenerateRequest, 20),
        }
        self.odd: dict[str, Callable[[], bytes | generate_pb2.GenerateRequest]] = {
            "unknown fields": lambda: plain_bytes() + unknown_fields(generate_pb2.GenerateRequest, 8),
            "unknown fields in sampling_params": lambda: (
                plain_bytes() + _bytes_field(3, unknown_fields(generate_pb2.SamplingParams, 8))
            ),
            "seed int64 extremes, greedy": lambda: with_params(seed=r.choice((-(2**63), 2**63 - 1, 0, -1))),
            "top_k -1, 0 or huge, greedy": lambda: with_params(top_k=r.choice((-1, 0, 1, v, 2**31 - 1))),
            "top_p the smallest double, greedy": lambda: with_params(top_p=5e-324),
            "temperature -0.0": lambda: with_params(temperature=-0.0),
            "an optional field of a wrong wire type": lambda: plain_bytes() + _bytes_field(
                3, r.choice((_tag(3, 0) + _varint(1), _tag(4, 1) + bytes(8), _tag(5, 2) + _varint(1) + b"x"))
            ),
            "ignore_eos as a 64-bit varint": lambda: (
                plain_bytes() + _bytes_field(3, _tag(7, 0) + _varint(2**64 - 1))
            ),
            "sampling_params twice, the last wins": lambda: generate_pb2.GenerateRequest(
                token_ids=ids(), sampling_params=_sampling(max_tokens=1000)
            ).SerializeToString() + _bytes_field(3, _tag(1, 0) + _varint(ODD_MAX_TOKENS)),
            "cache_salt of 256 bytes": lambda: generate_pb2.GenerateRequest(
                token_ids=ids(), sampling_params=_sampling(), cache_salt="é" * 128
            ),
        }
        self.bad.update({
            "logprobs out of [0, 20]": lambda: with_params(
                logprobs=r.choice((-1, 21, r.randrange(-(2**31), -1), 2**31 - 1))
            ),
            "presence_penalty out of [-2, 2] or NaN": lambda: with_params(
                presence_penalty=r.choice((2.0000001, -2.5, 1e308, math.nan, -math.inf))
            ),
            "frequency_penalty out of [-2, 2] or NaN": lambda: with_params(
                frequency_penalty=r.choice((-2.0000001, 3.0, -1e308, math.nan, math.inf))
            ),
            "logit_bias outside the vocabulary, the bias range, or NaN": lambda: with_params(
                logit_bias=r.choice(({r.randrange(v, 2**63): 1.0}, {3: 100.5}, {3: -math.inf}, {3: math.nan}))
            ),
            "logit_bias over 300 tokens": lambda: with_params(
                logit_bias={i: 1.0 for i in range(r.choice((301, 10**5)))}
            ),
            "repetition_penalty not above 0, or not finite": lambda: with_params(
                repetition_penalty=r.choice((0.0, -0.0, -1.0, -1e-300, math.nan, math.inf))
            ),
            "min_p out of [0, 1] or NaN": lambda: with_params(
                min_p=r.choice((-1e-300, -0.5, 1.0000001, 1e308, math.nan, -math.inf))
            ),
            "min_tokens negative or over max_tokens": lambda: with_params(
                min_tokens=r.choice((-1, ODD_MAX_TOKENS + 1, 2**31 - 1, -(2**31)))
            ),
        })
        self.odd.update({
            "logprobs 0 to 20, greedy": lambda: with_params(logprobs=r.choice((0, 1, 20))),
            # NOTE: penalties and biases are not odd cases: they change the tokens (odd ones are the plain form's).
            "min_tokens of max_tokens, greedy": lambda: with_params(min_tokens=ODD_MAX_TOKENS),
        })
        if "prompt_logprobs" in generate_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
            self.bad["prompt_logprobs out of [0, 20]"] = lambda: with_params(
                prompt_logprobs=r.choice((-1, 21, 2**31 - 1))
            )
            self.odd["prompt_logprobs 0 to 20, greedy"] = lambda: with_params(prompt_logprobs=r.choice((0, 20)))
        # Popped from the end: the bad kinds in order, then the odd ones.
        self._first_of_each = [(True, k) for k in reversed(self.odd)] + [(False, k) for k in reversed(self.bad)]

    def _garbage(self, wrap: Callable[[bytes], bytes]) -> bytes:
        """``wrap(random bytes)`` that fails to decode, or decodes without a prompt."""
        while True:
            data = wrap(self.rng.randbytes(self.rng.randrange(1, 4096)))
            if not _decodes_with_prompt(data):
                return data

    def _truncated(self) -> bytes:
        """A plain request cut short, so that it fails to decode or lost its prompt."""
        whole = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=self.plain), sampling_params=_sampling()
        ).SerializeToString()
        while True:
            data = whole[: self.rng.randrange(1, len(whole))]
            if not _decodes_with_prompt(data):
                return data

    def draw(self) -> FuzzCase:
        """The next case: each kind once first (bad, then odd), then kinds drawn at random."""
        if self._first_of_each:
            valid, kind = self._first_of_each.pop()
        else:
            valid = self.rng.random() < ODD_SHARE
            kind = self.rng.choice(sorted(self.odd if valid else self.bad))
        made = (self.odd if valid else self.bad)[kind]()
        data = made if isinstance(made, bytes) else made.SerializeToString()
        return FuzzCase(kind, data, valid)
