"""Stop strings and ``min_tokens``: a stop string ends a stream only if it ends in the text of a token after the
first ``min_tokens`` (it may begin earlier); the text of those first tokens is sent whole.

The matcher is fed one letter per token (``Letters``); the last tests run the front end's pipeline over the
fake scheduler of test_frontend_streaming, to show that a request's ``min_tokens`` reaches its matcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.cluster.frontend import Frontend
from kvserve.cluster.messages import RequestDelta
from kvserve.scheduler.stop_strings import StopStringMatcher
from kvserve.proto import generate_pb2
from tests.cluster.test_frontend_streaming import MODEL_INFO, FakeContext, FakeScheduler

ALPHABET = "abcxy"


class Letters:
    """A detokenizer (and a tokenizer's ``decode``) of token ``i``: the ``i``-th letter of ``ALPHABET``."""

    def add(self, token_ids: Sequence[int]) -> str:
        return self.decode(token_ids)

    def flush(self) -> str:
        return ""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids)


def ids(text: str) -> list[int]:
    return [ALPHABET.index(letter) for letter in text]


def stream(text: str, stop: list[str], min_tokens: int, deltas: int = 1) -> tuple[str, int, bool]:
    """``text`` fed one token per letter, in ``deltas`` calls: what is sent, how many tokens were used, and
    whether a stop string ended it."""
    matcher = StopStringMatcher(stop, min_tokens)
    detokenizer = Letters()
    token_ids = ids(text)
    size = max(1, -(-len(token_ids) // deltas))
    sent, num_used = [], 0
    for start in range(0, max(1, len(token_ids)), size):
        piece = token_ids[start : start + size]
        piece_text, used = matcher.add_tokens(detokenizer, piece, is_last=start + size >= len(token_ids))
        sent.append(piece_text)
        num_used += used
        if matcher.stopped:
            break
    return "".join(sent), num_used, matcher.stopped


# -- the rule ----------------------------------------------------------------------------------------


def test_a_stop_string_in_the_first_min_tokens_is_sent_and_a_later_one_stops():
    assert stream("abcabx", ["ab"], min_tokens=2) == ("abc", 5, True)


def test_a_stop_string_ending_in_the_last_protected_token_does_not_stop():
    assert stream("xabc", ["ab"], min_tokens=3) == ("xabc", 4, False)


def test_a_stop_string_begun_in_the_protected_tokens_and_ended_after_them_stops():
    assert stream("xab", ["ab"], min_tokens=2) == ("x", 3, True)


def test_without_min_tokens_the_first_stop_string_stops():
    assert stream("abcabx", ["ab"], min_tokens=0) == ("", 2, True)


def test_a_stream_that_ends_within_min_tokens_sends_all_its_text_stop_strings_included():
    assert stream("xaba", ["ab", "a"], min_tokens=4) == ("xaba", 4, False)


def test_the_tokens_are_counted_across_the_streams_deltas():
    assert stream("abcabx", ["ab"], min_tokens=2, deltas=6) == ("abc", 5, True)
    assert stream("abcabx", ["ab"], min_tokens=2, deltas=3) == ("abc", 5, True)


def test_text_held_back_during_min_tokens_is_sent_when_it_turns_out_not_to_stop():
    matcher = StopStringMatcher(["abc"], min_tokens=2)
    detokenizer = Letters()

    assert matcher.add_tokens(detokenizer, ids("xa"), is_last=False) == ("x", 2)  # "a" may begin "abc"
    assert matcher.add_tokens(detokenizer, ids("y"), is_last=True) == ("ay", 1)
    assert not matcher.stopped


@given(
    text=st.text(alphabet="ab", max_size=30),
    stop=st.lists(st.text(alphabet="ab", min_size=1, max_size=4), min_size=1, max_size=3),
    min_tokens=st.integers(min_value=0, max_value=30),
    deltas=st.integers(min_value=1, max_value=5),
)
def test_the_text_sent_ends_where_the_first_stop_string_ending_after_min_tokens_begins(text, stop, min_tokens, deltas):
    # One token per letter: the first stop string (the longest of those ending together) that ends in letter
    # min_tokens + 1 or later, found by brute force.
    ends = [
        (end, end - max(len(s) for s in stop if text[:end].endswith(s)))
        for end in range(min_tokens + 1, len(text) + 1)
        if any(text[:end].endswith(s) for s in stop)
    ]
    sent, num_used, stopped = stream(text, stop, min_tokens, deltas)

    if ends:
        end, start = ends[0]
        assert (sent, num_used, stopped) == (text[:start], end, True)
    else:
        assert (sent, num_used, stopped) == (text, len(text), False)


# -- the front end's pipeline -------------------------------------------------------------------------


def generate(min_tokens: int, output: str) -> list[generate_pb2.GenerateResponse]:
    """A request stopping at "ab" with ``min_tokens``, its scheduler producing ``output`` (one delta).

    With ``output`` "abcabab": "ab" ends in tokens 2, 5 and 7.
    """
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[2, 3]),
        sampling_params=generate_pb2.SamplingParams(max_tokens=8, stop=["ab"], min_tokens=min_tokens),
        request_id="r",
    )

    async def run() -> list[generate_pb2.GenerateResponse]:
        scheduler = FakeScheduler()
        frontend = Frontend(scheduler, MODEL_INFO, Letters(), max_concurrent_requests=4)
        frontend.start()
        try:
            responses = asyncio.ensure_future(_collect(frontend.Generate(request, FakeContext())))
            while not scheduler.added:
                await asyncio.sleep(0.005)
            scheduler.emit(RequestDelta("r", ids(output), replica=0))
            return await responses
        finally:
            await frontend.stop()

    return asyncio.run(run())


async def _collect(responses) -> list[generate_pb2.GenerateResponse]:
    return [response async for response in responses]


@pytest.mark.parametrize(
    "min_tokens, text, num_tokens", [(0, "", 2), (2, "abc", 5), (4, "abc", 5), (5, "abcab", 7)]
)
def test_the_front_end_applies_a_requests_min_tokens_to_its_stop_strings(min_tokens, text, num_tokens):
    responses = generate(min_tokens, "abcabab")

    assert "".join(response.text for response in responses) == text
    assert sum(len(response.token_ids) for response in responses) == num_tokens
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == num_tokens
