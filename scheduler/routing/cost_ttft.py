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

A replica running requests is in the middle of a step, which the request
waits out: half of it, expected.  NOTE: without this term a replica busy
computing a 2,000-token prompt looked as free as an idle one, and requests
that saved a few hundred cached tokens there queued behind it.  NOTE: the
scheduler knows when each step started, so the rest of the step could be
priced exactly.  Tried in simulation (where the cost model's step time is
exact): on multi-turn chat at 8 replicas, seeds 0-5 at the knee, TTFT p99
was 38.5 / 50.0 / 41.2 / 60.5 / 37.7 / 36.4 ms against 35.1 / 36.7 / 36.6 /
56.1 / 34.4 / 38.5 with the expected half, and the hit rate lower on 5 of
6: a replica near the end of its step looks cheap, and turns leave their
history's replica more often.  It is not done.

The match counts blocks pending on a replica (sent there with an earlier
request, not cached yet) as cached (``match_pending``, default on: its
``matches_pending`` attribute has the router record them; see
``GlobalPrefixIndex``).  NOTE: a pool caches a long prompt chunk
by chunk as it schedules it, so without this a second request for a 6k-token
document, arriving while the first was computed, saw two thirds of it
uncached on that replica and was sent to an idle one to compute all of it
again: on document QA at 16 replicas (seed 7, the knee, 4,000 requests)
11 documents were computed twice at start-up, and those misses made TTFT
p99 (0.339 s against cache_aware's 0.249); with pending blocks 6 were and it
was 0.315 s.  Most of the rest: a waiting request's cached tokens are
counted when it is queued, from the pool alone, so one queued behind the
document's first request still counts the whole document as work.  Counting
its pending blocks as cached there too (tried) left 2 (0.273 s), but spread
hot prefixes less at start-up: on customer contexts at 8 replicas load
max/mean went from 1.12 to 1.39 and TTFT p99 from 0.032 to 0.034 s, at 16
replicas (seeds 1 / 2 / 7) TTFT p99 from 39.9 / 37.7 / 38.8 to 46.5 / 41.9 /
42.1 ms, for document QA's 0.281 / 0.252 / 0.273 s (still above
cache_aware's); it is not done.

At 16 replicas' knees, seeds 1 / 2 / 7, TTFT p99 with pending blocks against
without (cache_aware)::

    document QA        0.301 / 0.284 / 0.315 s  against 0.234 / 0.339 / 0.339  (0.251 / 0.242 / 0.249)
    customer contexts  39.9 / 37.7 / 38.8 ms    against 41.0 / 37.7 / 40.0     (- / - / 38.3)
    agent tools        57.9 / 63.0 / 58.1 ms    against 60.2 / 58.5 / 56       (333 / 662 / 529)
    multi-turn chat, shared prefixes: identical

Document QA's tail there is the start-up's cliff between misses (0.34 s) and
hits (0.02 s): the 41 slowest of 4,000 requests are the 32 first prefills,
the requests that waited for them, and any second prefill, and one or two
requests more or less among them move p99 by 0.05-0.1 s either way.

The estimate is vectorised over replicas; only the few that match the
prompt are looked at one by one (to subtract their cached tokens).  A
match of less than ``min_match_fraction`` (default a tenth) of the prompt
counts as none.  NOTE: with a short system prompt cached on a few busy
replicas, long prompts that no replica holds otherwise (sessions under way
whose history was never cached) went there for the few milliseconds the
system prompt saves, so the idle replicas never cached it, and new sessions
followed it too: on multi-turn chat at 16 replicas, 20 qps (a seventh of
the knee) and 300 requests, 8 replicas served every session and evicted each
other's histories (hit rate 0.25-0.30 against cache_aware's 0.90; TTFT p99
0.195-0.199 s against 0.026).  With the rule: hit rate 0.91, TTFT p99
0.022 s.  A fifth of the prompt did as well there but lost more often at
8 replicas' knee (seeds 2 and 3).

Estimates closer to the best than ``tie_tolerance_steps`` (default half) a
step of the best replica are ties, and ties go to the replica with the
fewest outstanding requests (then the lowest estimate, then the lowest id).
NOTE: the estimate cannot see how far the replica's step in flight has gone,
so differences within a step are noise; and a TTFT estimate alone barely
feels a replica's decode batch (it pays one step of it), so without this
rule a small cached prefix (a system prompt) held by a few busy replicas
keeps new sessions away from idle ones until those replicas' batches are
several times the mean.  A whole step of tolerance balances more but costs
TTFT: the tail of TTFT is a few steps long.

