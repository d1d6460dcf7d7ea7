"""Generated shared prefixes (SGLang's ``generated-shared-prefix`` shape).

``num_groups`` system prompts of ``system_prompt_len`` tokens; each request
is one group's system prompt followed by its own question.  Groups are drawn
with Zipf popularity (exponent 0: uniform), or, with ``prompts_per_group``,
each group gets exactly that many requests in a random order (SGLang's
groups x prompts; ``num_requests`` must then be their product).  With
``num_tenants`` > 0, group ``g`` belongs to tenant ``g % num_tenants`` and
carries its cache salt.

A fleet serving these prompts for long holds the popular prefixes already;
a run that starts with empty caches would measure every group's first
prefill.  So ``warmup_per_group x num_groups`` requests, drawn the same way,
come first as a warm-up: served, but marked ``measured=False``.  The
``num_requests`` measured ones follow.
"""

from __future__ import annotations

import numpy as np

from kvserve.experiments.workloads.arrivals import arrival_times, zipf_probabilities
from kvserve.experiments.workloads.checks import check_vocab_size
from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.tokens import TokenSegments, random_tokens, shared_tokens
from kvserve.scheduler.checks import check_ints, check_numbers


def shared_prefix(
    num_requests: int,
    qps: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    num_groups: int = 64,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    zipf_exponent: float = 0.0,
    prompts_per_group: int | None = None,
    num_tenants: int = 0,
    warmup_per_group: int = 4,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """Requests sharing one of ``num_groups`` long prefixes each, after a warm-up."""
    check_ints(1, num_groups=num_groups, output_len=output_len)
    check_ints(0, system_prompt_len=system_prompt_len, question_len=question_len, num_tenants=num_tenants,
               warmup_per_group=warmup_per_group)
    check_numbers(0, zipf_exponent=zipf_exponent)
    check_vocab_size(vocab_size)
    if system_prompt_len + question_len < 1:
        raise ValueError("system_prompt_len + question_len must be >= 1: a prompt cannot be empty")
    if prompts_per_group is not None:
        check_ints(1, prompts_per_group=prompts_per_group)
    if prompts_per_group is not None and num_requests != num_groups * prompts_per_group:
        raise ValueError(
            f"num_requests ({num_requests}) must be num_groups x prompts_per_group "
            f"({num_groups} x {prompts_per_group})"
        )
    return prefix_groups(
        num_requests, qps, seed=seed, burstiness=burstiness, num_groups=num_groups,
        prefix_len=system_prompt_len, question_len=question_len, output_len=output_len,
        zipf_exponent=zipf_exponent, num_tenants=num_tenants, vocab_size=vocab_size, group_name="group",
        balanced=prompts_per_group is not None, num_warmup=warmup_per_group * num_groups,
    )


def prefix_groups(
    num_requests: int,
    qps: float,
    *,
    seed: int,
    burstiness: float,
    num_groups: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    zipf_exponent: float,
    num_tenants: int,
    vocab_size: int,
    group_name: str,
    balanced: bool = False,
    num_warmup: int = 0,
) -> list[WorkloadRequest]:
    """The shape shared by shared-prefix and document-QA workloads: prefix + question.

    ``balanced``: every group equally often (``num_requests`` and
    ``num_warmup`` multiples of ``num_groups``), in a random order, instead of
    drawn by popularity.  The first ``num_warmup`` requests are a warm-up
    (``measured=False``); ``num_requests`` measured ones follow.
    """
    if num_requests < 0 or num_warmup < 0:
        raise ValueError(f"num_requests and num_warmup must be >= 0, got {num_requests} and {num_warmup}")
    if num_groups < 1 or prefix_len < 0 or question_len < 0 or prefix_len + question_len < 1:
        raise ValueError("need num_groups >= 1 and a non-empty prompt (prefix_len + question_len >= 1)")
    if num_tenants < 0:
        raise ValueError(f"num_tenants must be >= 0, got {num_tenants}")
    content = np.random.default_rng([seed, 0])
    prefixes = [shared_tokens(content, prefix_len, vocab_size) for _ in range(num_groups)]
    if balanced:
        groups = np.concatenate([
            content.permutation(np.repeat(np.arange(num_groups), n // num_groups)) for n in (num_warmup, num_requests)
        ])
    else:
        groups = content.choice(
            num_groups, size=num_warmup + num_requests, p=zipf_probabilities(num_groups, zipf_exponent)
        )
    num_total = num_warmup + num_requests
    questions = random_tokens(content, num_total * question_len, vocab_size)
    times = arrival_times(num_total, qps, np.random.default_rng([seed, 1]), burstiness)
    requests = []
    for i in range(num_total):
        group = int(groups[i])
        question = questions[i * question_len : (i + 1) * question_len]
        requests.append(
            WorkloadRequest(
                arrival_time=float(times[i]),
                prompt_token_ids=TokenSegments((prefixes[group], question)),
                output_len=output_len,
                cache_salt=f"tenant-{group % num_tenants}" if num_tenants else None,
                group=f"{group_name}-{group}",
                measured=i >= num_warmup,
            )
        )
    return requests
