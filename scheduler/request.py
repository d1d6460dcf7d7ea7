"""A generation request as the step scheduler tracks it."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_STATUSES


_FINISHED_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


_NO_STOP_TOKENS: frozenset[int] = frozenset()


class FinishReason(enum.Enum):
    """Why a request stopped: a stop/EOS token, a length limit, or an abort."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_STATUS_FOR_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}


class Request:
    """One request: its tokens so far, its progress, and its block hashes.

    ``all_token_ids`` is the prompt followed by the generated tokens.
    ``num_computed_tokens`` counts the tokens whose KV is in the cache (or is
    being computed by the step in flight).  ``block_hashes`` holds the hashes of
    the full blocks of ``all_token_ids``, extended as blocks fill.
    """

    __slots__ = (
        "req_id",
        "num_prompt_tokens",
        "all_token_ids",
        "output_token_ids",
        "sampling_params",
        "stop_token_ids",
        "cache_salt",
        "tenant",
        "arrival_time",
        "status",
        "finish_reason",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "kv_room",
        "num_pending_tokens",
        "prompt_logprobs",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        cache_salt: str | None = None,
        tenant: str | None = None,
        arrival_time: float | None = None,
        block_hashes: Sequence[BlockHash] = (),
    ) -> None:
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty string, got {req_id!r}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string or None, got {tenant!r}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: a request runs one sequence (LLM.generate makes a request of each of n completions)"
            )
        self.req_id = req_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = params
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(eos_token_ids)
        # NOTE: one shared empty set for the usual case, so that the per-token
        # stop check reads memory that is already in cache.
        self.stop_token_ids: frozenset[int] = frozenset(stop) if stop else _NO_STOP_TOKENS
        self.cache_salt = cache_salt
        # Who sent it (an authenticated caller's tenant; None without authentication): the
        # owner of the blocks it caches, whose share of the cache it draws on (TenantBlockPool).
        self.tenant = tenant
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache when first scheduled.
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = list(block_hashes)
        # Set by its KVCacheManager: a step that leaves the request holding at
        # most this many tokens needs no new block and fills none (0 when it
        # holds no blocks), so the scheduler schedules it without a call.
        self.kv_room = 0
        # Tokens sampled by scheduled steps whose results have not been applied
        # yet: 0 except between schedule() and update() (overlapped scheduling).
        self.num_pending_tokens = 0
        # The logprobs of prompt tokens 1, 2, ... received so far, when the request asks for them
        # (SamplingParams.prompt_logprobs; kvserve.scheduler.prompt_logprobs).
        self.prompt_logprobs: list[TokenLogprobs] | None = [] if params.prompt_logprobs is not None else None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt, copied: ``all_token_ids`` holds the only list of it."""
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def finish(self, reason: FinishReason) -> None:
        self.status = _STATUS_FOR_REASON[reason]
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