NOTE: a tie may compute more of the prompt than the best replica: on
multi-turn chat at 64 replicas (seed 1, the knee, 16,000 requests) 76 turns
went from their history's replica to one with fewer requests (mostly 1-2
fewer, of ~63), recomputing about 300-1,500 tokens each, and TTFT p99 was
40.61 ms against cache_aware's 40.40.  Tried: a tie only while that extra
prefill costs at most the tolerance times (outstanding on the best + 1) /
(outstanding there + 1), which keeps the system-prompt case above.  It made
40.34 ms there but TTFT p99 worse on 7 of 11 other runs at the knee (ms,
with / without; cache_aware): multi-turn 8 replicas seeds 0-5 37.8 / 35.1,
38.3 / 36.7, 35.2 / 36.6, 57.9 / 56.1, 37.3 / 34.4, 39.2 / 38.5 (40.2, 40.6,
38.0, 43.9, 37.2, 36.9); 64 replicas seed 0 40.5 / 40.3 (41.1); 16 replicas
seed 1, customer contexts 38.8 / 40.3 (38.3), agent tools 58.7 / 55.8 (336);
document QA (seed 7) identical, shared prefixes at 8 within 0.1 ms.  Moving
a few turns changes which replica congests later; it is not done.

NOTE: most turns that leave their history are not ties: its replica is
computing a long prompt, in its step in flight or queued (in the warm-up,
sessions under way at the start arrive with no history cached).  The copies
they leave push other histories out later: on multi-turn chat at 8
replicas (seed 5, the knee) 26 turns left their history (23 in the
warm-up; 21 because its replica's estimate was 11-110 ms above another's,
5 in ties), and 12 measured turns found theirs evicted against
cache_aware's 2 (TTFT p99 38.5 ms against 36.9).  Tried: charging the
prefill beyond the best match's ``k`` times more (``b * k * (uncached -
fewest uncached)``).  ``k = 20`` removed those evictions there (35.2 ms); on
seeds 0-2 it made 38.5 / 39.6 / 36.3 ms against 35.1 / 36.7 / 36.6, ``k = 8``
35.9 / 39.2 / 38.3 (seed 5: 36.0); shared prefixes at 8 replicas 131.6
against 130.5.  It is not done.

When every replica has requests waiting (the fleet is backlogged, not just
one replica), prefill work is no longer the request's own business: each
token it computes also delays at least the requests waiting on every replica.
So each replica's score adds ``work_penalty * b * uncached tokens there *
fewest requests waiting on any replica``.  It is zero while any replica has
no queue, where spreading load costs nobody else anything; under overload it
keeps requests where their prefix is cached instead of adding prefill work.

A TTFT estimate alone also keeps every request of a popular prefix on the
replicas holding it until their batches are full (a hit's first token is
one step away however slow that step has become): with hundreds of replicas
and a few dozen prefixes, a few replicas decode huge batches while the rest
idle.  Three remedies:

* ``load_factor`` (default 2) and ``load_slack`` (default 8) exclude
  replicas whose outstanding requests would exceed
  ``ceil(load_factor * mean) + load_slack`` (bounded loads, as in consistent
  hashing with bounded loads, plus a slack so that small means, as at
  start-up, do not scatter prefixes).  This rarely binds on a fleet whose
  prefixes outnumber its replicas, and caps the pile-up on one with far more
  replicas than prefixes; ``load_factor=None`` turns it off.
* ``share_factor`` (default 2), ``share_deviations`` (3),
  ``share_window`` (1000) and ``share_slack`` (8) exclude replicas that were
  sent more than their share of the last ``share_window`` requests per
  replica: more than ``share_factor`` times the mean, or
  ``share_deviations`` chance deviations above it while that is more, plus
  ``share_slack`` requests (see ``RecentShare``).  The outstanding-load
  bound caps a moment's pile-up; this one the run's imbalance, which under
  skewed prefix popularity the outstanding bound leaves near 2x.  Each new
  holder of a hot prefix costs one miss, and a miss of a long prefix is the
  TTFT tail, so the factor trades TTFT p99 against balance.  Measured in
  simulation before the step in flight and ``min_match_fraction`` were
  priced, TTFT p99 in ms / e2e p99 in s / load max/mean, 64 replicas and
  16,000 requests unless said (cache_aware for comparison; with them and
  pending blocks, at the defaults and round robin's knee: Zipf seeds 0-1 39
  and 49 ms / 3.13 s / 1.79-1.88 against cache_aware's 109 and 90 ms,
  document QA seeds 0-1 24 and 23 ms / 0.65 s / 1.96-1.97 against 219 and
  44 ms)::

      factor, slack     Zipf 1.0 prefixes, seeds 0-2  document QA, seeds 0-2        256 replicas, 64k req
      None              41-55 / 3.18-3.25 / 1.97-1.99  22 / 0.64 / 2.43 (seed 1)     33 / 2.98-3.02 / 1.92-1.95 (seeds 0-1)
      2, 8 (default)    49-59 / 3.08-3.20 / 1.80-1.85  22-23 / 0.61-0.63 / 1.72-1.95  32-33 / 2.94-2.96 / 1.92-1.94 (seeds 0-1)
      1.5, 8            68-88 / 2.98-3.05 / 1.45-1.53  23-24 / 0.61-0.63 / 1.53 (seeds 1-2)  32 / 2.79 / 1.46 (seed 0)
      1.2, 2            77-99 / 2.9 / 1.21             164 / 0.67 / 1.21 (seed 1)     32-33 / 2.66-2.69 / 1.19-1.20 (seeds 0-1)
      cache_aware       71-123 / 3.42 (seed 0) / 1.49-1.81  44-201 / 0.86-0.90 / 1.72-3.21  35-43 / 3.42-3.52 / 1.59-2.18 (seeds 0-1)

  A factor of 2 keeps the TTFT tail below cache_aware's on all of these;
  smaller factors balance better and shorten e2e p99 a little, at a
  higher TTFT p99 where prefixes are long (1.2: 7x on document QA).  The
  slack matters at start-up (see ``RecentShare``): with 2, on 64 replicas
  with equally popular prefixes, one early burst spilled a prefix to a
  second, idle replica, so a prefix that first came later found none idle
  and doubled up with another, and load max/mean ended at 1.30 (seed 1).
  With 8 the bound does not bind there (TTFT p99 29.65 / 29.60 / 29.74 /
  29.67 ms on seeds 0-3 against cache_aware's 29.65 / 29.60 / 29.74 /
  29.69), at 8 replicas or on multi-turn chat.  It costs some of the Zipf
  tail (35-39 ms with a slack of 2).  ``share_factor=None`` turns it off.
  NOTE: there (64 equally popular prefixes, 64 replicas) no routing was
  found to beat cache_aware: both keep each prefix on a replica of its own,
  and their runs are identical.  Of the 160 requests above TTFT p99 (16,000
  measured), about 80 are the 64 first prefills and the requests that
  waited for them, 0.1 s or more under any policy; p99 is the 80th slowest
  hit, set by arrivals that meet in one replica's step.  A second holder of a
  prefix costs one more first prefill, and a 0.11 s step that delays the
  hits on its replica: tie tolerances of 0 and 2 steps left the run
  identical, and ``share_factor=1.2, share_slack=2`` made it 29.82 ms.
