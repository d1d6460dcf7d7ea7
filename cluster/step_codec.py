"""The step protocol's conversions: scheduler dataclasses <-> ``step_pb2`` messages.

This is the only module that knows both sides of the scheduler <-> worker
boundary.  Integer columns travel as little-endian packed arrays (``int32``;
``sample`` as one ``uint8`` per request, logprobs as ``float32``), so a step
of 256 decodes is a handful of ``bytes`` fields instead of thousands of
varints; so are a result's logprobs (``StepLogprobs``' columns).  New
requests are columns too, their sampling parameters sent once per distinct
value (a plan of 256 new requests is not 256 sub-messages).
Decoding validates the message against itself (every column has one
entry per request, the flattened columns add up) and raises ``ValueError``
naming the field, so a worker never indexes past the end of a column.

``SamplingParams.stop_token_ids`` and ``ignore_eos`` are not sent: stopping is
decided by the scheduler, workers only sample (a request with ``min_tokens``
brings its stop tokens in ``NewRequestData.stop_token_ids``, to be held back;
one with a repetition penalty its whole prompt in ``prompt_token_ids``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from kvserve.proto import step_pb2
from kvserve.scheduler.logprobs import StepLogprobs, StepPromptLogprobs
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import NewRequestData, StepPlan
from kvserve.scheduler.step_result import StepResult

_INT32 = np.dtype("<i4")
_UINT8 = np.dtype("u1")
_FLOAT32 = np.dtype("<f4")
_FLOAT64 = np.dtype("<f8")


# -- sampling parameters ----------------------------------------------------------


def encode_sampling_params(params: SamplingParams) -> step_pb2.WireSamplingParams:
    wire = step_pb2.WireSamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or 0,
        min_p=params.min_p,
    )
    if params.seed is not None:
        wire.seed = params.seed
    if params.logprobs is not None:
        wire.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        wire.prompt_logprobs = params.prompt_logprobs
    # Logits adjustments: the proto3 defaults (0, empty) are their neutral values.
    wire.presence_penalty = params.presence_penalty
    wire.frequency_penalty = params.frequency_penalty
    wire.min_tokens = params.min_tokens
    if params.repetition_penalty != 1.0:
        wire.repetition_penalty = params.repetition_penalty
    if params.logit_bias:
        token_ids, biases = zip(*params.logit_bias)
        wire.logit_bias_token_ids = _pack_int32(token_ids)
        wire.logit_bias_values = _pack_float64(biases)
    return wire


def decode_sampling_params(wire: step_pb2.WireSamplingParams) -> SamplingParams:
    """The worker's view of a request's sampling parameters (no stop conditions)."""
    bias_token_ids = _unpack(wire.logit_bias_token_ids, "logit_bias_token_ids", _INT32)
    biases = _unpack(wire.logit_bias_values, "logit_bias_values", _FLOAT64)
    if bias_token_ids.size != biases.size:
        raise ValueError(
            f"logit_bias_token_ids has {bias_token_ids.size} entries for {biases.size} logit_bias_values"
        )
    return SamplingParams(
        max_tokens=wire.max_tokens,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k or None,
        min_p=wire.min_p,
        seed=wire.seed if wire.HasField("seed") else None,
        logprobs=wire.logprobs if wire.HasField("logprobs") else None,
        prompt_logprobs=wire.prompt_logprobs if wire.HasField("prompt_logprobs") else None,
        presence_penalty=wire.presence_penalty,
        frequency_penalty=wire.frequency_penalty,
        logit_bias=tuple(zip(bias_token_ids.tolist(), biases.tolist())),
        min_tokens=wire.min_tokens,
        repetition_penalty=wire.repetition_penalty if wire.HasField("repetition_penalty") else 1.0,
    )


# -- step plans ---------------------------------------------------------------------


def encode_plan(plan: StepPlan) -> step_pb2.StepPlan:
    """The wire form of ``plan``; encode once and send the same message to every rank."""
    message = step_pb2.StepPlan(
        step_id=plan.step_id,
        req_ids=plan.req_ids,
        num_scheduled_tokens=_pack_int32(plan.num_scheduled_tokens),
        num_computed_tokens=_pack_int32(plan.num_computed_tokens),
        token_ids=_pack_int32(plan.token_ids),
        num_new_block_ids=_pack_int32(plan.num_new_block_ids),
        new_block_ids=_pack_int32(plan.new_block_ids),
        sample=bytes(plan.sample),  # one byte, 0 or 1, per bool
        finished_req_ids=plan.finished_req_ids,
        preempted_req_ids=plan.preempted_req_ids,
    )
    if plan.placeholder_rows:
        message.placeholder_rows = _pack_int32(plan.placeholder_rows)
    if plan.prompt_logprobs_rows:
        message.prompt_logprobs_rows = _pack_int32(plan.prompt_logprobs_rows)
        message.next_prompt_token_ids = _pack_int32(plan.next_prompt_token_ids)
    if plan.new_requests:
        _encode_new_requests(plan.new_requests, message.new_requests)
    return message


def decode_plan(message: step_pb2.StepPlan) -> StepPlan:
    """The ``StepPlan`` carried by ``message``; ``ValueError`` names the first bad field."""
    num_reqs = len(message.req_ids)
    num_scheduled = _unpack_column(message, "num_scheduled_tokens", num_reqs)
    num_computed = _unpack_column(message, "num_computed_tokens", num_reqs)
    num_new_blocks = _unpack_column(message, "num_new_block_ids", num_reqs)
    sample = _unpack_column(message, "sample", num_reqs, _UINT8)
    token_ids = _unpack(message.token_ids, "token_ids", _INT32)
    new_block_ids = _unpack(message.new_block_ids, "new_block_ids", _INT32)
    int32_columns = {
        "num_scheduled_tokens": num_scheduled,
        "num_computed_tokens": num_computed,
        "num_new_block_ids": num_new_blocks,
        "token_ids": token_ids,
        "new_block_ids": new_block_ids,
    }
    # NOTE: one reduction over all of them (each call costs microseconds); the column by name on failure.
    every_value = np.concatenate(list(int32_columns.values()))
    if every_value.size and every_value.min() < 0:
        for name, column in int32_columns.items():
            _check_non_negative(name, column)
    if sample.size and sample.max() > 1:
        raise ValueError(f"sample must hold 0 or 1 per request, got {int(sample.max())}")
    _check_total("token_ids", token_ids.size, "num_scheduled_tokens", num_scheduled)
    _check_total("new_block_ids", new_block_ids.size, "num_new_block_ids", num_new_blocks)
    placeholder_rows = _decode_placeholder_rows(message.placeholder_rows, num_scheduled, sample)
    prompt_logprobs_rows = _unpack(message.prompt_logprobs_rows, "prompt_logprobs_rows", _INT32)
    _check_increasing_rows("prompt_logprobs_rows", prompt_logprobs_rows, num_reqs)
    next_prompt_token_ids = _unpack(message.next_prompt_token_ids, "next_prompt_token_ids", _INT32)
    _check_non_negative("next_prompt_token_ids", next_prompt_token_ids)
    if next_prompt_token_ids.size > prompt_logprobs_rows.size:
        raise ValueError(f"next_prompt_token_ids has {next_prompt_token_ids.size} entries for "
                         f"{prompt_logprobs_rows.size} prompt_logprobs_rows")
    return StepPlan(
        step_id=message.step_id,
        req_ids=list(message.req_ids),
        num_scheduled_tokens=num_scheduled.tolist(),
        num_computed_tokens=num_computed.tolist(),
        token_ids=token_ids.tolist(),
        num_new_block_ids=num_new_blocks.tolist(),
        new_block_ids=new_block_ids.tolist(),
        sample=sample.astype(bool).tolist(),
        # NOTE: most steps bring no new request: an unset field skips its (empty) columns.
        new_requests=_decode_new_requests(message.new_requests) if message.HasField("new_requests") else [],
        finished_req_ids=list(message.finished_req_ids),
        preempted_req_ids=list(message.preempted_req_ids),
        placeholder_rows=placeholder_rows,
        prompt_logprobs_rows=prompt_logprobs_rows.tolist(),
        next_prompt_token_ids=next_prompt_token_ids.tolist(),
    )


def _decode_placeholder_rows(data: bytes, num_scheduled: np.ndarray, sample: np.ndarray) -> list[int]:
    """The placeholder rows: increasing, each a sampled row of one token; ``ValueError`` otherwise."""
    if not data:
        return []
    rows = _unpack(data, "placeholder_rows", _INT32)
    if rows.min() < 0 or rows.max() >= num_scheduled.size or (rows.size > 1 and np.diff(rows).min() <= 0):
        raise ValueError(f"placeholder_rows must be increasing rows of the plan's {num_scheduled.size}, got {rows.tolist()}")
    if (num_scheduled[rows] != 1).any() or not sample[rows].all():
        raise ValueError("placeholder_rows must name rows of one sampled token")
    return rows.tolist()


def _encode_new_requests(new_requests: list[NewRequestData], message: step_pb2.NewRequests) -> None:
    # NOTE: the requests of one plan mostly share their sampling parameters:
    # each distinct value travels (and is converted) once.
    index_of: dict[tuple, int] = {}
    indices = []
    for new in new_requests:
        params = new.sampling_params
        key = (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.logprobs,
               params.presence_penalty, params.frequency_penalty, params.logit_bias, params.min_tokens,
               params.prompt_logprobs, params.repetition_penalty, params.min_p)
        index = index_of.get(key)
        if index is None:
            index = index_of[key] = len(index_of)
            message.sampling_params.append(encode_sampling_params(params))
        indices.append(index)
    message.req_ids.extend([new.req_id for new in new_requests])
    message.num_prompt_tokens = _pack_int32([new.num_prompt_tokens for new in new_requests])
    message.sampling_params_index = _pack_int32(indices)
    # NOTE: only logits adjustments need these: most plans leave both pairs of columns empty.
    if any(new.output_token_ids for new in new_requests):
        message.num_output_token_ids = _pack_int32([len(new.output_token_ids) for new in new_requests])
        message.output_token_ids = _pack_int32([t for new in new_requests for t in new.output_token_ids])
    if any(new.stop_token_ids for new in new_requests):
        message.num_stop_token_ids = _pack_int32([len(new.stop_token_ids) for new in new_requests])
        message.stop_token_ids = _pack_int32([t for new in new_requests for t in new.stop_token_ids])
    if any(new.prompt_token_ids for new in new_requests):
        message.num_prompt_token_ids = _pack_int32([len(new.prompt_token_ids) for new in new_requests])
        message.prompt_token_ids = _pack_int32([t for new in new_requests for t in new.prompt_token_ids])


def _decode_new_requests(message: step_pb2.NewRequests) -> list[NewRequestData]:
    req_ids = list(message.req_ids)
    num_prompt_tokens = _unpack_column(message, "num_prompt_tokens", len(req_ids), label="new_requests.")
    indices = _unpack_column(message, "sampling_params_index", len(req_ids), label="new_requests.")
    _check_non_negative("new_requests.num_prompt_tokens", num_prompt_tokens)
    params = []
    for i, wire in enumerate(message.sampling_params):
        try:
            params.append(decode_sampling_params(wire))
        except ValueError as exc:
            raise ValueError(f"new_requests.sampling_params[{i}]: {exc}") from None
    if indices.size and not 0 <= int(indices.min()) <= int(indices.max()) < len(params):
        bad = int(indices.min()) if indices.min() < 0 else int(indices.max())
        raise ValueError(
            f"new_requests.sampling_params_index holds {bad}, but there are {len(params)} sampling_params"
        )
    output_token_ids = _flat_column_per_request(message, "output_token_ids", len(req_ids))
    stop_token_ids = _flat_column_per_request(message, "stop_token_ids", len(req_ids))
    prompt_token_ids = _flat_column_per_request(message, "prompt_token_ids", len(req_ids))
    num_prompt_tokens_list = num_prompt_tokens.tolist()
    if message.num_prompt_token_ids:
        for i, (prompt, num_prompt) in enumerate(zip(prompt_token_ids, num_prompt_tokens_list)):
            if prompt and len(prompt) != num_prompt:
                raise ValueError(f"new_requests.num_prompt_token_ids[{i}] is {len(prompt)}: a request sends its "
                                 f"whole prompt (num_prompt_tokens {num_prompt}) or none")
    return [
        NewRequestData(req_id, params[index], num_prompt, outputs, stops, prompt)
        for req_id, index, num_prompt, outputs, stops, prompt in zip(
            req_ids, indices.tolist(), num_prompt_tokens_list, output_token_ids, stop_token_ids, prompt_token_ids
        )
    ]


def _flat_column_per_request(message: step_pb2.NewRequests, name: str, num_reqs: int) -> list[tuple[int, ...]]:
    """The flat int32 column ``name``, cut per request by ``num_<name>`` (both empty: nothing for any)."""
    counts_name = f"num_{name}"
    if not getattr(message, counts_name) and not getattr(message, name):
        return [()] * num_reqs
    counts = _unpack_column(message, counts_name, num_reqs, label="new_requests.")
    values = _unpack(getattr(message, name), f"new_requests.{name}", _INT32)
    _check_non_negative(f"new_requests.{counts_name}", counts)
    _check_non_negative(f"new_requests.{name}", values)
    _check_total(f"new_requests.{name}", values.size, f"new_requests.{counts_name}", counts)
    values_list = values.tolist()
    parts, start = [], 0
    for count in counts.tolist():
        parts.append(tuple(values_list[start : start + count]))
        start += count
    return parts


# -- step results -------------------------------------------------------------------


def encode_result(step_id: int, result: StepResult | None) -> step_pb2.StepResult:
    """Rank 0's samples, or (``result`` ``None``) the empty answer of the other ranks."""
    if result is None:
        return step_pb2.StepResult(step_id=step_id, has_samples=False)
    message = step_pb2.StepResult(
        step_id=result.step_id,
        sampled_token_ids=_pack_int32(result.sampled_token_ids),
        has_samples=True,
    )
    logprobs = result.logprobs
    if logprobs is not None:
        message.logprob_rows = _pack_int32(logprobs.rows)
        message.token_logprobs = _pack_float32(logprobs.token_logprobs)
        message.num_top_logprobs = _pack_int32(logprobs.num_top)
        message.top_token_ids = _pack_int32(logprobs.top_token_ids)
        message.top_logprobs = _pack_float32(logprobs.top_logprobs)
    prompt = result.prompt_logprobs
    if prompt is not None:
        message.prompt_logprobs.CopyFrom(step_pb2.PromptLogprobs(
            rows=_pack_int32(prompt.rows),
            num_positions=_pack_int32(prompt.num_positions),
            num_top=_pack_int32(prompt.num_top),
            token_logprobs=_pack_float32(prompt.token_logprobs),
            top_token_ids=_pack_int32(prompt.top_token_ids),
            top_logprobs=_pack_float32(prompt.top_logprobs),
        ))
    return message


