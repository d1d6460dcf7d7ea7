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
    assert cuda_plan.MIN_SPLIT_TOKENS == constant("kMinSplitTokens")


@pytest.mark.parametrize(("group", "rows"), [(1, 1), (2, 4), (3, 4), (4, 4), (5, 8), (8, 8), (16, 8)])
def test_decode_rows_follow_the_group(group: int, rows: int) -> None:
    assert cuda_plan.decode_rows_for_group(group) == rows


def test_a_single_long_decode_is_split_to_fill_the_gpu() -> None:
    plan = plan_splits(*decode_batch([4096]), num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)
    assert plan == SplitPlan(split_tokens=MIN_SPLIT_TOKENS, num_decode_splits=4096 // MIN_SPLIT_TOKENS,
                             num_prefill_splits=0)


def test_a_large_batch_of_short_decodes_is_not_split() -> None:
    plan = plan_splits(*decode_batch([512] * 256), num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)
    assert plan.num_decode_splits == 1 and plan.max_splits == 1
    assert plan.split_tokens >= 512


def test_medium_batches_get_about_the_target_number_of_ctas() -> None:
    plan = plan_splits(*decode_batch([4096] * 16), num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)
    num_ctas = 16 * 8 * plan.num_decode_splits
    target = cuda_plan.TARGET_CTAS_PER_SM * H100_SMS
    assert target / 2 <= num_ctas <= 2 * target
    assert plan.split_tokens % cuda_plan.SPLIT_TOKENS_MULTIPLE == 0


def test_splits_never_exceed_the_kernel_limit() -> None:
    plan = plan_splits(*decode_batch([100_000] * 512), num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)
    assert plan.split_tokens == MAX_SPLIT_TOKENS
    assert plan.num_decode_splits == -(-100_000 // MAX_SPLIT_TOKENS)


def test_mixed_batches_count_splits_per_launch() -> None:
    # r0: prefill chunk of 64 over 1000 cached tokens; r1, r2: decodes.
    plan = plan_splits([0, 64, 65, 66], [1064, 300, 5000], num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)
    assert plan.num_decode_splits == -(-5000 // plan.split_tokens)
    assert plan.num_prefill_splits == -(-1064 // plan.split_tokens)


def test_prefill_only_batches_have_no_decode_launch() -> None:
    plan = plan_splits([0, 100, 300], [100, 300], num_kv_heads=2, group=4, num_sms=H100_SMS, head_dim=128)
    assert plan.num_decode_splits == 0 and plan.num_prefill_splits >= 1


def test_forced_split_size_is_used_as_given() -> None:
    plan = plan_splits([0, 1, 3], [1000, 129], num_kv_heads=2, group=4, num_sms=H100_SMS, split_tokens=64, head_dim=128)
    assert plan == SplitPlan(split_tokens=64, num_decode_splits=16, num_prefill_splits=3)


@pytest.mark.parametrize("split_tokens", [0, 100, MAX_SPLIT_TOKENS + 64, -64, True])
def test_invalid_forced_split_size_is_rejected(split_tokens: int) -> None:
    with pytest.raises(ValueError, match="split_tokens must be a positive multiple of 64"):
        plan_splits([0, 1], [10], num_kv_heads=2, group=4, num_sms=H100_SMS, split_tokens=split_tokens, head_dim=128)


def workspace_bytes(plan: SplitPlan, num_tokens: int, num_heads: int, head_dim: int) -> int:
    """What the binding allocates for the combine: nothing for a single split."""
    return num_tokens * num_heads * plan.max_splits * (head_dim + 2) * 4 if plan.max_splits > 1 else 0


@pytest.mark.parametrize(("chunk", "context"), [(2048, 32_768), (512, 100_000), (64, 20_000)])
def test_one_decode_beside_a_long_prefill_chunk_keeps_the_workspace_in_budget(chunk: int, context: int) -> None:
    # r0: a prefill chunk over a long context; r1: one short decode (it alone would choose 128 tokens).
    query_start_loc, seq_lens = [0, chunk, chunk + 1], [context, 4096]
    plan = plan_splits(query_start_loc, seq_lens, num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)

    assert workspace_bytes(plan, chunk + 1, 32, 128) <= cuda_plan.MAX_WORKSPACE_BYTES
    assert plan.split_tokens % 64 == 0 and plan.split_tokens <= MAX_SPLIT_TOKENS
    assert plan.num_prefill_splits == -(-context // plan.split_tokens)
    assert plan.num_decode_splits == -(-4096 // plan.split_tokens)


def test_a_context_longer_than_the_largest_split_still_takes_its_splits() -> None:
    # 2,048 tokens over 128k: even 8,192-token splits need 16 of them, over the budget.
    plan = plan_splits([0, 2048], [131_072], num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)

    assert plan == SplitPlan(split_tokens=MAX_SPLIT_TOKENS, num_decode_splits=0, num_prefill_splits=16)


def test_the_workspace_budget_leaves_decode_batches_alone() -> None:
    # The benchmark's shapes: the budget never binds, so the split size is the one for the GPU.
    for num_reqs, context in [(1, 16_384), (16, 4096), (64, 4096), (256, 16_384)]:
        plan = plan_splits(*decode_batch([context] * num_reqs), num_kv_heads=8, group=4, num_sms=H100_SMS, head_dim=128)
        assert workspace_bytes(plan, num_reqs, 32, 128) <= cuda_plan.MAX_WORKSPACE_BYTES
        target = cuda_plan._split_tokens_for(context, num_reqs * 8, cuda_plan.TARGET_CTAS_PER_SM * H100_SMS)
        assert plan.split_tokens == target
