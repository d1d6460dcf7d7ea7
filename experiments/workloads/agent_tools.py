"""Agent loops: a shared system prompt, one tool's spec (Zipf popularity), then steps.

Each task starts from the agent's system prompt and the spec of the tool it
uses (popular tools are shared by many tasks), then alternates observations
(the "user" message: the task, then each tool result) and actions (the
model's answer) for a few steps, a short think time apart (the tool call).
"""

from __future__ import annotations

import numpy as np

from kvserve.experiments.workloads.arrivals import zipf_probabilities
from kvserve.experiments.workloads.checks import check_vocab_size
from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.sessions import session_requests
from kvserve.experiments.workloads.tokens import TokenSegments, shared_tokens
from kvserve.scheduler.checks import check_ints, check_numbers


def agent_tools(
    num_requests: int,
    qps: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    system_prompt_len: int = 1024,
    num_tools: int = 64,
    tool_spec_len: int = 768,
    zipf_exponent: float = 1.1,
    min_steps: int = 2,
    max_steps: int = 6,
    observation_len: int = 192,
    action_len: int = 64,
    think_time: float = 1.0,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """Agent tasks of several steps over Zipf-popular tools."""
    check_ints(0, system_prompt_len=system_prompt_len, tool_spec_len=tool_spec_len)
    check_ints(1, num_tools=num_tools, min_steps=min_steps, max_steps=max_steps, observation_len=observation_len,
               action_len=action_len)
    check_numbers(0, zipf_exponent=zipf_exponent, think_time=think_time)
    check_vocab_size(vocab_size)
    if min_steps > max_steps:
        raise ValueError(f"need min_steps <= max_steps, got {min_steps}, {max_steps}")
    rng = np.random.default_rng([seed, 2])
    system = shared_tokens(rng, system_prompt_len, vocab_size)
    contexts = [
        TokenSegments((system, shared_tokens(rng, tool_spec_len, vocab_size))) for _ in range(num_tools)
    ]
    return session_requests(
        num_requests, qps, seed=seed, burstiness=burstiness,
        base_contexts=contexts, context_probabilities=zipf_probabilities(num_tools, zipf_exponent),
        min_turns=min_steps, max_turns=max_steps, user_len=observation_len, answer_len=action_len,
        think_time=think_time, vocab_size=vocab_size, group_name="tool",
    )