def decode_result(message: step_pb2.StepResult) -> StepResult | None:
    """The samples of ``message``; ``None`` for a rank that does not sample."""
    if not message.has_samples:
        return None
    token_ids = _unpack(message.sampled_token_ids, "sampled_token_ids", _INT32)
    prompt_logprobs = _decode_prompt_logprobs(message.prompt_logprobs) if message.HasField("prompt_logprobs") else None
    return StepResult(message.step_id, token_ids.tolist(), _decode_logprobs(message, token_ids.size), prompt_logprobs)


def _decode_prompt_logprobs(message: step_pb2.PromptLogprobs) -> StepPromptLogprobs:
    label = "prompt_logprobs."
    rows = _unpack(message.rows, label + "rows", _INT32)
    num_positions = _unpack(message.num_positions, label + "num_positions", _INT32)
    num_top = _unpack(message.num_top, label + "num_top", _INT32)
    for name, column in (("num_positions", num_positions), ("num_top", num_top)):
        if column.size != rows.size:
            raise ValueError(f"{label}{name} has {column.size} entries for {rows.size} {label}rows")
    token_logprobs = _unpack(message.token_logprobs, label + "token_logprobs", _FLOAT32)
    top_token_ids = _unpack(message.top_token_ids, label + "top_token_ids", _INT32)
    top_logprobs = _unpack(message.top_logprobs, label + "top_logprobs", _FLOAT32)
    _check_increasing_rows(label + "rows", rows, None)
    _check_non_negative(label + "num_positions", num_positions)
    _check_non_negative(label + "num_top", num_top)
    _check_total(label + "token_logprobs", token_logprobs.size, label + "num_positions", num_positions)
    num_alternatives = num_positions.astype(np.int64) * num_top
    _check_total(label + "top_token_ids", top_token_ids.size, label + "num_positions x num_top", num_alternatives)
    if top_logprobs.size != top_token_ids.size:
        raise ValueError(f"{label}top_logprobs has {top_logprobs.size} entries but top_token_ids has "
                         f"{top_token_ids.size}")
    return StepPromptLogprobs(
        rows=rows.tolist(),
        num_positions=num_positions.tolist(),
        num_top=num_top.tolist(),
        token_logprobs=token_logprobs.tolist(),
        top_token_ids=top_token_ids.tolist(),
        top_logprobs=top_logprobs.tolist(),
    )