* ``decode_horizon`` (default 0: off) charges the decoding that follows,
  over that many tokens (or the request's ``max_tokens`` if fewer)::

      decode = horizon * (step time there + c * running there) + b * uncached * running there

  its own time per token, the slowdown of the running decodes there, and
  their stall while its uncached prompt is computed.  NOTE: measured on the
  multi-turn workload at 8 replicas, any horizon from 4 to 64 tokens moved
  turns off their history often enough to raise TTFT p99 from 0.037 s to
  0.06-0.14 s (each move recomputes a long history); bounded loads did
  not, and on 256 replicas they cut load max/mean from 5.3 to 2.5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvserve.scheduler.checks import check_ints, check_numbers
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.routing.recent_share import RecentShare
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
        match_pending: bool = True,
    ) -> None:
        if cost_model is not None and not isinstance(cost_model, StepCostModel):
            raise TypeError(f"cost_model must be a StepCostModel, got {cost_model!r}")
        self.cost_model = cost_model or StepCostModel.default()
        check_ints(2, max_num_batched_tokens=max_num_batched_tokens)
        check_ints(0, load_slack=load_slack, decode_horizon=decode_horizon)
        check_numbers(0, tie_tolerance_steps=tie_tolerance_steps, work_penalty=work_penalty)
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
        if not isinstance(match_pending, bool):
            raise ValueError(f"match_pending must be True or False, got {match_pending!r}")
        # Blocks a replica was sent and has not cached yet count as cached there (see the module docstring).
        self.matches_pending = match_pending
        self.recent_share = (
            None if share_factor is None else RecentShare(share_factor, share_deviations, share_window, share_slack)
        )

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
        available = None if table.all_available else table.available
        uncached = self._uncached_tokens(request, table, index)
        step_time = self._step_time(table)
        score = self._estimate(table, uncached, step_time)
        waiting = table.num_waiting if available is None else table.num_waiting[available]
        min_waiting = int(waiting.min())
        if self.work_penalty and min_waiting:
            score += self.work_penalty * self.cost_model.b * min_waiting * uncached
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
        tolerance = self.tie_tolerance_steps * float(step_time[best]) + 1e-12
        ties = np.flatnonzero(score <= score[best] + tolerance)
        if len(ties) > 1:
            # Fewest outstanding requests first, then the lowest score (lexsort: last key first).
            best = int(ties[np.lexsort((score[ties], outstanding[ties]))[0]])
        if self.recent_share is not None:
            self.recent_share.record(best, len(table))
        return best

    def _uncached_tokens(self, request: RoutingRequest, table: LoadTable, index: GlobalPrefixIndex) -> np.ndarray:
        """Prompt tokens ``request`` would compute on each replica, given its prefix match there.

        A match of less than ``min_match_fraction`` of the prompt counts as none.
        """
        uncached = np.full(len(table), float(request.num_prompt_tokens))
        least = self.min_match_fraction * request.num_prompt_tokens - 1e-9  # exactly the fraction counts
        for replica_id, num_blocks in index.match(request.block_hashes, pending=self.matches_pending).items():
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
