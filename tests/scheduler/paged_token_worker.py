"""A stand-in for the GPU workers that keeps a real paged 'KV cache' of tokens.

It follows the ``StepPlan`` contract exactly: per-request block tables built
from ``new_block_ids``, state dropped for finished and preempted requests.
Each computed token is written into its slot; a sampled token is a function
of the whole context *read back through the block table*.  So if the
scheduler or the cache manager hands out a wrong block table, shares a block
it should not, or loses a token, the outputs differ from ``reference_generate``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.scheduler.step_plan import StepPlan

VOCAB_SIZE = 50
EOS_TOKEN_ID = 0


def next_token(context: Sequence[int]) -> int:
    acc = 0
    for position, token in enumerate(context):
        acc = (acc * 1_000_003 + (position + 1) * (token + 7)) % 2_147_483_647
    return acc % VOCAB_SIZE


def reference_generate(prompt: Sequence[int], max_tokens: int, stop: frozenset[int] = frozenset()) -> list[int]:
    tokens = list(prompt)
    output: list[int] = []
    while len(output) < max_tokens:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if token in stop:
            break
    return output


class PagedTokenWorker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.block_tables: dict[str, list[int]] = {}
        self.num_prefill_tokens = 0

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan) -> list[int]:
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            self.block_tables.pop(req_id, None)
        for new in plan.new_requests:
            self.block_tables[new.req_id] = []
        sampled: list[int] = []
        for row in plan:
            table = self.block_tables[row.req_id]
            table.extend(row.new_block_ids)
            for offset, token in enumerate(row.token_ids):
                self.slots[self._slot(table, row.start_position + offset)] = token
            if len(row.token_ids) > 1 or not row.sample:
                self.num_prefill_tokens += len(row.token_ids)
            if row.sample:
                end = row.start_position + len(row.token_ids)
                context = [self.slots[self._slot(table, p)] for p in range(end)]
                assert None not in context, f"{row.req_id} read an unwritten slot"
                sampled.append(next_token(context))  # type: ignore[arg-type]
        return sampled
