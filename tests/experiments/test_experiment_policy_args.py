"""The arguments an experiment gives its policies: ``--seed``, ``--cost-model`` and the step budget to every
policy that takes them, built-in or ``module:Class``; ``--policy-arg`` for the rest."""

from __future__ import annotations

import pytest

from kvserve.experiments.experiment_setup import (
    ExperimentError,
    choose_baseline,
    default_policy_kwargs,
    parse_policies,
    parse_policy_args,
)
from kvserve.scheduler.cost_model import StepCostModel

CUSTOM = "tests.scheduler.routing.test_policy_names:LastReplicaPolicy"
MODEL = StepCostModel(a=0.01137, b=6.47e-05, c=0.0, d=0.0)


def offered(policy: str) -> dict[str, object]:
    return default_policy_kwargs(policy, seed=7, cost_model=MODEL, max_num_batched_tokens=512)


def test_a_policy_of_ones_own_with_a_seed_gets_the_experiments_seed() -> None:
    # It stayed at seed 0: only the built-in policies of a hand-kept table got --seed.
    assert offered(CUSTOM) == {"seed": 7}


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("round_robin", {}),
        ("cache_aware", {}),
        ("least_loaded", {"seed": 7}),
        ("consistent_hash", {"seed": 7}),
        ("cost_ttft", {"cost_model": MODEL, "max_num_batched_tokens": 512}),
    ],
)
def test_the_built_in_policies_get_what_they_got_from_the_table(policy: str, expected: dict[str, object]) -> None:
    assert offered(policy) == expected


def test_a_policy_arg_that_the_experiment_sets_is_refused_for_a_policy_of_ones_own() -> None:
    with pytest.raises(ExperimentError, match=f"^--policy-arg {CUSTOM}.seed: the experiment sets it from --seed$"):
        parse_policy_args([f"{CUSTOM}.seed=3"], [CUSTOM])


def test_a_policy_arg_of_a_policy_of_ones_own_is_read_after_the_last_dot() -> None:
    assert parse_policy_args([f"{CUSTOM}.offset=2"], ["round_robin", CUSTOM]) == {CUSTOM: {"offset": 2}}


def test_an_argument_a_policy_does_not_take_is_left_to_its_constructor_to_refuse() -> None:
    # round_robin takes no seed: the experiment gives it none, and --policy-arg round_robin.seed is no override.
    assert parse_policy_args(["round_robin.seed=1"], ["round_robin"]) == {"round_robin": {"seed": 1}}


@pytest.mark.parametrize(
    "item, message",
    [
        ("nope.seed=1", "--policy-arg must be POLICY.KEY=VALUE with a known policy, got 'nope.seed'"),
        (f"{CUSTOM}=1", f"--policy-arg must be POLICY.KEY=VALUE with a known policy, got '{CUSTOM}'"),
        ("cost_ttft.load_slack=1", "--policy-arg cost_ttft.load_slack: cost_ttft is not run"),
        ("cost_ttft.max_num_batched_tokens=1", "the experiment sets it from --max-num-batched-tokens"),
    ],
)
def test_a_bad_policy_arg_is_refused(item: str, message: str) -> None:
    policies = ["cost_ttft"] if "max_num" in item else ["round_robin"]
    with pytest.raises(ExperimentError, match=message.replace(".", r"\.")):
        parse_policy_args([item], policies)


def test_policies_and_a_baseline_of_ones_own_are_named_as_module_colon_class() -> None:
    assert parse_policies(f"round_robin,{CUSTOM}") == ["round_robin", CUSTOM]
    assert choose_baseline(CUSTOM, ["round_robin", CUSTOM], knee=True) == CUSTOM
    with pytest.raises(ExperimentError, match="^--policies: routing policy 'no_such_module:P': cannot import"):
        parse_policies("round_robin,no_such_module:P")
    with pytest.raises(ExperimentError, match="^unknown policies nope; .* or name your own as module:Class"):
        parse_policies("nope")
