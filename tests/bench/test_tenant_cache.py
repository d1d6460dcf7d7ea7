"""The tenant-cache benchmark measures what it claims: B's flood costs A its prefix hits
without a share, and the share gives them back."""

from __future__ import annotations

from kvserve.bench.tenant_cache import A_PREFIX_LEN, A_QUESTION_LEN, make_arrivals, simulate
from kvserve.scheduler.cost_model import StepCostModel


def test_a_flood_costs_tenant_a_its_hits_without_a_share_and_not_with_one() -> None:
    cost_model = StepCostModel.default()
    alone = simulate(make_arrivals(0.0, 10.0), None, cost_model).hit_rate["A"]
    flooded = make_arrivals(32.0, 10.0)
    off = simulate(flooded, None, cost_model)
    on = simulate(flooded, 0.5, cost_model)

    assert 0.5 < alone < A_PREFIX_LEN / (A_PREFIX_LEN + A_QUESTION_LEN)
    assert off.hit_rate["A"] < 0.6 * alone
    assert on.hit_rate["A"] > 0.85 * alone
    assert on.mean_ttft_s < off.mean_ttft_s
    assert off.hit_rate["B"] == on.hit_rate["B"] == 0.0  # unique prompts
