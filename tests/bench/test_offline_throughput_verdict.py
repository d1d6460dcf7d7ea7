"""``bench.offline_throughput``'s table and verdict: the ratio says which way is faster, a request that got
other tokens from the two engines fails the run, and a bad ``--model`` is a usage error."""

from __future__ import annotations

import pytest

from kvserve.bench import offline_throughput
from kvserve.bench.offline_throughput import HEADERS, WorkloadResult, mismatches


def result(num_same: int) -> WorkloadResult:
    return WorkloadResult("(a) 64 prompts", num_requests=64, num_generated=6000, num_prompt_tokens=1000,
                          num_cached_tokens=200, hf_s=10.0, kv_s=2.0, num_same=num_same)


def test_the_ratio_column_is_kvserve_over_transformers_and_says_above_one_is_kvserve_faster() -> None:
    row = dict(zip(HEADERS, result(64).row()))
    assert row["kvserve / transformers (>1: kvserve faster)"] == "5.00x"  # 3000 tok/s against 600
    assert (row["transformers tok/s"], row["kvserve tok/s"]) == ("600", "3000")
    assert row["same tokens"] == "64 / 64" and row["prefill computed / prompt"] == "800 / 1000"


def test_a_request_with_other_tokens_is_a_mismatch_and_agreement_is_none() -> None:
    assert mismatches([result(64)]) == []
    assert mismatches([result(64), result(61)]) == [
        "MISMATCH: (a) 64 prompts: 3 of 64 requests got other tokens from kvserve than from transformers"
    ]


def test_a_model_that_is_not_a_directory_is_a_usage_error_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        offline_throughput.main(["--model", "/nonexistent/model"])
    assert info.value.code == 2
    assert "argument --model: '/nonexistent/model' is not a model directory" in capsys.readouterr().err
