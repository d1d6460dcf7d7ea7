"""Sessions of turns whose prompts grow: the engine behind chat, agent and customer workloads.

A session starts from a base context (a system prompt, a customer's shared
documents, an agent's tool specs) and runs several turns.  Turn ``k``'s
prompt is the base, every earlier user message and answer, then the new user
message; its answer (``output_token_ids``) is what the simulated model says,
so turn ``k + 1`` can hit the cache on all of turn ``k``::

    turn 1:  [base][user 1]                         -> answer 1
    turn 2:  [base][user 1][answer 1][user 2]       -> answer 2
    turn 3:  [base][user 1][answer 1][user 2][answer 2][user 3]

Sessions start as a Poisson (or bursty) process at ``qps / mean turns``;
turns follow each other after a think time drawn uniformly from
``[0.5, 1.5] x think_time``.  The process is in its steady state from time
0, so that the rate and the distribution of history lengths do not depend
on the rate or the length of the run: sessions start from the longest
session's duration before 0, and only turns from 0 on are requests.  A
session under way at 0 thus arrives with a history no cache holds; the
turns of the first ``1.5 x think_time`` seconds (by which every session
under way has had a turn) are a warm-up, generated and served but marked
``measured=False``.  ``num_requests`` measured turns follow, and the
warm-up turns come on top.  Contents come from their own random stream.

Reaching the steady state costs turns that grow with the rate, not with
``num_requests``: about ``qps x 1.5 x think_time x (max_turns + 1)`` are
generated before the measured ones.  A stream that needs more than
``MAX_GENERATED_TURNS`` in all is refused with a ``ValueError`` instead of
generating without end (or until memory runs out), and one that generates
more than twice its expected count stops with one (at a tiny burstiness,
sessions start in bursts of millions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvserve.experiments.workloads.arrivals import arrival_times, check_rate
from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.tokens import TokenSegments, random_tokens
from kvserve.scheduler.checks import check_numbers

# The most turns a stream may generate, its steady state's included: about two
# minutes of generating here (multi_turn: 165k turns in 4 s), and hours to
# simulate the requests among them.
MAX_GENERATED_TURNS = 5_000_000


def session_requests(
    num_requests: int,
    qps: float,
    *,
    seed: int,
    burstiness: float,
    base_contexts: Sequence[TokenSegments],
    context_probabilities: np.ndarray,
    min_turns: int,
    max_turns: int,
    user_len: int,
    answer_len: int,
    think_time: float,
    vocab_size: int,
    group_name: str,
) -> list[WorkloadRequest]:
    """``num_requests`` turns of sessions over ``base_contexts``, sorted by arrival."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    if user_len < 1 or answer_len < 1:
        raise ValueError("user_len and answer_len must be >= 1")
    # NOTE: an infinite think time would start sessions at -inf and never end the loop below.
    check_numbers(0, think_time=think_time)
    check_rate(qps, burstiness)
    expected = _check_generated_turns(num_requests, qps, think_time, max_turns)
    # Chance stays far below this (10,000 of slack for short streams, whose counts vary most).
    most_generated = 2 * expected + 10_000
    content = np.random.default_rng([seed, 0])
    timing = np.random.default_rng([seed, 1])
    mean_turns = (min_turns + max_turns) / 2
    session_rate = qps / mean_turns
    turn_len = user_len + answer_len
    warmup = 1.5 * think_time
    timed: list[tuple[float, int, WorkloadRequest]] = []
    measured_times: list[float] = []
    session = 0
    num_generated = 0
    start = -1.5 * think_time * max_turns
    # Sessions are generated in start order until none can add a turn before
    # the num_requests-th measured one (every turn of a session is after its start).
    cutoff = float("inf") if num_requests else warmup
    while start <= cutoff:
        context_id = int(content.choice(len(base_contexts), p=context_probabilities))
        num_turns = int(content.integers(min_turns, max_turns + 1))
        num_generated += num_turns
        if num_generated > most_generated:
            # NOTE: far beyond chance for a Poisson process.  At a tiny
            # burstiness nearly every gap is 0: sessions start in bursts of
            # millions, and time moves on only between them.
            raise ValueError(
                f"the stream generated {num_generated:,} turns, more than twice the {expected:,.0f} expected, "
                f"before its last measured one: at burstiness {burstiness:g} sessions start in bursts too large; "
                "a larger burstiness, fewer requests or a lower rate"
            )
        base = base_contexts[context_id]
        # The session's messages, user and answer alternating, in one array:
        # the history before turn k is its first k * turn_len tokens.
        messages = memoryview(random_tokens(content, num_turns * turn_len, vocab_size))
        arrival = start
        for turn in range(num_turns):
            if 0.0 <= arrival <= cutoff:
                offset = turn * turn_len
                request = WorkloadRequest(
                    arrival_time=arrival,
                    prompt_token_ids=base + messages[: offset + user_len],
                    output_len=answer_len,
                    output_token_ids=messages[offset + user_len : offset + turn_len],
                    group=f"{group_name}-{context_id}/session-{session}",
                    measured=arrival >= warmup,
                )
                timed.append((arrival, len(timed), request))
                if request.measured:
                    measured_times.append(arrival)
            arrival += think_time * float(timing.uniform(0.5, 1.5))
        session += 1
        start += float(arrival_times(1, session_rate, timing, burstiness)[0])
        if num_requests and len(measured_times) >= num_requests and session % 64 == 0:
            # NOTE: every 64 sessions, not every one: the n-th time costs O(n).
            times = np.array(measured_times)
            cutoff = float(np.partition(times, num_requests - 1)[num_requests - 1])
    timed.sort(key=lambda item: (item[0], item[1]))
    requests = [request for arrival, _, request in timed if arrival <= cutoff]
    # Equal arrival times at the cutoff could keep one measured turn too many.
    while sum(r.measured for r in requests) > num_requests:
        requests.pop()
    return requests


def _check_generated_turns(num_requests: int, qps: float, think_time: float, max_turns: int) -> float:
    """The turns the stream means generating, about; ``ValueError`` when more than ``MAX_GENERATED_TURNS``.

    Sessions start from ``1.5 x think_time x max_turns`` seconds before 0 and
    the warm-up lasts ``1.5 x think_time`` more, at ``qps`` turns a second in
    the mean: that many turns are generated whatever ``num_requests`` is (a
    rate far too high for the think time would generate without end), and
    the ``num_requests`` measured ones on top.
    """
    warmup = 1.5 * think_time
    expected = qps * warmup * (max_turns + 1) + num_requests
    if expected > MAX_GENERATED_TURNS:
        raise ValueError(
            f"the stream needs about {expected:,.0f} turns generated: {num_requests:,} measured, "
            f"{qps * warmup:,.0f} a warm-up that is served too, and sessions start {warmup * max_turns:g} s "
            f"before 0; the limit is {MAX_GENERATED_TURNS:,}: fewer requests, a lower rate or think_time, "
            "or fewer turns per session"
        )
    return expected
