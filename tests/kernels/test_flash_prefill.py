"""The tensor-core prefill path: which rows go to FlashAttention, and the K/V it is given.

On CPU, FlashAttention's variable-length kernel is stood in for by per-request SDPA
with the same contract (causal, aligned to the bottom right, GQA): the plan, the
gather from the paged cache and the scatter back must give the torch reference's
output on every prefill token.  On a GPU the real kernel is compared too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import reference
from kvserve.kernels.flash_prefill import plan_prefill, prefill_attention
from tests.kernels.paged_batch import MIXED_BATCH, make_batch


def sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_query_len, max_seq_len, scale) -> torch.Tensor:
    """FlashAttention's varlen contract, one request at a time, in float32."""
    outputs = []
    group = q.shape[1] // k.shape[1]
    for r in range(len(cu_seqlens_q) - 1):
        q_r = q[cu_seqlens_q[r] : cu_seqlens_q[r + 1]].float()
        k_r = k[cu_seqlens_k[r] : cu_seqlens_k[r + 1]].float().repeat_interleave(group, dim=1)
        v_r = v[cu_seqlens_k[r] : cu_seqlens_k[r + 1]].float().repeat_interleave(group, dim=1)
        num_q, num_k = q_r.shape[0], k_r.shape[0]
        assert num_q <= max_query_len and num_k <= max_seq_len
        # Bottom-right causal alignment: query j sees keys up to num_k - num_q + j.
        mask = torch.arange(num_k)[None, :] <= torch.arange(num_q)[:, None] + (num_k - num_q)
        out = F.scaled_dot_product_attention(
            q_r.transpose(0, 1), k_r.transpose(0, 1), v_r.transpose(0, 1), attn_mask=mask, scale=scale
        )
        outputs.append(out.transpose(0, 1).to(q.dtype))
    return torch.cat(outputs)


def prefill_token_rows(metadata) -> list[int]:
    starts = metadata.query_start_loc_cpu
    return [t for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] > 1 for t in range(starts[r], starts[r + 1])]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_gathered_prefill_equals_the_reference_on_every_prefill_token(group: int, block_size: int) -> None:
    batch = make_batch(MIXED_BATCH, block_size=block_size, group=group)
    plan = plan_prefill(batch.metadata, block_size)
    assert plan is not None
    output = prefill_attention(batch.query, batch.key_cache, batch.value_cache, plan, batch.scale, sdpa_varlen)
    expected = reference.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    rows = prefill_token_rows(batch.metadata)
    assert output.shape == (len(rows), *batch.query.shape[1:])
    torch.testing.assert_close(output, expected[rows], rtol=1e-5, atol=1e-5)


def test_plan_names_the_decode_rows_for_the_decode_kernel() -> None:
    batch = make_batch(MIXED_BATCH, block_size=16, group=2)
    plan = plan_prefill(batch.metadata, 16)
    decodes = [(cached + new) for cached, new in MIXED_BATCH if new == 1]
    assert plan.decode_metadata.seq_lens_cpu == tuple(decodes)
    assert plan.decode_metadata.query_start_loc_cpu == tuple(range(len(decodes) + 1))
    assert plan.max_query_len == max(new for _, new in MIXED_BATCH)
    assert plan.cu_seqlens_k.tolist()[-1] == sum(cached + new for cached, new in MIXED_BATCH if new > 1)
    decode_reqs = [r for r, (_, new) in enumerate(MIXED_BATCH) if new == 1]
    assert plan.decode_metadata.block_tables.tolist() == batch.metadata.block_tables[decode_reqs].tolist()
    assert plan.decode_metadata.seq_lens.tolist() == decodes
    starts = batch.metadata.query_start_loc_cpu
    assert plan.decode_token_indices.tolist() == [starts[r] for r in decode_reqs]
    # Each decode's own cache slot, as the whole batch's metadata had it.
    assert plan.decode_metadata.slot_mapping.tolist() == batch.metadata.slot_mapping[
        [starts[r] for r in decode_reqs]
    ].tolist()


def test_one_run_of_prefill_tokens_is_taken_as_a_slice() -> None:
    batch = make_batch([(3, 1), (9, 1), (0, 12), (30, 5)], block_size=4, group=2)
    plan = plan_prefill(batch.metadata, 4)
    assert plan.token_indices == slice(2, 19)


def test_a_batch_of_prefill_rows_only_is_covered_by_its_plan() -> None:
    # The backend then returns FlashAttention's output as the whole batch's, without a copy.
    prompts = make_batch([(0, 12), (30, 5)], block_size=4, group=2)
    assert plan_prefill(prompts.metadata, 4).covers_batch(prompts.metadata.num_tokens)
    mixed = make_batch([(3, 1), (0, 12), (30, 5)], block_size=4, group=2)
    assert not plan_prefill(mixed.metadata, 4).covers_batch(mixed.metadata.num_tokens)
    scattered = make_batch([(0, 12), (3, 1), (30, 5)], block_size=4, group=2)
    assert not plan_prefill(scattered.metadata, 4).covers_batch(scattered.metadata.num_tokens)


def test_a_decode_only_batch_has_no_prefill_plan() -> None:
    batch = make_batch([(5, 1), (40, 1)], block_size=16, group=2)
    assert plan_prefill(batch.metadata, 16) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_kernel_on_the_gpu_equals_the_reference(dtype: torch.dtype) -> None:
    from kvserve.kernels.flash_prefill import flash_varlen_attention

    requests = [(0, 300), (37, 1), (200, 77), (1000, 1), (4096, 512), (16, 16)]
    batch = make_batch(requests, block_size=16, group=4, head_dim=128, num_kv_heads=2, dtype=dtype)
    query, key_cache, value_cache = (t.cuda() for t in (batch.query, batch.key_cache, batch.value_cache))
    metadata = type(batch.metadata)(
        **{
            name: getattr(batch.metadata, name).cuda() if isinstance(getattr(batch.metadata, name), torch.Tensor)
            else getattr(batch.metadata, name)
            for name in batch.metadata.__slots__
        }
    )
    plan = plan_prefill(metadata, 16)
    output = prefill_attention(query, key_cache, value_cache, plan, batch.scale, flash_varlen_attention)
    expected = reference.paged_attention(query, key_cache, value_cache, metadata, batch.scale)
    rows = prefill_token_rows(metadata)
    torch.testing.assert_close(output.float(), expected[rows].float(), rtol=2e-2, atol=2e-2)
