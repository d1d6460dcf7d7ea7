"""Stop strings matched on streamed text: what is sent, whatever the pieces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.scheduler.stop_strings import MAX_STOP_STRINGS, StopStringMatcher, check_stop_strings


def stream(pieces: list[str], stop: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stop)
    sent = "".join(matcher.add(piece) for piece in pieces)
    return sent + matcher.flush(), matcher.stopped


def test_the_text_before_the_stop_string_is_sent_and_the_rest_dropped():
    assert stream(["Hello", " wor", "ld. Bye"], ["world"]) == ("Hello ", True)


def test_a_stop_string_split_across_pieces_is_held_back_until_it_is_known():
    matcher = StopStringMatcher(["</s>"])

    assert matcher.add("and then<") == "and then"
    assert matcher.add("/") == ""
    assert matcher.add("s> more") == ""
    assert matcher.stopped


def test_held_text_that_turns_out_not_to_stop_is_sent():
    matcher = StopStringMatcher(["</s>"])

    assert matcher.add("a <") == "a "
    assert matcher.add("b") == "<b"
    assert not matcher.stopped


def test_held_text_is_sent_by_flush_when_the_stream_ends():
    matcher = StopStringMatcher(["STOP"])

    assert matcher.add("the end ST") == "the end "
    assert matcher.flush() == "ST"


def test_the_earliest_of_several_stop_strings_wins():
    assert stream(["one two three"], ["three", "two"]) == ("one ", True)


@pytest.mark.parametrize("pieces", [["abc"], ["ab", "c"], ["a", "b", "c"]])
def test_the_stop_string_completed_first_wins_over_one_started_earlier(pieces):
    # Generation stops once "b" is produced: "abc" is never completed.
    assert stream(pieces, ["abc", "b"]) == ("a", True)


def test_nothing_is_sent_after_the_stop():
    matcher = StopStringMatcher(["x"])
    matcher.add("ax")

    assert matcher.add("more") == ""
    assert matcher.flush() == ""


@given(
    text=st.text(alphabet="ab\n", max_size=40),
    stop=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_any_split_of_the_text_sends_exactly_the_text_before_the_first_completed_stop_string(text, stop, cuts):
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    ends = [(i + len(s), i) for s in stop if (i := text.find(s)) >= 0]
    first = min(ends)[1] if ends else None

    sent, stopped = stream(pieces, stop)

    assert sent == (text if first is None else text[:first])
    assert stopped == (first is not None)


@pytest.mark.parametrize(
    "stop, message",
    [
        (["x"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
        ([""], "a stop string is empty"),
        (["x" * 257], "longer than 256 characters"),
    ],
)
def test_stop_lists_are_bounded(stop, message):
    with pytest.raises(ValueError, match=message):
        check_stop_strings(stop)
