"""One rule for the values of KEY=VALUE settings, whichever flag takes them."""

from __future__ import annotations

import pytest

from kvserve.cli import build_parser
from kvserve.cluster.cli_values import key_value, setting_value


@pytest.mark.parametrize(
    ("text", "value"),
    [("3", 3), ("-2", -2), ("0.5", 0.5), ("1e-3", 1e-3), ("inf", float("inf")), ("True", True), ("false", False),
     (" None ", None), ("llama-3-8b-h100", "llama-3-8b-h100"), ("", "")],
)
def test_a_value_is_a_number_a_bool_none_or_the_text(text, value) -> None:
    assert setting_value(text) == value and type(setting_value(text)) is type(value)


def test_key_value_splits_at_the_first_equals_sign_and_refuses_a_missing_key() -> None:
    assert key_value(" path = a=b ") == ("path", "a=b")
    for bad in ("no_equals", "=3"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            key_value(bad)


def test_serve_and_experiment_read_the_same_text_the_same_way() -> None:
    from kvserve.experiments.experiment_setup import parse_key_values

    items = ["cache_threshold=0.5", "load_factor=none", "flag=TRUE", "name=x"]
    serve = build_parser().parse_args(["serve", *(arg for item in items for arg in ("--routing-arg", item))])
    assert serve.routing_args == parse_key_values(items, "--policy-arg") == [
        ("cache_threshold", 0.5), ("load_factor", None), ("flag", True), ("name", "x")
    ]
