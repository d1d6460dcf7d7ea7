"""``kvserve serve``'s routing flags reach the cluster config: the cost model, policies of one's own."""

from __future__ import annotations

import pytest

from kvserve.cluster.config import ClusterConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy

MEASURED = "llama-3-8b-h100"
CUSTOM = "tests.scheduler.routing.test_policy_names:LastReplicaPolicy"


@pytest.fixture
def configs(monkeypatch: pytest.MonkeyPatch) -> list[ClusterConfig]:
    """The configs ``serve`` builds, which then stops before starting anything."""
    import kvserve.cluster.launcher

    made: list[ClusterConfig] = []

    def resolve_model_config(config: ClusterConfig) -> None:
        made.append(config)
        raise ValueError("stop before starting anything")

    monkeypatch.setattr(kvserve.cluster.launcher, "resolve_model_config", resolve_model_config)
    return made


def serve(*args: str) -> int:
    from kvserve.cli import main

    return main(["serve", "--model", "/models/m", *args])


def test_simulated_serve_routes_with_the_cost_model_its_replicas_take(configs: list[ClusterConfig]) -> None:
    # The replicas took --cost-model, the router StepCostModel.default().
    assert serve("--simulated", "--num-blocks", "64", "--cost-model", MEASURED) == 2

    policy = configs[0].routing_policy()
    assert isinstance(policy, CostTTFTPolicy) and policy.cost_model == StepCostModel.load(MEASURED)


def test_a_gpu_serve_may_name_the_routers_cost_model(configs: list[ClusterConfig]) -> None:
    # It said "--routing-arg: bad arguments ...: cost_model must be a StepCostModel, got 'llama-3-8b-h100'".
    assert serve("--routing-arg", f"cost_model={MEASURED}") == 2

    policy = configs[0].routing_policy()
    assert isinstance(policy, CostTTFTPolicy) and policy.cost_model == StepCostModel.load(MEASURED)


def test_serve_routes_with_a_policy_of_ones_own(configs: list[ClusterConfig]) -> None:
    assert serve("--routing", CUSTOM, "--routing-arg", "seed=4") == 2

    assert (configs[0].routing, configs[0].routing_policy().seed) == (CUSTOM, 4)  # type: ignore[attr-defined]


def test_serve_refuses_a_routing_name_that_names_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serve("--routing", "kvserve_no_such_module:Policy")

    assert exit_info.value.code == 2
    assert (
        "argument --routing: routing policy 'kvserve_no_such_module:Policy': cannot import kvserve_no_such_module"
        in capsys.readouterr().err
    )


def test_serve_names_the_flag_of_a_routing_cost_model_that_names_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve("--routing-arg", "cost_model=no-such-model") == 2

    assert capsys.readouterr().err.startswith("kvserve serve: error: --routing-arg: cost_model no-such-model: no such")
