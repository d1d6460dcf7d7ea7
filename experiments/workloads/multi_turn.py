"""Chat workloads whose histories grow turn by turn (see ``sessions``).

* ``multi_turn``: every session shares one short system prompt;
* ``customer_contexts``: llm-d's shape, customers x long shared context x
  many users: each customer (Zipf popularity) has a long shared context, and
  each of its users holds a multi-turn conversation on top of it.
"""

from __future__ import annotations

import numpy as np

from kvserve.experiments.workloads.arrivals import zipf_probabilities
from kvserve.experiments.workloads.checks import check_vocab_size
from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.sessions import session_requests
from kvserve.experiments.workloads.tokens import TokenSegments, shared_tokens
from kvserve.scheduler.checks import check_ints, check_numbers


def multi_turn(
    num_requests: int,
    qps: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    system_prompt_len: int = 256,
    min_turns: int = 2,
    max_turns: int = 10,
    user_len: int = 128,
    answer_len: int = 256,
    think_time: float = 10.0,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """Multi-turn chat sessions over one shared system prompt."""
    check_ints(0, system_prompt_len=system_prompt_len)
    check_ints(1, min_turns=min_turns, max_turns=max_turns, user_len=user_len, answer_len=answer_len)
    check_numbers(0, think_time=think_time)
    check_vocab_size(vocab_size)
    system = shared_tokens(np.random.default_rng([seed, 2]), system_prompt_len, vocab_size)
    return session_requests(
        num_requests, qps, seed=seed, burstiness=burstiness,
        base_contexts=[TokenSegments((system,))], context_probabilities=np.ones(1),
        min_turns=min_turns, max_turns=max_turns, user_len=user_len, answer_len=answer_len,
        think_time=think_time, vocab_size=vocab_size, group_name="chat",
    )


def customer_contexts(
    num_requests: int,
    qps: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    num_customers: int = 32,
    context_len: int = 4096,
    zipf_exponent: float = 1.0,
    min_turns: int = 1,
    max_turns: int = 6,
    user_len: int = 96,
    answer_len: int = 128,
    think_time: float = 10.0,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """Users' conversations on top of their customer's long shared context."""
    check_ints(0, context_len=context_len)
    check_ints(1, num_customers=num_customers, min_turns=min_turns, max_turns=max_turns, user_len=user_len,
               answer_len=answer_len)
    check_numbers(0, zipf_exponent=zipf_exponent, think_time=think_time)
    check_vocab_size(vocab_size)
    rng = np.random.default_rng([seed, 2])
    contexts = [TokenSegments((shared_tokens(rng, context_len, vocab_size),)) for _ in range(num_customers)]
    return session_requests(
        num_requests, qps, seed=seed, burstiness=burstiness,
        base_contexts=contexts, context_probabilities=zipf_probabilities(num_customers, zipf_exponent),
        min_turns=min_turns, max_turns=max_turns, user_len=user_len, answer_len=answer_len,
        think_time=think_time, vocab_size=vocab_size, group_name="customer",
    )
