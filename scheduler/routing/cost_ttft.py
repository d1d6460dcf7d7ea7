"""Cost-based routing: the replica with the lowest estimated time to first token.

For each replica the step cost model (``a + b * prefill tokens + c * decodes
+ d * context tokens`` per step) prices the prefill work ahead of the
request's first token there: the prompt tokens the replica has queued (less
those its prefix cache held when they were queued, as the router's
``QueueTracker`` counts them) plus the request's own uncached tokens (its
prompt less the prefix that replica caches).  The replica computes that
work in steps of at most ``max_num_batched_tokens`` tokens, less one per
running decode, and each step also pays the fixed cost and its running
decodes; a replica that is running requests is, on average, half-way
through a step::

    step      = a + c * running + d * running context
    work      = queued uncached prompt tokens + the request's uncached tokens
    in flight = (step + b * prefill tokens of the step in flight) / 2   (0 on an idle replica)
    ttft      = in flight + ceil(work / (budget - running)) * step + b * work

The request goes to the replica with the lowest estimate, with three terms that
the estimate's own limits call for:

* **Room in the KV cache first.**  The estimate prices compute, but a
  replica admits a waiting request only when its free blocks hold the
  request's new blocks, and admits in order: where the queue's uncached
  prompt tokens and the request's need more blocks than are free, the
  request waits until running requests finish, seconds of decode that the
  router cannot see.  Such a replica is chosen only when no candidate has
  room.  The request then waits for memory wherever it goes, a wait the
  estimate cannot rank, and it goes to the candidates caching the longest
  prefix of its prompt (the estimate decides among them; a holder at the
  load bound is no candidate): elsewhere it would compute that prefix
  again and store a second copy, evicting prefixes that later requests
  compute again, and the extra prefills lengthen the queues that are
  already short of memory.
* **Near-ties go to the least loaded** (``tie_tolerance_steps``).  The
  estimate cannot see how far the step in flight has gone, so estimates
  closer than that many steps of the best replica's are equal to it.  A tie
  goes to the replica with the fewest requests running or waiting, whose
  later steps the cost model prices lowest (each running request adds ``c``
  and ``d`` per token of its context to every step).  A prompt that no
  replica holds any of starts a prefix that the requests sharing it will
  follow; its tie goes first to the replica caching the fewest blocks, where
  it evicts the fewest that other requests would compute again.
* **Bounded loads** (``load_factor``, ``load_slack``).  The estimate prices
  one step of a replica's decode batch, but a request that joins the batch
  pays every step until its last token and slows each of them for the
  others.  A replica with ``ceil(load_factor * mean) + load_slack`` or more
  outstanding requests (the mean over the available replicas, this request
  counted) takes no more (consistent hashing with bounded loads; the least
  loaded replica is always under it); ``load_factor=None`` turns it off.

``estimate_ttft`` gives the estimates alone, ``has_room`` which replicas have
room.  The measurements behind the defaults are in ``README.md`` beside this
file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvserve.scheduler.checks import check_ints, check_numbers
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex

# The step budget priced where nothing gives one (the engine's default max_num_batched_tokens).
DEFAULT_STEP_BUDGET = 2048


class CostTTFTPolicy:
    """Lowest estimated TTFT under the step cost model, where the KV cache has room; near-ties to the
    least loaded; loads bounded.

    ``cost_model`` None: the fleet's, which ``FleetSimulator`` and a simulated cluster's
    ``ClusterConfig`` give it; ``StepCostModel.default()`` where nothing does.
    ``max_num_batched_tokens`` None: the replicas' step budget, which ``FleetSimulator``
    and ``ClusterConfig`` give it; ``DEFAULT_STEP_BUDGET`` where nothing does.
    """

    name = "cost_ttft"

    def __init__(
        self,
        cost_model: StepCostModel | None = None,
        max_num_batched_tokens: int | None = None,
        tie_tolerance_steps: float = 0.5,
        load_factor: float | None = 2.0,
        load_slack: int = 8,
    ) -> None:
        if cost_model is not None and not isinstance(cost_model, StepCostModel):
            raise TypeError(f"cost_model must be a StepCostModel, got {cost_model!r}")
        if max_num_batched_tokens is not None:
            check_ints(2, max_num_batched_tokens=max_num_batched_tokens)
        check_ints(0, load_slack=load_slack)
        check_numbers(0, tie_tolerance_steps=tie_tolerance_steps)
        if load_factor is not None:
            check_numbers(1, above=True, load_factor=load_factor)
        # NOTE: None: the fleet's, which FleetSimulator gives it (adopt_fleet).
        self._cost_model_given = cost_model is not None
        self.cost_model = cost_model or StepCostModel.default()
        self._budget_given = max_num_batched_tokens is not None
        self.max_num_batched_tokens = max_num_batched_tokens or DEFAULT_STEP_BUDGET
        self.tie_tolerance_steps = tie_tolerance_steps
        self.load_factor = load_factor
        self.load_slack = load_slack

    def adopt_fleet(self, cost_model: StepCostModel, max_num_batched_tokens: int) -> None:
        """Price with the fleet's ``cost_model`` and step budget, each unless the constructor was given one."""
        if not isinstance(cost_model, StepCostModel):
            raise TypeError(f"cost_model must be a StepCostModel, got {cost_model!r}")
        check_ints(2, max_num_batched_tokens=max_num_batched_tokens)
        if not self._cost_model_given:
            self.cost_model = cost_model
        if not self._budget_given:
            self.max_num_batched_tokens = max_num_batched_tokens

    def estimate_ttft(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> np.ndarray:
        """Estimated seconds to ``request``'s first token on each replica."""
        table = LoadTable.of(replicas)
        return self._estimate(table, self._uncached_tokens(request, table, index), self._step_time(table))

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        table.check_any_available()
        step_time = self._step_time(table)
        uncached = self._uncached_tokens(request, table, index)
        score = self._estimate(table, uncached, step_time)
        if not table.all_available:
            score[~table.available] = np.inf
        outstanding = table.num_outstanding
        if self.load_factor is not None:
            # NOTE: the least loaded available replica is always under the bound (it is at most the mean).
            score[outstanding + 1 > math.ceil(table.bounded_load(self.load_factor)) + self.load_slack] = np.inf
        short = ~self._has_room(table, uncached, request.block_size)
        if short.any():
            if np.isfinite(score[~short]).any():
                # NOTE: a request that finds no room waits for running requests to finish (seconds of
                # decode the estimate cannot see), so it goes where there is room while any candidate has it.
                score[short] = np.inf
            else:
                # NOTE: no candidate has room: the request waits for memory wherever it goes, which the
                # estimate cannot rank.  Elsewhere than its longest cached prefix it would compute that
                # prefix again and store a second copy, evicting prefixes later requests compute again.
                score[uncached > uncached[np.isfinite(score)].min()] = np.inf
        best = int(score.argmin())
        ties = np.flatnonzero(score <= score[best] + self.tie_tolerance_steps * float(step_time[best]) + 1e-12)
        if len(ties) == 1:
            return best
        # Fewest outstanding, then the lowest estimate, then the lowest id (lexsort: last key first);
        # a prompt no replica holds: fewest cached blocks before them.
        keys: tuple[np.ndarray, ...] = (score[ties], outstanding[ties])
        if uncached.min() >= request.num_prompt_tokens:
            keys += (np.array([index.num_blocks(int(replica_id)) for replica_id in ties]),)
        return int(ties[np.lexsort(keys)[0]])

    def has_room(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> np.ndarray:
        """Whether each replica's free KV blocks hold its queue's and ``request``'s uncached prompt tokens."""
        table = LoadTable.of(replicas)
        return self._has_room(table, self._uncached_tokens(request, table, index), request.block_size)

    def _uncached_tokens(self, request: RoutingRequest, table: LoadTable, index: GlobalPrefixIndex) -> np.ndarray:
        """Prompt tokens ``request`` would compute on each replica, given the prefix each caches."""
        uncached = np.full(len(table), float(request.num_prompt_tokens))
        for replica_id, num_blocks in index.match(request.block_hashes).items():
            uncached[replica_id] -= request.cached_tokens(num_blocks)
        return uncached

    def _estimate(self, table: LoadTable, uncached: np.ndarray, step_time: np.ndarray) -> np.ndarray:
        """The TTFT estimate of each replica, given the request's uncached tokens there and its step time."""
        b = self.cost_model.b
        prefill_budget = np.maximum(self.max_num_batched_tokens - table.num_running, 1)
        work = table.num_queued_prefill_tokens - table.num_queued_cached_tokens + uncached
        in_flight = np.where(table.num_running > 0, 0.5 * (step_time + b * table.num_inflight_prefill_tokens), 0.0)
        return in_flight + np.ceil(work / prefill_budget) * step_time + b * work

    def _has_room(self, table: LoadTable, uncached: np.ndarray, block_size: int) -> np.ndarray:
        """Whether each replica can allocate the blocks of its queue's uncached tokens and then of ``uncached``.

        NOTE: the scheduler admits a waiting request only when the pool's free blocks (evictable
        cached ones included) hold its new blocks, and admits in order.  A cached block of the
        request's that is itself free is taken off the free list too; the index cannot tell
        which are, so they count as held by running requests.
        """
        work = table.num_queued_prefill_tokens - table.num_queued_cached_tokens + uncached
        return np.ceil(work / block_size) <= table.num_free_blocks

    def _step_time(self, table: LoadTable) -> np.ndarray:
        """Seconds of one step of each replica with its running decodes and no prefill."""
        model = self.cost_model
        return model.a + model.c * table.num_running + model.d * table.num_running_tokens
