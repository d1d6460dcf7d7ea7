"""The step scheduler of one replica (vLLM v1 style).

There are no prefill or decode phases.  Every step has a token budget
(``max_num_batched_tokens``); running requests are served first (one token for
a decode, a chunk for an unfinished prefill), then waiting ones in arrival
order, each taking as many of its uncomputed tokens as the budget allows.
When the pool runs out of blocks, the most recently admitted running request
is preempted: its blocks are freed and it goes back to the *front* of the
waiting queue, to be recomputed later (cheaply, when its blocks are still in
the prefix cache).  The prefix cache is looked up when a request is scheduled
from the waiting queue.

One step is ``plan = schedule()``, the workers run ``plan``, then
``update(plan, sampled_token_ids)``.  With overlapped scheduling the next
``schedule()`` comes before the last ``update()``: a request whose sampled
token is still on its way is planned with a placeholder for it (the worker
knows its own sample), unless the token cannot but finish it (its last allowed
one); its tokens are applied when they come, also if it was preempted meanwhile.
With more steps in flight (``EngineCore.steps_ahead``), a request preempted with tokens on
their way resumes after they came.  The workers fill a placeholder from their last sampling
step: running requests are served in admission order and the budget left to later ones never
shrinks while they run, so a request sampled by one step is in the next, if it is not preempted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

from kvserve.scheduler.block_pool import KVCacheEventObserver
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.kv_cache_block import KVCacheBlock
from kvserve.scheduler.kv_cache_manager import KVCacheManager
from kvserve.scheduler.logprobs import StepPromptLogprobs, TokenLogprobs
from kvserve.scheduler.prompt_logprobs import plan_prompt_logprobs, record_prompt_logprobs
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.request_output import RequestOutput
from kvserve.scheduler.scheduler_load import (
    SchedulerEventObserver,
    SchedulerLoad,
    SchedulerStats,
    queued_prefill_tokens,
    running_prefill_progress,
)
from kvserve.scheduler.step_plan import NewRequestData, StepPlan

logger = logging.getLogger(__name__)

_NO_BLOCKS: list[KVCacheBlock] = []  # never appended to


class Scheduler:
    """Decides, step by step, which tokens of which requests one replica computes.

    ``observer`` receives the pool's KV-cache events, ``queue_observer`` the
    scheduler's queue and step events (both: the router, in a fleet).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        observer: KVCacheEventObserver | None = None,
        queue_observer: SchedulerEventObserver | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager.from_config(cache_config, observer)
        self.queue_observer = queue_observer
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose worker state must be dropped with the next plan.
        self._finished_req_ids: list[str] = []
        self._next_step_id = 0
        # The requests of each plan with rows not applied yet (``update``, ``discard_step``), in row order.
        # NOTE: its results go to these objects, never to whatever request holds the id by then: an
        # aborted request's id may already name a new one (a client retrying under the same request id).
        self._planned: dict[int, list[Request]] = {}
        # NOTE: kept incrementally so that get_load() is O(1) for a router
        # that reads the load of every replica on every request.
        self._num_queued_prefill_tokens = 0
        self._num_running_tokens = 0
        # Requests preempted since the start (a counter, for monitoring).
        self.num_preemptions = 0

    # -- requests --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request``; raises ``ValueError`` if it could never be served.

        With prefix caching, that includes a prompt that cannot be hashed (a
        token id outside [0, 2**32)).
        """
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.req_id!r} was already scheduled once")
        max_model_len = self.scheduler_config.max_model_len
        if request.num_prompt_tokens > max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than max_model_len={max_model_len}"
            )
        # The last sampled token is never fed back, so it needs no slot; a
        # request stops once it holds max_model_len tokens.
        max_kv_tokens = min(
            request.num_prompt_tokens + request.sampling_params.max_tokens - 1,
            max(request.num_prompt_tokens, max_model_len - 1),
        )
        num_blocks_needed = -(-max_kv_tokens // self.cache_config.block_size)
        num_usable = self.cache_config.num_usable_blocks
        if num_blocks_needed > num_usable:
            pool = f"the pool has only {num_usable} usable (of {self.cache_config.num_blocks}: one is the null block)"
            num_prompt_blocks = self._prompt_blocks(request)
            if num_prompt_blocks > num_usable:
                raise ValueError(
                    f"a prompt of {request.num_prompt_tokens} tokens alone needs {num_prompt_blocks} KV blocks but {pool}"
                )
            raise ValueError(
                f"request needs up to {num_blocks_needed} KV blocks with max_tokens="
                f"{request.sampling_params.max_tokens} but {pool}"
            )
        # NOTE: hashed here rather than when first scheduled, so that a token id
        # that cannot be hashed is refused now.  In schedule() it raised halfway
        # through a plan, after running requests had advanced for a step that
        # never ran, and again at every later step.
        self.kv_cache_manager.hash_new_request(request)
        self.requests[request.req_id] = request
        self.waiting.append(request)
        self._num_queued_prefill_tokens += request.num_tokens
        if self.queue_observer is not None:
            self.queue_observer.request_queued(request.req_id, request.block_hashes, request.num_tokens)

    def prompt_fits_pool(self, request: Request) -> bool:
        """Whether ``request``'s prompt alone fits in the pool's usable blocks."""
        return self._prompt_blocks(request) <= self.cache_config.num_usable_blocks

    def _prompt_blocks(self, request: Request) -> int:
        return -(-request.num_prompt_tokens // self.cache_config.block_size)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Stop these requests now, wherever they are, and free their blocks.

        Unknown or already finished ids are ignored.  Returns the aborted requests.
        """
        aborted: list[Request] = []
        for req_id in req_ids:
            request = self.requests.pop(req_id, None)
            if request is None:
                continue
            self._num_queued_prefill_tokens -= queued_prefill_tokens(request)
            if request.status is RequestStatus.RUNNING:
                self._num_running_tokens -= request.num_computed_tokens
                self.kv_cache_manager.free(request)
                self._finished_req_ids.append(req_id)
            elif self.queue_observer is not None:
                self.queue_observer.request_dequeued(req_id)
            request.finish(FinishReason.ABORT)
            aborted.append(request)
        if aborted:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Choose the work of the next step and reserve its KV slots."""
        config = self.scheduler_config
        kv = self.kv_cache_manager
        budget = config.max_num_batched_tokens
        req_ids: list[str] = []
        num_scheduled: list[int] = []
        num_computed: list[int] = []
        token_ids: list[int] = []
        num_new_block_ids: list[int] = []
        new_block_ids: list[int] = []
        sample: list[bool] = []
        new_requests: list[NewRequestData] = []
        preempted_req_ids: list[str] = []
        placeholder_rows: list[int] = []
        prompt_logprobs_rows: list[int] = []
        next_prompt_token_ids: list[int] = []
        planned: list[Request] = []

        # Running requests first: decodes and unfinished prefill chunks.
        running = self.running
        max_model_len = config.max_model_len
        max_chunk = config.long_prefill_token_threshold or max_model_len
        allocate_slots = kv.allocate_slots
        req_index = 0
        while req_index < len(running) and budget > 0:
            request = running[req_index]
            start = request.num_computed_tokens
            num_pending = request.num_pending_tokens
            num_tokens = len(request.all_token_ids) + num_pending
            num_new = num_tokens - start
            if num_new > 1:
                num_new = min(num_new, budget, max_chunk)
            elif num_new <= 0 or (num_pending and _pending_token_ends(request, max_model_len)):
                req_index += 1
                continue
            if start + num_new <= request.kv_room:
                # allocate_slots' own fast-path test, without the call (most decodes).
                new_blocks = _NO_BLOCKS
            else:
                while True:
                    new_blocks = allocate_slots(request, num_new)
                    if new_blocks is not None:
                        break
                    victim = running.pop()
                    self._preempt(victim)
                    preempted_req_ids.append(victim.req_id)
                    if victim is request:
                        break
                if new_blocks is None:
                    break
            req_ids.append(request.req_id)
            planned.append(request)
            num_scheduled.append(num_new)
            num_computed.append(start)
            if num_new == 1:
                if num_pending:
                    placeholder_rows.append(len(req_ids) - 1)
                    token_ids.append(0)
                else:
                    token_ids.append(request.all_token_ids[start])
            else:
                token_ids.extend(request.all_token_ids[start : start + num_new])
            if new_blocks:
                num_new_block_ids.append(len(new_blocks))
                new_block_ids.extend([block.block_id for block in new_blocks])
            else:
                num_new_block_ids.append(0)
            if start + num_new == num_tokens:
                sample.append(True)
                request.num_pending_tokens = num_pending + 1
            else:
                sample.append(False)
            request.num_computed_tokens = start + num_new
            budget -= num_new
            req_index += 1
            if request.prompt_logprobs is not None:
                plan_prompt_logprobs(request, len(req_ids) - 1, start, prompt_logprobs_rows, next_prompt_token_ids)
            if start < request.num_prompt_tokens:
                self._num_queued_prefill_tokens -= running_prefill_progress(request, start)

        # Then waiting requests, in order, unless this step had to preempt.
        waiting = self.waiting
        while waiting and budget > 0 and not preempted_req_ids and len(running) < config.max_num_seqs:
            request = waiting[0]
            if request.num_pending_tokens:  # preempted with tokens on their way: it resumes after them
                break
            computed = kv.get_computed_blocks(request)
            start = computed.num_tokens
            num_new = min(request.num_tokens - start, max_chunk)
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = budget
            if allocate_slots(request, num_new, computed) is None:
                break
            waiting.popleft()
            running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens is None:
                request.num_cached_tokens = start
            new_requests.append(NewRequestData.for_request(request))
            block_ids = kv.get_block_ids(request.req_id)
            req_ids.append(request.req_id)
            planned.append(request)
            num_scheduled.append(num_new)
            num_computed.append(start)
            token_ids.extend(request.all_token_ids[start : start + num_new])
            num_new_block_ids.append(len(block_ids))
            new_block_ids.extend(block_ids)
            if start + num_new == request.num_tokens:
                sample.append(True)
                request.num_pending_tokens = 1
            else:
                sample.append(False)
            request.num_computed_tokens = start + num_new
            budget -= num_new
            if request.prompt_logprobs is not None:
                plan_prompt_logprobs(request, len(req_ids) - 1, start, prompt_logprobs_rows, next_prompt_token_ids)
            # From waiting (all its tokens queued) to running (its prompt's rest queued).
            self._num_queued_prefill_tokens -= request.num_tokens - queued_prefill_tokens(request)
            self._num_running_tokens += start
            if self.queue_observer is not None:
                self.queue_observer.request_dequeued(request.req_id)

        self._num_running_tokens += len(token_ids)
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        plan = StepPlan(
            step_id=self._next_step_id,
            req_ids=req_ids,
            num_scheduled_tokens=num_scheduled,
            num_computed_tokens=num_computed,
            token_ids=token_ids,
            num_new_block_ids=num_new_block_ids,
            new_block_ids=new_block_ids,
            sample=sample,
            new_requests=new_requests,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids,
            placeholder_rows=placeholder_rows,
            prompt_logprobs_rows=prompt_logprobs_rows,
            next_prompt_token_ids=next_prompt_token_ids,
        )
        self._next_step_id += 1
        if req_ids:
            self._planned[plan.step_id] = planned
        # NOTE: only a plan with rows counts as a step (one without may never run: the simulator's).
        if self.queue_observer is not None and req_ids:
            # Rows of one token are decodes, as the step cost model counts them.
            self.queue_observer.step_planned(len(token_ids) - num_scheduled.count(1))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step %d: %d requests, %d tokens, %d new, %d preempted",
                plan.step_id, plan.num_reqs, len(token_ids), len(new_requests), len(preempted_req_ids),
            )
        return plan

    def update(
        self,
        plan: StepPlan,
        sampled_token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None] | None = None,
        *,
        prompt_logprobs: StepPromptLogprobs | None = None,
        collect_outputs: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokens sampled for ``plan`` (one per ``plan.sample`` row, in order).

        Returns one output per request that received a token; those that
        finished carry their reason and have already freed their blocks.
        Requests aborted while the step was in flight are skipped.
        ``logprobs``, when given, parallels ``sampled_token_ids`` (``None`` for
        the rows whose requests did not ask for them); ``prompt_logprobs`` join
        their requests' ``Request.prompt_logprobs``.
        ``collect_outputs=False`` returns ``[]`` instead (the state changes
        are the same), for callers that follow requests themselves: the
        simulator, where making an output per token took a tenth of the samples
        in a profile.
        """
        if hasattr(sampled_token_ids, "tolist"):
            sampled_token_ids = sampled_token_ids.tolist()  # type: ignore[union-attr]
        num_sampled = sum(plan.sample)
        if len(sampled_token_ids) != num_sampled:
            raise ValueError(
                f"step {plan.step_id} sampled {num_sampled} requests but got "
                f"{len(sampled_token_ids)} token ids"
            )
        if logprobs is not None and len(logprobs) != num_sampled:
            raise ValueError(f"got {len(logprobs)} logprobs for {num_sampled} sampled tokens")
        planned = self._take_planned(plan)
        if self.queue_observer is not None and plan.req_ids:
            self.queue_observer.step_applied()
        requests = self.requests
        if prompt_logprobs is not None:
            record_prompt_logprobs(plan, prompt_logprobs, self._still_current(planned))
        max_model_len = self.scheduler_config.max_model_len
        outputs: list[RequestOutput] = []
        any_finished = False
        tokens = iter(sampled_token_ids)
        token_logprobs = iter(logprobs) if logprobs is not None else None
        logprob: TokenLogprobs | None = None
        running_status = RequestStatus.RUNNING
        for request, sampled in zip(planned, plan.sample):
            if not sampled:
                continue
            token_id = next(tokens)
            if token_logprobs is not None:
                logprob = next(token_logprobs)
            req_id = request.req_id
            if requests.get(req_id) is not request:  # aborted while the step ran; the id may name a new one
                continue
            request.num_pending_tokens -= 1
            if request.status is not running_status:
                if request.status is RequestStatus.PREEMPTED:  # preempted while its token was on its way
                    reason = self._apply_to_waiting(request, token_id)
                    if collect_outputs:
                        outputs.append(RequestOutput(req_id, token_id, reason, logprob))
                continue
            request.all_token_ids.append(token_id)
            request.output_token_ids.append(token_id)
            # NOTE: _finish_reason's rule, inlined: a call per token cost this loop 5-10%.
            if token_id in request.stop_token_ids and _may_stop(request):
                reason: FinishReason | None = FinishReason.STOP
            elif (
                len(request.output_token_ids) >= request.sampling_params.max_tokens
                or len(request.all_token_ids) >= max_model_len
            ):
                reason = FinishReason.LENGTH
            else:
                if collect_outputs:
                    outputs.append(RequestOutput(req_id, token_id, None, logprob))
                continue
            request.finish(reason)
            self._num_running_tokens -= request.num_computed_tokens
            self.kv_cache_manager.free(request)
            del requests[req_id]
            self._finished_req_ids.append(req_id)
            any_finished = True
            if collect_outputs:
                outputs.append(RequestOutput(req_id, token_id, reason, logprob))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _apply_to_waiting(self, request: Request, token_id: int) -> FinishReason | None:
        """A token sampled before ``request`` was preempted: it joins what the request recomputes.

        Returns why the token ends the request, if it does (the request is then gone).
        """
        request.append_output_token(token_id)
        self._num_queued_prefill_tokens += 1
        reason = _finish_reason(request, token_id, self.scheduler_config.max_model_len)
        if reason is not None:
            self._num_queued_prefill_tokens -= request.num_tokens - request.num_computed_tokens
            if self.queue_observer is not None:
                self.queue_observer.request_dequeued(request.req_id)
            self.waiting = deque(r for r in self.waiting if r is not request)
            del self.requests[request.req_id]
            request.finish(reason)
        return reason

    def discard_step(self, plan: StepPlan) -> None:
        """The step of ``plan`` never ran (its execution failed): abort its requests, and take the
        blocks it was to fill out of the prefix cache, since their KV was never written."""
        current = self._still_current(self._take_planned(plan))
        kv = self.kv_cache_manager
        block_size = kv.block_size
        unfilled: list[KVCacheBlock] = []
        for req_id, start, num_new in zip(plan.req_ids, plan.num_computed_tokens, plan.num_scheduled_tokens):
            if req_id not in current:  # aborted while the step ran: its blocks are freed, or a new request's
                continue
            blocks = kv.req_to_blocks.get(req_id, _NO_BLOCKS)
            unfilled.extend(blocks[start // block_size : -(-(start + num_new) // block_size)])
        self.abort_requests(list(current))
        kv.block_pool.uncache_blocks(unfilled)
        if self.queue_observer is not None and plan.req_ids:
            self.queue_observer.step_applied()  # it is no longer in flight

    def _take_planned(self, plan: StepPlan) -> list[Request]:
        """The requests of ``plan``'s rows, as planned; ``ValueError`` for a plan with rows that this
        scheduler did not plan, or whose results it has applied already."""
        planned = self._planned.pop(plan.step_id, None)
        if planned is None:
            if plan.req_ids:
                raise ValueError(f"step {plan.step_id} is not a step planned here and not applied yet")
            return []
        return planned

    def _still_current(self, planned: list[Request]) -> dict[str, Request]:
        """Those of ``planned`` not aborted or finished since, by id."""
        requests = self.requests
        return {request.req_id: request for request in planned if requests.get(request.req_id) is request}

    def _preempt(self, request: Request) -> None:
        self._num_queued_prefill_tokens += request.num_tokens - queued_prefill_tokens(request)
        self._num_running_tokens -= request.num_computed_tokens
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if self.queue_observer is not None:
            self.queue_observer.request_queued(request.req_id, request.block_hashes, request.num_tokens)
        logger.debug("preempted %s after %d output tokens", request.req_id, request.num_output_tokens)

    # -- introspection ---------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        queued += sum(
            r.num_tokens - r.num_computed_tokens
            for r in self.running
            if r.num_computed_tokens < r.num_prompt_tokens
        )
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_queued_prefill_tokens=queued,
            kv_cache_usage=kv.get_usage(),
            num_free_blocks=kv.get_num_free_blocks(),
        )

    def get_load(self) -> SchedulerLoad:
        """The load snapshot a router needs, in O(1) (``get_stats`` walks the queues)."""
        pool = self.kv_cache_manager.block_pool
        return SchedulerLoad(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_queued_prefill_tokens=self._num_queued_prefill_tokens,
            num_running_tokens=self._num_running_tokens,
            num_free_blocks=pool.free_block_queue.num_free_blocks,
            num_total_blocks=pool.num_usable_blocks,
        )


def _may_stop(request: Request) -> bool:
    """Whether a stop token just appended to ``request``'s output ends it: not before ``min_tokens``."""
    return len(request.output_token_ids) > request.sampling_params.min_tokens


def _finish_reason(request: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """Why ``request`` ends with its newly appended ``token_id``, if it does (``update`` inlines it)."""
    if token_id in request.stop_token_ids and _may_stop(request):
        return FinishReason.STOP
    if len(request.output_token_ids) >= request.sampling_params.max_tokens or len(request.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH
    return None


def _pending_token_ends(request: Request, max_model_len: int) -> bool:
    """Whether the tokens on their way end ``request`` by length: nothing to plan after them."""
    num_pending = request.num_pending_tokens
    return (
        len(request.output_token_ids) + num_pending >= request.sampling_params.max_tokens
        or len(request.all_token_ids) + num_pending >= max_model_len
    )
