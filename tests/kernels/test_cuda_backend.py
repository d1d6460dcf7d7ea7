"""The CUDA kernels against the torch reference (computed in float64), on a GPU.

Every test needs a CUDA device (``@pytest.mark.gpu``; skipped elsewhere).  Inputs are
fresh random values in shuffled, non-contiguous blocks of a cache filled with NaN
outside the written slots, so that a read at or beyond seq_len shows as NaN.

Tolerances on ‖out − ref‖ / ‖ref‖ against the float64 reference: float32 1e-5 (the
kernels accumulate in float32), float16 1e-3 and bfloat16 8e-3 (the output's own
rounding: 2^-11 and 2^-8 relative per element); element-wise as in the CPU tests.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import pytest
import torch

from kvserve.kernels import AttentionMetadata, build_attention_metadata, get_attention_backend, reference
from kvserve.kernels.backend import BACKEND_ENV_VAR

pytestmark = pytest.mark.gpu

RELATIVE_TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ELEMENT_TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Decodes: contexts of one token, ending just before, on and after a block boundary, and long
# enough for several context splits at the default plan.
DECODE_CONTEXTS = [1, 15, 16, 17, 31, 32, 33, 40, 99, 700, 3001]
# (cached tokens, new tokens): chunks with and without cached context among decodes.
MIXED_BATCH = [(0, 7), (37, 1), (20, 13), (63, 1), (0, 1), (5, 1), (16, 16), (1000, 40), (2500, 1)]
PREFILL_ONLY = [(0, 50), (0, 2), (0, 129), (0, 16)]
CHUNKED_PREFILL = [(1000, 64), (37, 100), (3000, 5), (15, 17), (4095, 2)]


@dataclass(frozen=True, slots=True)
class CudaBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    new_keys: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], this step's K/V
    new_values: torch.Tensor
    scale: float


def make_batch(
    requests: list[tuple[int, int]],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    write_new_tokens: bool = True,
) -> CudaBatch:
    """Random K/V in shuffled blocks of a NaN-filled cache on the GPU; every other request's
    table carries an unused trailing block."""
    generator = torch.Generator().manual_seed(seed)
    query_lens = [new for _, new in requests]
    seq_lens = [cached + new for cached, new in requests]
    blocks_per_req = [-(-seq_len // block_size) + r % 2 for r, seq_len in enumerate(seq_lens)]
    num_blocks = sum(blocks_per_req) + 3
    free_block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = []
    for count in blocks_per_req:
        block_tables.append(free_block_ids[:count])
        del free_block_ids[:count]
    metadata = build_attention_metadata(query_lens, seq_lens, block_tables, block_size, "cuda")

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    # Every context position of every request: its slot, and whether it is new this step.
    slots, is_new = [], []
    for (cached, new), table in zip(requests, block_tables):
        positions = torch.arange(cached + new)
        slots.append(torch.tensor(table)[positions // block_size] * block_size + positions % block_size)
        is_new.append(positions >= cached)
    slots_t, is_new_t = torch.cat(slots).cuda(), torch.cat(is_new).cuda()
    keys = torch.randn(len(slots_t), num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
    values = torch.randn(len(slots_t), num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
    written = slots_t if write_new_tokens else slots_t[~is_new_t]
    rows = torch.ones_like(is_new_t) if write_new_tokens else ~is_new_t
    key_cache.view(-1, num_kv_heads, head_dim)[written] = keys[rows]
    value_cache.view(-1, num_kv_heads, head_dim)[written] = values[rows]
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator).to("cuda", dtype)
    return CudaBatch(query, key_cache, value_cache, metadata, keys[is_new_t], values[is_new_t],
                     scale=0.9 * head_dim**-0.5)


def float64_reference(batch: CudaBatch, query: torch.Tensor | None = None) -> torch.Tensor:
    query = batch.query if query is None else query
    return reference.paged_attention(
        query.double(), batch.key_cache.double(), batch.value_cache.double(), batch.metadata, batch.scale
    )


def assert_matches_reference(output: torch.Tensor, batch: CudaBatch) -> None:
    expected = float64_reference(batch)
    dtype = batch.query.dtype
    assert output.shape == batch.query.shape and output.dtype == dtype
    assert not output.isnan().any(), "NaN in the output: a read at or beyond seq_len, or an unwritten row"
    relative = ((output.double() - expected).norm() / expected.norm()).item()
    assert relative < RELATIVE_TOLERANCES[dtype], f"relative error {relative:.2e}"
    tolerance = ELEMENT_TOLERANCES[dtype]
    torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


def attend(backend, batch: CudaBatch) -> torch.Tensor:
    return backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)


@pytest.fixture(scope="module")
def backend():
    from kvserve.kernels.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend()


@pytest.fixture(scope="module")
def cuda_core_backend():
    """Prefill rows on the CUDA-core kernel too, where FlashAttention would take the 16-bit ones."""
    from kvserve.kernels.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend(flash_prefill=False)


def split_backend(split_tokens: int):
    from kvserve.kernels.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend(split_tokens=split_tokens)


# Every dtype x head_dim x group is a different score layout: lanes per key row, and the 1-2
# scores each lane owns in the transposed reduction (paged_attention_kernels.cuh).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_only_batch_matches_reference(backend, group: int, head_dim: int, block_size: int, dtype) -> None:
    requests = [(context - 1, 1) for context in DECODE_CONTEXTS]
    batch = make_batch(requests, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype,
                       seed=group * 1000 + head_dim + block_size)
    assert_matches_reference(attend(backend, batch), batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_reference(backend, group: int, head_dim: int, block_size: int, dtype) -> None:
    batch = make_batch(MIXED_BATCH, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype,
                       seed=7 + group * 1000 + head_dim + block_size)
    assert_matches_reference(attend(backend, batch), batch)


# The default backend gives 16-bit prefill rows to FlashAttention; float32 ones run on this kernel anyway.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_on_the_cuda_core_kernel_matches_reference(
    cuda_core_backend, group: int, head_dim: int, dtype
) -> None:
    batch = make_batch(MIXED_BATCH + CHUNKED_PREFILL, group=group, head_dim=head_dim, dtype=dtype,
                       seed=107 + group * 1000 + head_dim)
    assert_matches_reference(attend(cuda_core_backend, batch), batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_only_batch_matches_reference(backend, group: int, dtype) -> None:
    batch = make_batch(PREFILL_ONLY, group=group, head_dim=128, dtype=dtype, seed=11 + group)
    assert_matches_reference(attend(backend, batch), batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_chunked_prefill_over_cached_context_matches_reference(backend, group: int, block_size: int, dtype) -> None:
    batch = make_batch(CHUNKED_PREFILL, block_size=block_size, group=group, head_dim=64, dtype=dtype,
                       seed=13 + group + block_size)
    assert_matches_reference(attend(backend, batch), batch)


@pytest.mark.parametrize("group", [2, 3, 5, 6, 12, 16])
def test_groups_that_do_not_fill_a_tile_match_reference(backend, group: int) -> None:
    batch = make_batch(MIXED_BATCH, group=group, num_kv_heads=2, dtype=torch.float32, seed=17 + group)
    assert_matches_reference(attend(backend, batch), batch)


@pytest.mark.parametrize("split_tokens", [64, 128, 512, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_split_size_gives_the_reference_result(split_tokens: int, dtype) -> None:
    batch = make_batch(MIXED_BATCH + CHUNKED_PREFILL, group=4, dtype=dtype, seed=19 + split_tokens)
    assert_matches_reference(attend(split_backend(split_tokens), batch), batch)


@pytest.mark.parametrize("split_tokens", [64, 128, 512])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decodes_over_many_splits_and_partial_blocks_match_reference(
    group: int, head_dim: int, split_tokens: int
) -> None:
    # Contexts ending before, on and after block and split boundaries, up to 47 splits of 64.
    requests = [(context - 1, 1) for context in [1, 63, 64, 65, 127, 129, 500, 1000, 3001]]
    batch = make_batch(requests, group=group, head_dim=head_dim, dtype=torch.float32, seed=103 + split_tokens)
    assert_matches_reference(attend(split_backend(split_tokens), batch), batch)


def test_many_kv_heads_and_a_large_decode_batch_match_reference(backend) -> None:
    contexts = torch.randint(0, 5000, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = make_batch([(cached, 1) for cached in contexts], num_kv_heads=8, group=4, dtype=torch.bfloat16, seed=23)
    assert_matches_reference(attend(backend, batch), batch)


@pytest.mark.parametrize("block_size", [16, 32])
def test_contexts_of_16k_and_32k_tokens_match_reference(backend, block_size: int) -> None:
    # Hundreds of context splits per row: decodes ending mid-block and on a boundary, and chunks over them.
    requests = [(16383, 1), (32767, 1), (16384, 1), (16000, 16), (30000, 64), (7, 1)]
    batch = make_batch(requests, block_size=block_size, num_kv_heads=2, group=8, dtype=torch.bfloat16, seed=43)
    assert_matches_reference(attend(backend, batch), batch)


def test_a_decode_batch_of_256_in_the_benchmarks_shape_matches_reference(backend) -> None:
    contexts = torch.randint(0, 4096, (256,), generator=torch.Generator().manual_seed(47)).tolist()
    batch = make_batch([(cached, 1) for cached in contexts], num_kv_heads=8, group=4, dtype=torch.bfloat16, seed=47)
    assert_matches_reference(attend(backend, batch), batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_with_32_token_blocks_and_gqa_8_at_head_dim_128_matches_reference(backend, dtype) -> None:
    batch = make_batch(PREFILL_ONLY + [(0, 300)], block_size=32, group=8, head_dim=128, dtype=dtype, seed=53)
    assert_matches_reference(attend(backend, batch), batch)


def captured(batch: CudaBatch, bound: int) -> AttentionMetadata:
    """``batch``'s metadata as a CUDA graph captures it: host copies at the upper bound ``bound``."""
    meta = batch.metadata
    return dataclasses.replace(meta, seq_lens_cpu=(bound,) * meta.num_reqs, max_seq_len=bound, captured=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bound", [4096, 8192])
def test_a_captured_launch_cuts_each_real_context_into_its_planned_splits(backend, bound: int, dtype) -> None:
    # Planned for contexts of `bound` (up to 43 splits here), read on the device at 1-3,001 tokens.
    batch = make_batch([(context - 1, 1) for context in DECODE_CONTEXTS], group=4, dtype=dtype, seed=67)
    meta = captured(batch, bound)
    assert backend.split_plan(meta, 2, 4, 128).num_decode_splits > 8
    output = backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, meta, batch.scale)
    assert_matches_reference(output, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_captured_decode_batch_of_64_in_the_benchmarks_shape_matches_reference(backend, dtype) -> None:
    contexts = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(71)).tolist()
    batch = make_batch([(cached, 1) for cached in contexts], num_kv_heads=8, group=4, dtype=dtype, seed=71)
    output = backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, captured(batch, 8192),
                                     batch.scale)
    assert_matches_reference(output, batch)