def _check_increasing_rows(name: str, rows: np.ndarray, num_reqs: int | None) -> None:
    """``ValueError`` unless ``rows`` increase from 0 on (and stay below ``num_reqs`` when given)."""
    if rows.size and (rows.min() < 0 or (num_reqs is not None and rows.max() >= num_reqs) or (np.diff(rows) <= 0).any()):
        bound = f"[0, {num_reqs})" if num_reqs is not None else "[0, ...)"
        raise ValueError(f"{name} must increase within {bound}, got {rows.tolist()}")


def _decode_logprobs(message: step_pb2.StepResult, num_sampled: int) -> StepLogprobs | None:
    rows = _unpack(message.logprob_rows, "logprob_rows", _INT32)
    token_logprobs = _unpack(message.token_logprobs, "token_logprobs", _FLOAT32)
    num_top = _unpack(message.num_top_logprobs, "num_top_logprobs", _INT32)
    top_token_ids = _unpack(message.top_token_ids, "top_token_ids", _INT32)
    top_logprobs = _unpack(message.top_logprobs, "top_logprobs", _FLOAT32)
    if not rows.size and not (token_logprobs.size or num_top.size or top_token_ids.size or top_logprobs.size):
        return None
    for name, column in (("token_logprobs", token_logprobs), ("num_top_logprobs", num_top)):
        if column.size != rows.size:
            raise ValueError(f"{name} has {column.size} entries for {rows.size} logprob_rows")
    _check_increasing_rows("logprob_rows", rows, num_sampled)
    _check_non_negative("num_top_logprobs", num_top)
    _check_total("top_token_ids", top_token_ids.size, "num_top_logprobs", num_top)
    if top_logprobs.size != top_token_ids.size:
        raise ValueError(f"top_logprobs has {top_logprobs.size} entries but top_token_ids has {top_token_ids.size}")
    return StepLogprobs(
        rows=rows.tolist(),
        token_logprobs=token_logprobs.tolist(),
        num_top=num_top.tolist(),
        top_token_ids=top_token_ids.tolist(),
        top_logprobs=top_logprobs.tolist(),
    )


# -- packing ------------------------------------------------------------------------


# NOTE: struct packs a list twice as fast as numpy converts it.


def _pack_int32(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _pack_float32(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _pack_float64(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def _unpack(data: bytes, name: str, dtype: np.dtype) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{name} is {len(data)} bytes, not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(data, dtype=dtype)


def _unpack_column(
    message: step_pb2.StepPlan | step_pb2.NewRequests, name: str, num_reqs: int, dtype: np.dtype = _INT32,
    *, label: str = "",
) -> np.ndarray:
    """The column ``name`` of ``message``, one entry per request; errors name it ``label + name``."""
    column = _unpack(getattr(message, name), label + name, dtype)
    if column.size != num_reqs:
        raise ValueError(f"{label}{name} has {column.size} entries for {num_reqs} {label}req_ids")
    return column


def _check_non_negative(name: str, column: np.ndarray) -> None:
    if column.size and column.min() < 0:
        raise ValueError(f"{name} holds a negative value ({int(column.min())})")


def _check_total(name: str, size: int, counts_name: str, counts: np.ndarray) -> None:
    total = int(counts.sum(dtype=np.int64))
    if size != total:
        raise ValueError(f"{name} has {size} entries but {counts_name} adds up to {total}")
