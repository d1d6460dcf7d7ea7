"""The step protocol's conversions: scheduler dataclasses <-> ``step_pb2`` messages.

This is the only module that knows both sides of the scheduler <-> worker
boundary.  Integer columns travel as little-endian packed arrays (``int32``;
``sample`` as one ``uint8`` per request, ``logprobs`` as ``float32``), so a
step of 256 decodes is a handful of ``bytes`` fields instead of thousands of
varints.  Decoding validates the message against itself (every column has one
entry per request, the flattened columns add up) and raises ``ValueError``
naming the field, so a worker never indexes past the end of a column.

``SamplingParams.stop_token_ids`` and ``ignore_eos`` are not sent: stopping is
decided by the scheduler, workers only sample.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvserve.proto import step_pb2
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import NewRequestData, StepPlan
from kvserve.scheduler.step_result import StepResult

_INT32 = np.dtype("<i4")
_UINT8 = np.dtype("u1")
_FLOAT32 = np.dtype("<f4")


# -- sampling parameters ----------------------------------------------------------


def encode_sampling_params(params: SamplingParams) -> step_pb2.WireSamplingParams:
    wire = step_pb2.WireSamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or 0,
    )
    if params.seed is not None:
        wire.seed = params.seed
    return wire


def decode_sampling_params(wire: step_pb2.WireSamplingParams) -> SamplingParams:
    """The worker's view of a request's sampling parameters (no stop conditions)."""
    return SamplingParams(
        max_tokens=wire.max_tokens,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k or None,
        seed=wire.seed if wire.HasField("seed") else None,
    )


# -- step plans ---------------------------------------------------------------------


def encode_plan(plan: StepPlan) -> step_pb2.StepPlan:
    """The wire form of ``plan``; encode once and send the same message to every rank."""
    return step_pb2.StepPlan(
        step_id=plan.step_id,
        req_ids=plan.req_ids,
        num_scheduled_tokens=_pack(plan.num_scheduled_tokens, _INT32),
        num_computed_tokens=_pack(plan.num_computed_tokens, _INT32),
        token_ids=_pack(plan.token_ids, _INT32),
        num_new_block_ids=_pack(plan.num_new_block_ids, _INT32),
        new_block_ids=_pack(plan.new_block_ids, _INT32),
        sample=_pack(plan.sample, _UINT8),
        new_requests=_encode_new_requests(plan.new_requests),
        finished_req_ids=plan.finished_req_ids,
        preempted_req_ids=plan.preempted_req_ids,
    )


def decode_plan(message: step_pb2.StepPlan) -> StepPlan:
    """The ``StepPlan`` carried by ``message``; ``ValueError`` names the first bad field."""
    num_reqs = len(message.req_ids)
    num_scheduled = _unpack_column(message, "num_scheduled_tokens", num_reqs)
    num_computed = _unpack_column(message, "num_computed_tokens", num_reqs)
    num_new_blocks = _unpack_column(message, "num_new_block_ids", num_reqs)
    sample = _unpack_column(message, "sample", num_reqs, _UINT8)
    token_ids = _unpack(message.token_ids, "token_ids", _INT32)
    new_block_ids = _unpack(message.new_block_ids, "new_block_ids", _INT32)
    for name, column in (
        ("num_scheduled_tokens", num_scheduled),
        ("num_computed_tokens", num_computed),
        ("num_new_block_ids", num_new_blocks),
        ("token_ids", token_ids),
        ("new_block_ids", new_block_ids),
    ):
        if column.size and column.min() < 0:
            raise ValueError(f"{name} holds a negative value ({int(column.min())})")
    if sample.size and sample.max() > 1:
        raise ValueError(f"sample must hold 0 or 1 per request, got {int(sample.max())}")
    _check_total("token_ids", token_ids.size, "num_scheduled_tokens", num_scheduled)
    _check_total("new_block_ids", new_block_ids.size, "num_new_block_ids", num_new_blocks)
    return StepPlan(
        step_id=message.step_id,
        req_ids=list(message.req_ids),
        num_scheduled_tokens=num_scheduled.tolist(),
        num_computed_tokens=num_computed.tolist(),
        token_ids=token_ids.tolist(),
        num_new_block_ids=num_new_blocks.tolist(),
        new_block_ids=new_block_ids.tolist(),
        sample=sample.astype(bool).tolist(),
        new_requests=_decode_new_requests(message.new_requests),
        finished_req_ids=list(message.finished_req_ids),
        preempted_req_ids=list(message.preempted_req_ids),
    )


def _encode_new_requests(new_requests: list[NewRequestData]) -> list[step_pb2.NewRequest]:
    # NOTE: requests of one plan mostly share their sampling parameters: each
    # distinct value is converted once.
    wire_params: dict[SamplingParams, step_pb2.WireSamplingParams] = {}
    messages = []
    for new in new_requests:
        params = new.sampling_params
        wire = wire_params.get(params)
        if wire is None:
            wire = wire_params[params] = encode_sampling_params(params)
        messages.append(
            step_pb2.NewRequest(req_id=new.req_id, sampling_params=wire, num_prompt_tokens=new.num_prompt_tokens)
        )
    return messages


def _decode_new_requests(messages: Iterable[step_pb2.NewRequest]) -> list[NewRequestData]:
    decoded: dict[tuple, SamplingParams] = {}
    new_requests = []
    for i, new in enumerate(messages):
        if not new.HasField("sampling_params"):
            raise ValueError(f"new_requests[{i}].sampling_params is missing")
        wire = new.sampling_params
        key = (wire.max_tokens, wire.temperature, wire.top_p, wire.top_k, wire.seed if wire.HasField("seed") else None)
        params = decoded.get(key)
        if params is None:
            try:
                params = decoded[key] = decode_sampling_params(wire)
            except ValueError as exc:
                raise ValueError(f"new_requests[{i}].sampling_params: {exc}") from None
        new_requests.append(NewRequestData(new.req_id, params, new.num_prompt_tokens))
    return new_requests


# -- step results -------------------------------------------------------------------


def encode_result(step_id: int, result: StepResult | None) -> step_pb2.StepResult:
    """Rank 0's samples, or (``result`` ``None``) the empty answer of the other ranks."""
    if result is None:
        return step_pb2.StepResult(step_id=step_id, has_samples=False)
    return step_pb2.StepResult(
        step_id=result.step_id,
        sampled_token_ids=_pack(result.sampled_token_ids, _INT32),
        logprobs=_pack(result.logprobs, _FLOAT32),
        has_samples=True,
    )