@pytest.mark.parametrize("group", [1, 8])
def test_captured_prefill_rows_on_the_cuda_core_kernel_match_reference(group: int) -> None:
    from kvserve.kernels.cuda_backend import CudaAttentionBackend

    batch = make_batch(MIXED_BATCH + CHUNKED_PREFILL, group=group, dtype=torch.bfloat16, seed=73 + group)
    output = CudaAttentionBackend(flash_prefill=False).paged_attention(
        batch.query, batch.key_cache, batch.value_cache, captured(batch, 8192), batch.scale
    )
    assert_matches_reference(output, batch)


def test_int64_metadata_built_by_hand_gives_the_int32_result(backend) -> None:
    batch = make_batch(MIXED_BATCH + CHUNKED_PREFILL, group=4, dtype=torch.bfloat16, seed=59)
    meta = batch.metadata
    wide = dataclasses.replace(
        meta,
        block_tables=meta.block_tables.long(),
        seq_lens=meta.seq_lens.long(),
        query_start_loc=meta.query_start_loc.long(),
    )
    output = backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, wide, batch.scale)
    assert torch.equal(output, attend(backend, batch))


def test_blocks_past_two_to_the_31_cache_elements_are_read_and_written(backend) -> None:
    # 8 KV heads x head_dim 128 x 16-token blocks: 2^14 elements a block, so block 2^17 starts at 2^31.
    batch = make_batch(MIXED_BATCH, num_kv_heads=8, group=4, dtype=torch.bfloat16, seed=61, write_new_tokens=False)
    num_small = batch.key_cache.shape[0]
    offset = 2**17
    big_shape = (offset + num_small, *batch.key_cache.shape[1:])
    assert batch.key_cache[0].numel() * offset == 2**31
    big_keys = torch.full(big_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    big_values = torch.full(big_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    big_keys[offset:] = batch.key_cache
    big_values[offset:] = batch.value_cache
    meta = batch.metadata
    moved = dataclasses.replace(
        meta,
        block_tables=(meta.block_tables + offset).to(torch.int32),
        slot_mapping=meta.slot_mapping + offset * batch.key_cache.shape[1],
    )

    backend.write_kv_cache(batch.new_keys, batch.new_values, big_keys, big_values, moved.slot_mapping)
    backend.write_kv_cache(batch.new_keys, batch.new_values, batch.key_cache, batch.value_cache, meta.slot_mapping)
    assert torch.equal(big_keys[offset:].view(torch.uint8), batch.key_cache.view(torch.uint8))
    assert torch.equal(big_values[offset:].view(torch.uint8), batch.value_cache.view(torch.uint8))
    output = backend.paged_attention(batch.query, big_keys, big_values, moved, batch.scale)
    assert_matches_reference(output, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_are_bitwise_repeatable(backend, dtype) -> None:
    batch = make_batch(MIXED_BATCH + CHUNKED_PREFILL, group=4, dtype=dtype, seed=29)
    first = attend(backend, batch)
    for _ in range(5):
        assert torch.equal(attend(backend, batch), first), "results differ between runs: a race"


@pytest.mark.parametrize("group", [4, 8])
def test_kernel_writes_every_element_of_a_poisoned_output(backend, group: int) -> None:
    from kvserve.kernels.cuda_build import load_cuda_extension

    batch = make_batch(MIXED_BATCH + CHUNKED_PREFILL, group=group, dtype=torch.float32, seed=31)
    plan = backend.split_plan(batch.metadata, 2, group, batch.query.shape[2])
    out = torch.full_like(batch.query, float("nan"))
    meta = batch.metadata
    load_cuda_extension().paged_attention(
        out, batch.query, batch.key_cache, batch.value_cache, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, batch.scale, plan.split_tokens, plan.num_decode_splits, plan.num_prefill_splits,
    )
    assert not out.isnan().any()
    assert_matches_reference(out, batch)


def test_strided_query_view_gives_the_contiguous_result(backend) -> None:
    batch = make_batch(MIXED_BATCH, group=4, dtype=torch.bfloat16, seed=37)
    num_tokens, num_heads, head_dim = batch.query.shape
    # A fused QKV projection: query is a view with a row stride of (H + 2 * KVH) * head_dim.
    fused = torch.randn(num_tokens, (num_heads + 4) * head_dim, device="cuda").to(batch.query.dtype)
    fused[:, : num_heads * head_dim] = batch.query.reshape(num_tokens, -1)
    strided = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not strided.is_contiguous()
    output = backend.paged_attention(strided, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert torch.equal(output, attend(backend, batch))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_writes_exactly_the_mapped_slots(backend, dtype) -> None:
    batch = make_batch(MIXED_BATCH, group=4, dtype=dtype, seed=41, write_new_tokens=False)
    num_tokens, num_kv_heads, head_dim = batch.new_keys.shape
    # key and value as views of a fused QKV projection, as the model layers pass them.
    fused = torch.randn(num_tokens, (4 * num_kv_heads + 2 * num_kv_heads) * head_dim, device="cuda").to(dtype)
    q_size, kv_size = 4 * num_kv_heads * head_dim, num_kv_heads * head_dim
    fused[:, q_size : q_size + kv_size] = batch.new_keys.reshape(num_tokens, -1)
    fused[:, q_size + kv_size :] = batch.new_values.reshape(num_tokens, -1)
    key = fused[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    expected_keys, expected_values = batch.key_cache.clone(), batch.value_cache.clone()
    reference.write_kv_cache(key, value, expected_keys, expected_values, batch.metadata.slot_mapping)

    backend.write_kv_cache(key, value, batch.key_cache, batch.value_cache, batch.metadata.slot_mapping)

    # NaN slots must stay NaN and written slots equal: compare bit patterns.
    assert torch.equal(batch.key_cache.view(torch.uint8), expected_keys.view(torch.uint8))
    assert torch.equal(batch.value_cache.view(torch.uint8), expected_values.view(torch.uint8))
    assert_matches_reference(attend(backend, batch), batch)


def test_unsupported_head_dim_falls_back_to_the_reference(backend, caplog: pytest.LogCaptureFixture) -> None:
    batch = make_batch(MIXED_BATCH, group=4, head_dim=80, dtype=torch.float32, seed=43)
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.cuda_backend"):
        output = attend(backend, batch)
    assert "head_dim 80" in caplog.text
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert torch.equal(output, reference.paged_attention(*args))


@pytest.mark.parametrize(
    ("head_dim", "block_size", "message"),
    [(96, 16, "head_dim 96 is not supported"), (64, 8, "block_size 8 is not supported")],
)
def test_kernel_rejects_unsupported_shapes_with_a_clear_error(head_dim: int, block_size: int, message: str) -> None:
    from kvserve.kernels.cuda_build import load_cuda_extension

    batch = make_batch([(3, 1)], block_size=block_size, head_dim=head_dim, dtype=torch.float16, seed=47)
    meta = batch.metadata
    with pytest.raises(RuntimeError, match=message):
        load_cuda_extension().paged_attention(
            torch.empty_like(batch.query), batch.query, batch.key_cache, batch.value_cache, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, batch.scale, 128, 1, 0,
        )


def test_automatic_selection_on_cuda_is_the_cuda_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    assert get_attention_backend("cuda").name == "cuda"
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert get_attention_backend("cuda").name == "torch"
