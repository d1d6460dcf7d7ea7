"""The routing policy a ``ClusterConfig`` builds: the simulated replicas' cost model, cost models by name,
policies of one's own by ``module:Class``."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from kvserve.cluster.config import ClusterConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy
from kvserve.scheduler.simulation.simulated_worker import SimulationConfig

MEASURED = "llama-3-8b-h100"
CUSTOM = "tests.scheduler.routing.test_policy_names:LastReplicaPolicy"


def simulated(**kwargs) -> ClusterConfig:
    simulation = SimulationConfig(cost_model=StepCostModel.load(MEASURED))
    return ClusterConfig.from_kwargs("/models/m", num_blocks=64, simulation=simulation, **kwargs)


def test_cost_ttft_prices_with_the_simulated_replicas_cost_model() -> None:
    # The replicas slept a=0.01137, b=6.47e-05; the router priced StepCostModel.default()'s a=0.007, b=5e-05.
    policy = simulated(routing="cost_ttft").routing_policy()

    assert isinstance(policy, CostTTFTPolicy) and policy.cost_model == StepCostModel.load(MEASURED)


def test_a_routing_arg_cost_model_overrides_the_simulated_one() -> None:
    told = StepCostModel(a=0.02, b=1e-4, c=0.0, d=0.0)
    policy = simulated(routing="cost_ttft", routing_args={"cost_model": told}).routing_policy()

    assert isinstance(policy, CostTTFTPolicy) and policy.cost_model == told


def test_a_routing_arg_cost_model_may_name_a_measured_model_or_a_file(tmp_path: Path) -> None:
    # It said "cost_model must be a StepCostModel, got 'llama-3-8b-h100'": a GPU fleet could not name its model.
    file = tmp_path / "cost.json"
    StepCostModel(a=0.03, b=2e-4, c=0.0, d=0.0).save(file)

    by_name = ClusterConfig.from_kwargs("/models/m", routing_args={"cost_model": MEASURED})
    by_path = ClusterConfig.from_kwargs("/models/m", routing_args={"cost_model": file})

    # Read where the config is made, so the scheduler actor (maybe on another node) needs no file.
    assert by_name.routing_args["cost_model"] == StepCostModel.load(MEASURED)
    assert by_name.routing_policy().cost_model == StepCostModel.load(MEASURED)  # type: ignore[attr-defined]
    assert by_path.routing_policy().cost_model.a == 0.03  # type: ignore[attr-defined]


def test_a_routing_arg_cost_model_that_names_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="routing_args: cost_model no-such-model: no such file, nor a measured cost"):
        ClusterConfig.from_kwargs("/models/m", routing_args={"cost_model": "no-such-model"})


def test_a_gpu_cluster_without_a_cost_model_prices_with_the_default() -> None:
    policy = ClusterConfig.from_kwargs("/models/m").routing_policy()

    assert isinstance(policy, CostTTFTPolicy) and policy.cost_model == StepCostModel.default()


def test_a_policy_of_ones_own_is_named_by_module_and_class_and_survives_pickling() -> None:
    config = ClusterConfig.from_kwargs("/models/m", routing=CUSTOM, routing_args={"offset": 2})

    policy = pickle.loads(pickle.dumps(config)).routing_policy()

    assert type(policy).__name__ == "LastReplicaPolicy" and policy.offset == 2  # type: ignore[attr-defined]


def test_a_policy_name_that_names_nothing_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="^routing: routing policy 'kvserve_no_such_module:P': cannot import"):
        ClusterConfig.from_kwargs("/models/m", routing="kvserve_no_such_module:P")


def test_the_model_may_be_a_path_object() -> None:
    # It said "model must be a non-empty path string".
    assert ClusterConfig.from_kwargs(Path("/models/m")).engine.model == "/models/m"
