"""SharedMatches: a match is shared where prompts fork, private where one session's history ends."""

from __future__ import annotations

import pytest

from kvserve.scheduler.block_hash import BlockHasher
from kvserve.scheduler.routing.shared_matches import SharedMatches

HASHER = BlockHasher(16)


def blocks(tokens: list[int]) -> list:
    return list(HASHER.hash_token_ids(tokens))


DOCUMENT = list(range(3, 3 + 16 * 8))  # 8 blocks


def question(n: int) -> list[int]:
    return [40_000 + n] * 40  # 2 full blocks and a partial one


def test_a_second_question_on_a_document_is_shared_where_the_first_continued_past_it() -> None:
    matches = SharedMatches(window=100)

    # The first question matches nothing: it records the blocks it continued past.
    assert matches.observe(blocks(DOCUMENT + question(1)), 0) is False
    # The second matches the document's 8 blocks, which the first went on from.
    assert matches.observe(blocks(DOCUMENT + question(2)), 8) is True


def test_a_chat_turn_matching_its_own_history_is_private() -> None:
    matches = SharedMatches(window=100)
    system = list(range(3, 3 + 16 * 4))
    history = system + [500] * 48  # turn 1's prompt (7 blocks)
    matches.observe(blocks(history), 4)  # turn 1 matched the system prompt
    answer = [600] * 64  # turn 1's answer, cached with its prompt: 11 blocks

    turn2 = history + answer + [700] * 32
    # Turn 2's match ends at the end of turn 1's answer, which no prompt continued past.
    assert matches.observe(blocks(turn2), 11) is False
    # A turn 3 matching turn 2's history: private too, each turn's end is new.
    turn3 = turn2 + [800] * 64 + [900] * 32  # turn 2's prompt and answer: 17 blocks
    assert matches.observe(blocks(turn3), 17) is False


def test_a_turn_matching_only_its_previous_prompt_is_private() -> None:
    # The previous turn's answer was evicted (a pool frees a request's last blocks first):
    # the match ends at the previous prompt's last block, which that prompt did not continue past.
    matches = SharedMatches(window=100)
    system = list(range(3, 3 + 16 * 4))
    history = system + [500] * 48  # 7 blocks
    matches.observe(blocks(history), 4)

    assert matches.observe(blocks(history + [600] * 64 + [700] * 32), 7) is False


def test_two_matches_ending_at_the_same_block_are_shared() -> None:
    matches = SharedMatches(window=100)
    prompt = blocks(DOCUMENT + question(1))

    assert matches.observe(prompt, 10) is False  # all 10 full blocks cached: nothing to fork from
    assert matches.observe(prompt, 10) is True


def test_a_match_is_shared_only_within_the_window() -> None:
    matches = SharedMatches(window=3)
    matches.observe(blocks(DOCUMENT + question(1)), 0)
    for n in range(3):
        matches.observe(blocks([20_000 + n] * 32), 0)  # 3 unrelated prompts

    # The first question was 4 requests ago: too long.
    assert matches.observe(blocks(DOCUMENT + question(2)), 8) is False
    # The second one's match end is fresh again: shared for a third within the window.
    assert matches.observe(blocks(DOCUMENT + question(3)), 8) is True


def test_no_match_is_never_shared() -> None:
    matches = SharedMatches(window=10)
    prompt = blocks(DOCUMENT)

    assert matches.observe(prompt, 0) is False
    assert matches.observe(prompt, 0) is False


def test_memory_holds_about_two_windows_of_new_blocks() -> None:
    matches = SharedMatches(window=10)

    for n in range(1000):
        matches.observe(blocks([10_000 + n] * 48 + [1]), 0)  # 3 full blocks each, 2 continued past
        assert len(matches) <= 2 * (2 * 10 + 1)  # two blocks a request, about two windows of requests
    # Forgetting drops only blocks seen more than a window ago.
    assert matches.observe(blocks([10_000 + 995] * 48 + [2]), 2) is True


@pytest.mark.parametrize("window", [0, -1, 2.5, True, None])
def test_rejects_a_window_that_is_not_a_positive_integer(window: object) -> None:
    with pytest.raises(ValueError, match="shared_match_window"):
        SharedMatches(window, name="shared_match_window")  # type: ignore[arg-type]
