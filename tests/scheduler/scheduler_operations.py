"""Random sequences of scheduler operations (hypothesis), for properties checked after each one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan

# Each operation: ("add", prompt, max_tokens) | ("step", num_steps) | ("abort", which) | ("abort_in_flight", which)
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(0, 2), min_size=1, max_size=20),
            st.integers(1, 8),
        ),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("abort_in_flight"), st.integers(0, 1000)),
    ),
    max_size=40,
)

# Small schedulers whose pools preempt: keyword arguments of scheduler_config, and num_blocks.
SHAPES = {
    "budget": st.integers(2, 16),
    "max_num_seqs": st.integers(1, 4),
    "num_blocks": st.integers(6, 12),
    "chunk": st.none() | st.integers(1, 6),
}


def scheduler_config(budget: int, max_num_seqs: int, chunk: int | None) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=32, long_prefill_token_threshold=chunk
    )


def run_operations(
    scheduler: Scheduler,
    operations: list[tuple],
    check: Callable[[StepPlan | None], None],
    tenants: Sequence[str | None] = (None,),
) -> None:
    """Apply ``operations``; ``check(plan)`` while a step is in flight, ``check(None)`` after each operation.

    The requests added are of ``tenants`` in turn.
    """
    num_added = 0
    for operation in operations:
        kind = operation[0]
        if kind == "add":
            request = Request(
                f"r{num_added}", operation[1], SamplingParams(max_tokens=operation[2], ignore_eos=True),
                tenant=tenants[num_added % len(tenants)],
            )
            if num_added % 2:  # as a router would: hashes filled before queueing
                request.block_hashes.extend(scheduler.kv_cache_manager.hasher.hash_token_ids(operation[1]))
            num_added += 1
            try:
                scheduler.add_request(request)
            except ValueError:
                pass  # too big for the pool: rejected, nothing changes
        elif kind == "step":
            for _ in range(operation[1]):
                plan = scheduler.schedule()
                check(plan)
                scheduler.update(plan, [7] * plan.num_sampled)
        elif kind == "abort" and scheduler.requests:
            ids = sorted(scheduler.requests)
            scheduler.abort_requests([ids[operation[1] % len(ids)]])
        elif kind == "abort_in_flight":
            plan = scheduler.schedule()
            if plan.req_ids:
                scheduler.abort_requests([plan.req_ids[operation[1] % len(plan.req_ids)]])
            check(plan)  # the step still computes them
            scheduler.update(plan, [7] * plan.num_sampled)
        check(None)
