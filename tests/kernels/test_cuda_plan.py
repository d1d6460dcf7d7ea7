"""How the CUDA backend cuts a batch's contexts into splits: host-only, runs on CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvserve.kernels import cuda_plan
from kvserve.kernels.cuda_plan import MAX_SPLIT_TOKENS, MIN_SPLIT_TOKENS, SplitPlan, plan_splits

H100_SMS = 132
HEADER = Path(__file__).resolve().parents[2] / "kernels" / "csrc" / "paged_attention_cuda.h"


def decode_batch(seq_lens: list[int]) -> tuple[list[int], list[int]]:
    return list(range(len(seq_lens) + 1)), seq_lens


def test_python_constants_match_the_kernel_header() -> None:
    header = HEADER.read_text()

    def constant(name: str) -> int:
        match = re.search(rf"constexpr int {name} = (\d+);", header)
        assert match, f"{name} not found in {HEADER.name}"
        return int(match.group(1))

    assert cuda_plan.MAX_SPLIT_TOKENS == constant("kMaxSplitTokens")
    assert cuda_plan.SPLIT_TOKENS_MULTIPLE == constant("kSplitTokensMultiple")
    assert cuda_plan.PREFILL_ROWS == constant("kPrefillRows")
    assert cuda_plan.MAX_DECODE_ROWS == constant("kMaxDecodeRows")


@pytest.mark.parametrize(("group", "rows"), [(1, 1), (2, 4), (3, 4), (4, 4), (5, 8), (8, 8), (16, 8)])
def test_decode_rows_follow_the_group(group: int, rows: int) -> None:
    assert cuda_plan.decode_rows_for_group(group) == rows


def test_a_single_long_decode_is_split_to_fill_the_gpu() -> None:
    plan = plan_splits(*decode_batch([4096]), num_kv_heads=8, group=4, num_sms=H100_SMS)
    assert plan == SplitPlan(split_tokens=MIN_SPLIT_TOKENS, num_decode_splits=4096 // MIN_SPLIT_TOKENS,
                             num_prefill_splits=0)


def test_a_large_batch_of_short_decodes_is_not_split() -> None:
    plan = plan_splits(*decode_batch([512] * 256), num_kv_heads=8, group=4, num_sms=H100_SMS)
    assert plan.num_decode_splits == 1 and plan.max_splits == 1
    assert plan.split_tokens >= 512


def test_medium_batches_get_about_the_target_number_of_ctas() -> None:
    plan = plan_splits(*decode_batch([4096] * 16), num_kv_heads=8, group=4, num_sms=H100_SMS)
    num_ctas = 16 * 8 * plan.num_decode_splits
    target = cuda_plan.TARGET_CTAS_PER_SM * H100_SMS
    assert target / 2 <= num_ctas <= 2 * target
    assert plan.split_tokens % cuda_plan.SPLIT_TOKENS_MULTIPLE == 0


def test_splits_never_exceed_the_kernel_limit() -> None:
    plan = plan_splits(*decode_batch([100_000] * 512), num_kv_heads=8, group=4, num_sms=H100_SMS)
    assert plan.split_tokens == MAX_SPLIT_TOKENS
    assert plan.num_decode_splits == -(-100_000 // MAX_SPLIT_TOKENS)


def test_mixed_batches_count_splits_per_launch() -> None:
    # r0: prefill chunk of 64 over 1000 cached tokens; r1, r2: decodes.
    plan = plan_splits([0, 64, 65, 66], [1064, 300, 5000], num_kv_heads=8, group=4, num_sms=H100_SMS)
    assert plan.num_decode_splits == -(-5000 // plan.split_tokens)
    assert plan.num_prefill_splits == -(-1064 // plan.split_tokens)


def test_prefill_only_batches_have_no_decode_launch() -> None:
    plan = plan_splits([0, 100, 300], [100, 300], num_kv_heads=2, group=4, num_sms=H100_SMS)
    assert plan.num_decode_splits == 0 and plan.num_prefill_splits >= 1


def test_forced_split_size_is_used_as_given() -> None:
    plan = plan_splits([0, 1, 3], [1000, 129], num_kv_heads=2, group=4, num_sms=H100_SMS, split_tokens=64)
    assert plan == SplitPlan(split_tokens=64, num_decode_splits=16, num_prefill_splits=3)


@pytest.mark.parametrize("split_tokens", [0, 100, MAX_SPLIT_TOKENS + 64, -64, True])
def test_invalid_forced_split_size_is_rejected(split_tokens: int) -> None:
    with pytest.raises(ValueError, match="split_tokens must be a positive multiple of 64"):
        plan_splits([0, 1], [10], num_kv_heads=2, group=4, num_sms=H100_SMS, split_tokens=split_tokens)
