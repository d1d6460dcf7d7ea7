"""The cost model and step budget a fleet simulation's policy prices with: its own if it was given them, else
the fleet's."""

from __future__ import annotations

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator

FLEET_MODEL = StepCostModel(a=0.01137, b=6.47e-05, c=1e-3, d=0.0)


def fleet() -> FleetConfig:
    return FleetConfig(
        num_replicas=2,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048),
        cache_config=CacheConfig(block_size=16, num_blocks=64),
        cost_model=FLEET_MODEL,
    )


def test_a_policy_built_without_a_cost_model_prices_with_the_fleets() -> None:
    # It priced with StepCostModel.default() while the simulated steps took the fleet's model.
    policy = make_policy("cost_ttft")
    FleetSimulator(fleet(), policy)

    assert isinstance(policy, CostTTFTPolicy) and policy.cost_model == FLEET_MODEL


def test_a_policy_built_without_a_step_budget_prices_steps_of_the_fleets() -> None:
    # It priced steps of 2048 tokens while the simulated replicas took 512.
    policy = make_policy("cost_ttft")
    FleetSimulator(fleet(), policy)
    assert policy.max_num_batched_tokens == 512
    given = make_policy("cost_ttft", max_num_batched_tokens=1024)
    FleetSimulator(fleet(), given)
    assert given.max_num_batched_tokens == 1024


def test_a_policy_given_a_cost_model_keeps_it() -> None:
    own = StepCostModel(a=0.02, b=1e-4, c=0.0, d=0.0)
    policy = make_policy("cost_ttft", cost_model=own)
    FleetSimulator(fleet(), policy)

    assert isinstance(policy, CostTTFTPolicy) and policy.cost_model == own


def test_a_policy_without_a_cost_model_is_left_as_it_is() -> None:
    policy = make_policy("round_robin")
    simulator = FleetSimulator(fleet(), policy)

    assert simulator.router.policy is policy
