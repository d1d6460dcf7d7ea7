"""Replay of Mooncake-format traces (JSON lines).

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is in milliseconds; each hash id names a 512-token block, and
equal ids at equal positions mean an equal prefix.  Each id maps to its own
512 deterministic token ids (a function of the seed and the id), so requests
sharing leading ids share those prompt tokens; the last block may be partial
(``input_length`` need not be a multiple of 512).
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import numpy as np

from kvserve.bench.workloads.request import WorkloadRequest
from kvserve.bench.workloads.tokens import TokenSegments, random_tokens

MOONCAKE_BLOCK_TOKENS = 512


def mooncake_trace(
    path: str | Path,
    *,
    num_requests: int | None = None,
    qps: float | None = None,
    seed: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """The trace's requests in arrival order (the first ``num_requests`` when given).

    Arrivals start at 0; with ``qps`` they are rescaled to that mean rate,
    otherwise they keep the trace's own timing.  Raises ``ValueError`` naming
    the line of a malformed record.
    """
    blocks: dict[int, array] = {}

    def block(hash_id: int) -> array:
        tokens = blocks.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng([seed, 3, hash_id])
            tokens = blocks[hash_id] = random_tokens(rng, block_tokens, vocab_size)
        return tokens

    rows: list[tuple[float, TokenSegments, int]] = []
    with open(path, encoding="utf-8") as trace:
        for line_number, line in enumerate(trace, 1):
            if not line.strip():
                continue
            if num_requests is not None and len(rows) >= num_requests:
                break
            try:
                record = json.loads(line)
                timestamp = float(record["timestamp"])
                input_length = int(record["input_length"])
                output_length = int(record["output_length"])
                hash_ids = [int(h) for h in record["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_number}: not a Mooncake record: {exc}") from None
            if input_length < 1 or output_length < 1:
                raise ValueError(f"{path}:{line_number}: input_length and output_length must be >= 1")
            num_blocks = -(-input_length // block_tokens)
            if len(hash_ids) != num_blocks:
                raise ValueError(
                    f"{path}:{line_number}: {input_length} input tokens need {num_blocks} hash ids "
                    f"of {block_tokens} tokens, got {len(hash_ids)}"
                )
            segments = [block(h) for h in hash_ids]
            last_len = input_length - (num_blocks - 1) * block_tokens
            if last_len < block_tokens:
                segments[-1] = segments[-1][:last_len]
            rows.append((timestamp, TokenSegments(segments), output_length))
    if not rows:
        return []
    rows.sort(key=lambda row: row[0])
    start = rows[0][0]
    times = [(timestamp - start) / 1000.0 for timestamp, _, _ in rows]
    if qps is not None:
        if not qps > 0:
            raise ValueError(f"qps must be > 0, got {qps}")
        span = times[-1]
        # Mean rate = (n - 1) arrivals over the span; a single instant trace keeps its times.
        if span > 0 and len(times) > 1:
            factor = (len(times) - 1) / (qps * span)
            times = [t * factor for t in times]
    return [
        WorkloadRequest(arrival_time=t, prompt_token_ids=prompt, output_len=output_len, group="trace")
        for t, (_, prompt, output_len) in zip(times, rows)
    ]
