"""Replay of Mooncake-format traces (JSON lines).

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is in milliseconds; each hash id names a 512-token block, and
equal ids at equal positions mean an equal prefix.  Each id maps to its own
512 deterministic token ids (a function of the seed and the id), so requests
sharing leading ids share those prompt tokens; the last block may be partial
(``input_length`` need not be a multiple of 512).

A trace was recorded against warm caches; a replay starts cold.  The first
``warmup_fraction`` (in [0, 1)) of the replayed records (rounded down) are a warm-up:
served, but marked ``measured=False``.
"""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path

import numpy as np

from kvserve.experiments.report import count
from kvserve.experiments.workloads.checks import check_vocab_size
from kvserve.experiments.workloads.request import WorkloadRequest
from kvserve.experiments.workloads.tokens import TokenSegments, random_tokens
from kvserve.scheduler.checks import check_ints, check_numbers

MOONCAKE_BLOCK_TOKENS = 512


def mooncake_trace(
    path: str | Path,
    *,
    num_requests: int | None = None,
    qps: float | None = None,
    seed: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    warmup_fraction: float = 0.1,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """The trace's requests in arrival order (the earliest ``num_requests`` when given).

    Arrivals start at 0; with ``qps`` they are rescaled to that mean rate,
    otherwise they keep the trace's own timing.  Raises ``ValueError`` naming
    the line of a malformed record, for a trace without records or whose
    timestamps span more than a float holds, or when ``qps`` is given for
    requests that all arrive at one instant (there is no timing to rescale).
    """
    check_ints(1, block_tokens=block_tokens)
    check_numbers(0, maximum=1, warmup_fraction=warmup_fraction)
    if warmup_fraction == 1:
        raise ValueError("warmup_fraction must be below 1: at 1 every request is a warm-up, and none is measured")
    check_vocab_size(vocab_size)
    if num_requests is not None:
        check_ints(0, num_requests=num_requests)
    if qps is not None and not (qps > 0 and math.isfinite(qps)):
        raise ValueError(f"qps must be a positive number, got {qps}")
    blocks: dict[int, array] = {}

    def block(hash_id: int) -> array:
        tokens = blocks.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng([seed, 3, hash_id])
            tokens = blocks[hash_id] = random_tokens(rng, block_tokens, vocab_size)
        return tokens

    records: list[tuple[float, int, int, list[int]]] = []
    line_number = 0
    try:
        # utf-8-sig: a byte-order mark, as some Windows tools write, is not part of the first record.
        with open(path, encoding="utf-8-sig") as trace:
            for line_number, line in enumerate(trace, 1):
                if line.strip():
                    records.append(_parse_record(line, block_tokens))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    except ValueError as exc:
        raise ValueError(f"{path}:{line_number}: not a Mooncake record: {exc}") from None
    # The earliest requests, not the first lines: a trace need not be sorted (the sort is stable).
    if not records:
        raise ValueError(f"{path} holds no records")
    records.sort(key=lambda record: record[0])
    if num_requests is not None:
        del records[num_requests:]
    if not records:
        return []
    start = records[0][0]
    times = [(timestamp - start) / 1000.0 for timestamp, _, _, _ in records]
    if not math.isfinite(times[-1]):
        raise ValueError(f"{path}: its timestamps span from {start:g} to {records[-1][0]:g} ms, too long to replay")
    if qps is not None:
        span = times[-1]
        if span == 0:
            raise ValueError(
                f"{path} has no time span to rescale to {qps:g} qps ({count(len(times), 'request')}, "
                "all at one instant): replay it as recorded"
            )
        # Mean rate = (n - 1) arrivals over the span.
        factor = (len(times) - 1) / (qps * span)
        times = [t * factor for t in times]
    num_warmup = int(warmup_fraction * len(records))
    requests = []
    for position, (arrival_time, (_, input_length, output_length, hash_ids)) in enumerate(zip(times, records)):
        segments = [block(h) for h in hash_ids]
        last_len = input_length - (len(hash_ids) - 1) * block_tokens
        if last_len < block_tokens:
            segments[-1] = segments[-1][:last_len]
        requests.append(
            WorkloadRequest(
                arrival_time=arrival_time, prompt_token_ids=TokenSegments(segments), output_len=output_length,
                group="trace", measured=position >= num_warmup,
            )
        )
    return requests


def _parse_record(line: str, block_tokens: int) -> tuple[float, int, int, list[int]]:
    """``(timestamp, input_length, output_length, hash_ids)`` of one line; ``ValueError`` if malformed."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("timestamp", "input_length", "output_length", "hash_ids") if key not in record]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    timestamp = record["timestamp"]
    try:
        finite = not isinstance(timestamp, bool) and math.isfinite(timestamp)
    except (TypeError, OverflowError):  # not a number; an integer too large for a float
        finite = False
    if not finite:
        raise ValueError(f"timestamp must be a finite number, got {_shortened(repr(timestamp))}")
    check_ints(1, input_length=record["input_length"], output_length=record["output_length"])
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError(f"hash_ids must be a list of integers >= 0, got {type(hash_ids).__name__}")
    bad = [h for h in hash_ids if isinstance(h, bool) or not isinstance(h, int) or h < 0]
    if bad:
        raise ValueError(f"hash_ids must be integers >= 0, got {bad[0]!r}")
    num_blocks = -(-record["input_length"] // block_tokens)
    if len(hash_ids) != num_blocks:
        raise ValueError(
            f"{record['input_length']} input tokens need {num_blocks} hash ids of {block_tokens} tokens, "
            f"got {len(hash_ids)}"
        )
    return float(timestamp), record["input_length"], record["output_length"], hash_ids


def _shortened(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[: limit // 2]}... ({len(text):,} characters)"
