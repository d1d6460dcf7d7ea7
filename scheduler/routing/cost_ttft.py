"""Cost-based routing: the replica with the lowest estimated time to first token.

For each replica the estimate prices, with the step cost model, the prefill
work ahead of the request's first token there: the replica's queued prefill
tokens (less those its prefix cache held when they were queued: waiting
requests will not compute them) plus the request's own uncached tokens (its
prompt minus that replica's prefix match).  The replica computes that work
in steps of at most ``max_num_batched_tokens`` tokens, less one per running
decode, and each step also pays the fixed cost and its running decodes::

    step    = a + c * running + d * running context
    work    = queued uncached prefill tokens + uncached prompt tokens
    steps   = ceil(work / (budget - running))
    ttft    = in flight + steps * step + b * work
    in flight = (step + b * prefill tokens of the step in flight) / 2   (0 on an idle replica)

Each rule below says why it exists; the measurements behind the rules, the
alternatives tried and not adopted, and the experiments that made this
policy the default are in ``README.md`` beside this file.

* **The step in flight.**  A replica running requests is in the middle of a
  step, which the request waits out: half of it, expected.  NOTE: without it
  a replica busy computing a 2,000-token prompt looked as free as an idle
  one, and requests that saved a few hundred cached tokens there queued
  behind it.  Pricing the rest of the step exactly (the scheduler knows when
  it started) did worse: a replica near the end of its step looks cheap, and
  turns leave their history's replica more often.
* **Pending blocks.**  The match counts blocks pending on a replica (sent
  there with an earlier request, not cached yet) as cached (``match_pending``,
  default on: its ``matches_pending`` attribute has the router record them;
  see ``GlobalPrefixIndex``).  NOTE: a pool caches a long prompt chunk by
  chunk, so without this a second request for a 6k-token document, arriving
  while the first was computed, saw most of it uncached there and was sent
  to an idle replica to compute all of it again.
* **A small match is none.**  A match of less than ``min_match_fraction``
  (default a tenth) of the prompt counts as none.  NOTE: otherwise a short
  system prompt cached on a few busy replicas drew every long prompt that no
  replica holds (sessions whose history was never cached) for the few
  milliseconds it saves, and new sessions followed: the idle replicas never
  cached it, and the busy ones evicted each other's histories.
* **Near-ties go to the least loaded.**  Estimates closer to the best than
  ``tie_tolerance_steps`` (default half) a step of the best replica are
  ties, and ties go to the replica with the fewest outstanding requests
  (then the lowest estimate, then the lowest id).  NOTE: the estimate cannot
  see how far the step in flight has gone, so differences within a step are
  noise; and a TTFT estimate barely feels a replica's decode batch (it pays
  one step of it), so without this rule a system prompt held by a few busy
  replicas keeps new sessions away from idle ones.  A whole step of
  tolerance balances more but costs TTFT: the tail of TTFT is a few steps
  long.
* **New prompts go where fewest went lately** (``home_window``, default
  1000).  A request that no replica holds any of (a new shared prefix, a
  history evicted everywhere; a match under ``min_match_fraction`` counts as
  none) brings its later requests (the prefix's other questions, the
  session's next turns) to wherever it is computed.  Its ties go first to
  the replica where the fewest such requests were placed lately (counts
  decayed over about the last ``home_window`` requests per replica; see
  ``DecayedCounts``), then to the fewest outstanding.  ``home_window=None``
  leaves them to the fewest outstanding.  NOTE: outstanding requests say
  which replicas' prefixes have requests in flight at that moment, not which
  will have most: on 32 equally popular prefixes at 16 replicas, of the 16
  prefixes that came after every replica had one, four replicas got two
  more and four none, and load max/mean was 1.52 (with this rule 1.11).
* **Work under backlog.**  Tokens a request computes where its prefix is
  not cached are work the fleet must do on top, which delays requests that
  queue, so each replica's score adds ``work_penalty * b * uncached tokens
  there * backlog``.  The backlog depends on whether the prefix the request
  matched is shared (its match ends where an earlier prompt went on with
  other tokens, or where another match ended: a system prompt, a document, a
  customer's context; see ``SharedMatches``) or private (a chat session's
  history, whose match ends at the end of the previous turn's answer):

  * shared: the fewest requests waiting on any replica.  It is zero while
    any replica has no queue: computing the prefix there costs nobody else
    anything and leaves one more holder for the requests to come.  Under
    overload it keeps requests where their prefix is cached.
  * private: the mean requests waiting per replica.  A copy elsewhere serves
    that session alone, and while replicas queue, its tokens delay them.
    ``shared_match_window`` (default 1000 requests) is how far back a fork
    or match counts; ``None`` takes the fewest for every request.
    NOTE: with the fewest for histories too, turns left their history's
    replica for one without a queue, their copies evicted other sessions'
    histories, and past the knee the fleet tipped into preemptions
    (multi-turn chat at 8 replicas, 90 qps, 1.3x the knee: TTFT p99 0.81 /
    2.24 s on seeds 0 / 1, 483 preemptions on seed 1; with the mean 0.30 /
    0.23 s and 4).  With the mean for shared prefixes too, a hot customer
    context stayed on its busy holders: load max/mean 1.28 instead of 1.07.
* **A private copy evicts a history** (``private_copy_charge``, default 1).
  A private match's score on each replica adds ``private_copy_charge * b *
  (uncached tokens there - the fewest uncached on any available replica)``:
  a turn that leaves the replica holding its history writes a copy of it
  elsewhere, and in a full cache that copy evicts as many tokens of other
  sessions' histories, which their next turns compute again.  Shared
  matches pay nothing: their copy is one more holder for the requests to
  come.  ``0`` turns it off.  NOTE: under heavy load a turn's holder is
  often mid-way through a step computing another prompt, and the estimate
  moved turns to save half of that step: on multi-turn chat with 4-turn
  sessions at 8 replicas' knee (142.6 qps), 336 of 1,462 later turns left
  their history, and the hit rate was 0.66 and e2e p50 5.70 s (cache_aware:
  0.71 and 5.25 s); with the charge 86 left, 0.70 and 5.36 s.
* **Bounded loads.**  A TTFT estimate alone keeps every request of a popular
  prefix on the replicas holding it until their batches are full (a hit's
  first token is one step away however slow that step has become).  Two
  bounds exclude replicas:

  * ``load_factor`` (default 2) and ``load_slack`` (default 8): outstanding
    requests above ``ceil(load_factor * mean) + load_slack`` (as consistent
    hashing with bounded loads, plus a slack so that small means, as at
    start-up, do not scatter prefixes).  It caps a moment's pile-up;
    ``load_factor=None`` turns it off.
  * ``share_factor`` (default 2), ``share_deviations`` (3), ``share_window``
    (1000) and ``share_slack`` (8): more than their share of the last
    ``share_window`` requests per replica (see ``RecentShare``).  It caps the
    run's imbalance, which under skewed prefix popularity the outstanding
    bound leaves near 2x.  Each new holder of a hot prefix costs one miss,
    and a miss of a long prefix is the TTFT tail, so the factor trades TTFT
    p99 against balance; ``share_factor=None`` turns it off.
* **An empty replica takes a second copy** (``copy_to_empty``, default on).
  A request whose match is shared (see ``SharedMatches``) and held by one
  replica goes to an empty replica if there is one: available, serving no
  request and holding no block, cached or pending (at start-up, or once a
  replica joins or restarts).  It computes the prefix there, and the
  prefix's later requests have two replicas to choose between; an empty
  replica's cache evicts nothing and its queue delays nobody.  NOTE: with
  one replica per prefix, hits that arrive together queue in that replica's
  steps, and they make the TTFT tail: on shared_prefix at 64 replicas, 64
  equally popular prefixes, each sat on a replica of its own and the runs
  were identical to cache_aware's, request for request (TTFT p99 29.65 ms
  on seed 0); with a copy of each prefix whose second request came while a
  replica was still empty (20 of 64), 29.46 ms, below cache_aware on 7 of
  seeds 0-7.  The request that makes the copy computes the prefix: where a
  prefix is long and the tail is the start-up's cold prefills (document QA
  at 16 replicas, 6k-token documents, seed 7) TTFT p99 rose from 0.310 to
  0.339 s.
* **Ties among some holders of a shared prefix go to the fewest requests
  lately** (``holder_share_ties``, default on).  When two or more replicas,
  but not all, hold a shared match, ties go first to the replica with the
  fewest recent requests (``RecentShare``'s counts, rounded), then to the
  fewest outstanding; ``share_factor=None`` turns it off too.  NOTE: such holders also serve other prefixes (a
  copy's holder, its own); the fewest outstanding requests send the prefix
  to whichever holder's queue is shorter at that moment, and the holder that
  also carries another prefix ends with more than its share: load max/mean
  1.27 with copies on shared_prefix at 64 replicas, 1.19 with this rule.
  Where every replica holds the match (a system prompt all sessions share)
  the fewest outstanding still decide: by recent requests, multi-turn chat
  at 8 replicas came out 0.985x cache_aware's TTFT p99 in geometric mean over
  seeds 0-19, against 0.90x.
* **Idle capacity is used** (``spread_tolerance_steps``, default 2).  A
  replica far under its share of recent requests (``RecentShare.under_share``,
  the share bound's mirror: with the defaults, under the mean less the larger
  of half the mean and 3 deviations of chance) takes the request when its
  estimate is within that many steps of the best replica's;
  ``share_factor=None`` turns it off too.  NOTE: the estimate prices a short
  shared prefix's miss (a 256-token system prompt: 13 ms) but not what
  keeping every new session on the replicas holding it costs: on 3-turn chat
  at 16 replicas, the 8 replicas that cached the system prompt while starting
  up got every request, the other 8 and their KV caches stayed idle, and
  histories were evicted.  Two steps cover such a prompt's miss, not a history's (a turn's
  is 640 tokens or more, 4 steps); under balanced load no replica is that
  far under its share and the rule never fires.
* **Decoding to come** (``decode_horizon``, default 0: off) charges the
  decoding that follows, over that many tokens (or the request's
  ``max_tokens`` if fewer)::

      decode = horizon * (step time there + c * running there) + b * uncached * running there

  its own time per token, the slowdown of the running decodes there, and
  their stall while its uncached prompt is computed.  NOTE: off by default:
  on multi-turn chat it moved turns off their history often enough to raise
  TTFT p99 1.6-4x.

The estimate is vectorised over replicas; only the few that match the
prompt are looked at one by one (to subtract their cached tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvserve.scheduler.checks import check_ints, check_numbers
from kvserve.scheduler.routing.decayed_counts import DecayedCounts
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.routing.recent_share import RecentShare
from kvserve.scheduler.routing.shared_matches import SharedMatches
from kvserve.scheduler.simulation.cost_model import StepCostModel


class CostTTFTPolicy:
    """Lowest estimated TTFT under the step cost model, near-ties to the least loaded."""

    name = "cost_ttft"

    def __init__(
        self,
        cost_model: StepCostModel | None = None,
        max_num_batched_tokens: int = 2048,
        tie_tolerance_steps: float = 0.5,
        min_match_fraction: float = 0.1,
        load_factor: float | None = 2.0,
        load_slack: int = 8,
        work_penalty: float = 1.0,
        decode_horizon: int = 0,
        share_factor: float | None = 2.0,
        share_deviations: float = 3.0,
        share_window: int = 1000,
        share_slack: float = 8.0,
        spread_tolerance_steps: float = 2.0,
        match_pending: bool = True,
        home_window: int | None = 1000,
        shared_match_window: int | None = 1000,
        private_copy_charge: float = 1.0,
        copy_to_empty: bool = True,
        holder_share_ties: bool = True,
    ) -> None:
        if cost_model is not None and not isinstance(cost_model, StepCostModel):
            raise TypeError(f"cost_model must be a StepCostModel, got {cost_model!r}")
        self.cost_model = cost_model or StepCostModel.default()
        check_ints(2, max_num_batched_tokens=max_num_batched_tokens)
        check_ints(0, load_slack=load_slack, decode_horizon=decode_horizon)
        check_numbers(
            0, tie_tolerance_steps=tie_tolerance_steps, work_penalty=work_penalty,
            spread_tolerance_steps=spread_tolerance_steps, private_copy_charge=private_copy_charge,
        )
        check_numbers(0, maximum=1, min_match_fraction=min_match_fraction)
        if load_factor is not None:
            check_numbers(1, above=True, load_factor=load_factor)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tie_tolerance_steps = tie_tolerance_steps
        self.min_match_fraction = min_match_fraction
        self.load_factor = load_factor
        self.load_slack = load_slack
        self.work_penalty = work_penalty
        self.decode_horizon = decode_horizon
        self.spread_tolerance_steps = spread_tolerance_steps
        self.private_copy_charge = private_copy_charge
        for name, flag in (("match_pending", match_pending), ("copy_to_empty", copy_to_empty),
                           ("holder_share_ties", holder_share_ties)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.copy_to_empty = copy_to_empty
        self.holder_share_ties = holder_share_ties
        # Blocks a replica was sent and has not cached yet count as cached there (see the module docstring).
        self.matches_pending = match_pending
        self.recent_share = (
            None if share_factor is None else RecentShare(share_factor, share_deviations, share_window, share_slack)
        )
        # Each replica's new prompts placed lately (see the module docstring).
        self.homes = None if home_window is None else DecayedCounts(home_window, name="home_window")
        # Where recent prompts forked or matched: which matches are shared (see the module docstring).
        self.shared_matches = (
            None if shared_match_window is None else SharedMatches(shared_match_window, name="shared_match_window")
        )

    def estimate_ttft(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> np.ndarray:
        """Estimated seconds to ``request``'s first token on each replica."""
        table = LoadTable.of(replicas)
        uncached = self._uncached_tokens(request, table, self._matches(request, index))
        return self._estimate(table, uncached, self._step_time(table))

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        table.check_any_available()
        available = None if table.all_available else table.available
        matches = self._matches(request, index)
        uncached = self._uncached_tokens(request, table, matches)
        new_prompt = False
        if self.homes is not None:
            self.homes.decay(len(table))
            # A request no replica holds any of: a new prompt (see the module docstring).
            new_prompt = float(uncached.min()) >= request.num_prompt_tokens
        step_time = self._step_time(table)
        score = self._estimate(table, uncached, step_time)
        waiting = table.num_waiting if available is None else table.num_waiting[available]
        backlog = float(waiting.min())
        num_holders = 0  # replicas holding the longest match, when it is shared
        if self.shared_matches is not None:
            num_matched = max(matches.values(), default=0)
            shared = self.shared_matches.observe(request.block_hashes, num_matched)
            if shared:
                num_holders = sum(1 for num_blocks in matches.values() if num_blocks == num_matched)
            if num_matched and not shared:  # a private prefix
                backlog = float(waiting.mean())
                if self.private_copy_charge:
                    fewest = uncached.min() if available is None else uncached[available].min()
                    score += self.private_copy_charge * self.cost_model.b * (uncached - fewest)
        if self.work_penalty and backlog:
            score += self.work_penalty * self.cost_model.b * backlog * uncached
        horizon = self.decode_horizon
        if request.max_output_tokens is not None:
            horizon = min(horizon, request.max_output_tokens)
        if horizon:
            model = self.cost_model
            # Its own decoding, the slowdown of the running decodes there, and
            # their stall while its uncached prompt is computed.
            score += horizon * (step_time + model.c * table.num_running)
            score += model.b * uncached * table.num_running
        outstanding = table.num_outstanding
        if self.load_factor is not None:
            bound = math.ceil(table.bounded_load(self.load_factor)) + self.load_slack
            score[outstanding + 1 > bound] = np.inf
        if available is not None:
            score[~available] = np.inf
        if self.recent_share is not None:
            over = self.recent_share.over_share(available, len(table))
            if not np.isinf(score[~over]).all():  # never bind when nothing would be left
                score[over] = np.inf
        best = int(score.argmin())
        if self.copy_to_empty and num_holders == 1:
            empty = self._empty_replica(table, index)
            if empty is not None:  # a second holder of a shared prefix (see the module docstring)
                if self.recent_share is not None:
                    self.recent_share.record(empty, len(table))
                return empty
        if self.recent_share is not None and self.spread_tolerance_steps:
            under = self.recent_share.under_share(available, len(table))
            if not under[best]:
                near = under & (score <= score[best] + self.spread_tolerance_steps * float(step_time[best]))
                if near.any():
                    score = np.where(near, score, np.inf)
                    best = int(score.argmin())
        tolerance = self.tie_tolerance_steps * float(step_time[best]) + 1e-12
        ties = np.flatnonzero(score <= score[best] + tolerance)
        if len(ties) > 1:
            # Fewest outstanding requests first, then the lowest score (lexsort: last key first);
            # a new prompt: fewest new prompts placed lately before them.
            keys = (score[ties], outstanding[ties])
            if self.holder_share_ties and self.recent_share is not None and 2 <= num_holders < table.num_available:
                # A shared prefix some replicas hold: the fewest requests lately first.
                keys += (np.round(self.recent_share.counts[ties]),)
            if new_prompt:
                keys += (self.homes.counts[ties],)
            best = int(ties[np.lexsort(keys)[0]])
        if self.recent_share is not None:
            self.recent_share.record(best, len(table))
        if new_prompt:
            self.homes.add(best)
        return best

    @staticmethod
    def _empty_replica(table: LoadTable, index: GlobalPrefixIndex) -> int | None:
        """The lowest available replica that serves no request and holds no block, cached or pending."""
        idle = table.num_outstanding == 0
        if not table.all_available:
            idle &= table.available
        for replica_id in np.flatnonzero(idle):
            replica_id = int(replica_id)
            if not index.num_blocks(replica_id) and not index.num_pending(replica_id):
                return replica_id
        return None

    def _matches(self, request: RoutingRequest, index: GlobalPrefixIndex) -> dict[int, int]:
        """Replica -> leading blocks of ``request``'s prompt it caches (or has pending, with ``match_pending``)."""
        return index.match(request.block_hashes, pending=self.matches_pending)

    def _uncached_tokens(self, request: RoutingRequest, table: LoadTable, matches: dict[int, int]) -> np.ndarray:
        """Prompt tokens ``request`` would compute on each replica, given ``matches`` (blocks per replica).

        A match of less than ``min_match_fraction`` of the prompt counts as none.
        """
        uncached = np.full(len(table), float(request.num_prompt_tokens))
        least = self.min_match_fraction * request.num_prompt_tokens - 1e-9  # exactly the fraction counts
        for replica_id, num_blocks in matches.items():
            cached = request.cached_tokens(num_blocks)
            if cached >= least:
                uncached[replica_id] -= cached
        return uncached

    def _estimate(self, table: LoadTable, uncached: np.ndarray, step_time: np.ndarray) -> np.ndarray:
        """The TTFT estimate of each replica, given the request's uncached tokens there and its step time."""
        model = self.cost_model
        prefill_budget = np.maximum(self.max_num_batched_tokens - table.num_running, 1)
        work = table.num_queued_prefill_tokens - table.num_queued_cached_tokens + uncached
        # The rest of the step in flight (half of it, expected), on replicas running requests.
        in_flight = np.where(
            table.num_running > 0, 0.5 * (step_time + model.b * table.num_inflight_prefill_tokens), 0.0
        )
        return in_flight + np.ceil(work / prefill_budget) * step_time + model.b * work

    def _step_time(self, table: LoadTable) -> np.ndarray:
        """Seconds of one step of each replica with its running decodes (no prefill)."""
        model = self.cost_model
        return model.a + model.c * table.num_running + model.d * table.num_running_tokens