def decode_result(message: step_pb2.StepResult) -> StepResult | None:
    """The samples of ``message``; ``None`` for a rank that does not sample."""
    if not message.has_samples:
        return None
    token_ids = _unpack(message.sampled_token_ids, "sampled_token_ids", _INT32)
    logprobs = _unpack(message.logprobs, "logprobs", _FLOAT32)
    if logprobs.size != token_ids.size:
        raise ValueError(
            f"logprobs has {logprobs.size} entries but sampled_token_ids has {token_ids.size}"
        )
    return StepResult(message.step_id, token_ids.tolist(), logprobs.tolist())


# -- packing ------------------------------------------------------------------------


def _pack(values: list[int] | list[bool] | list[float], dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def _unpack(data: bytes, name: str, dtype: np.dtype) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{name} is {len(data)} bytes, not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(data, dtype=dtype)


def _unpack_column(message: step_pb2.StepPlan, name: str, num_reqs: int, dtype: np.dtype = _INT32) -> np.ndarray:
    column = _unpack(getattr(message, name), name, dtype)
    if column.size != num_reqs:
        raise ValueError(f"{name} has {column.size} entries for {num_reqs} req_ids")
    return column


def _check_total(name: str, size: int, counts_name: str, counts: np.ndarray) -> None:
    total = int(counts.sum(dtype=np.int64))
    if size != total:
        raise ValueError(f"{name} has {size} entries but {counts_name} adds up to {total}")
