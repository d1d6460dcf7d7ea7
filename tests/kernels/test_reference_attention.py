"""The reference paged-attention kernels against a naive dense attention, and backend selection."""

from __future__ import annotations

import sys

import pytest
import torch

from kvserve.kernels import build_attention_metadata, get_attention_backend
from kvserve.kernels.backend import BACKEND_ENV_VAR, AttentionBackend, TorchReferenceBackend
from kvserve.kernels.reference import paged_attention, write_kv_cache
from tests.kernels.paged_batch import HEAD_DIM, MIXED_BATCH, NUM_KV_HEADS, PagedBatch, make_batch

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Causal attention per request and head on contiguous K/V, in float64."""
    outputs = []
    starts, seq_lens = batch.metadata.query_start_loc_cpu, batch.metadata.seq_lens_cpu
    for req_idx, seq_len in enumerate(seq_lens):
        query = batch.query[starts[req_idx] : starts[req_idx + 1]].double()
        keys, values = batch.keys[req_idx].double(), batch.values[req_idx].double()
        query_len, num_heads, _ = query.shape
        group = num_heads // NUM_KV_HEADS
        query_positions = torch.arange(seq_len - query_len, seq_len)
        future = torch.arange(seq_len)[None, :] > query_positions[:, None]
        output = torch.empty_like(query)
        for head in range(num_heads):
            scores = query[:, head] @ keys[:, head // group].T * batch.scale
            scores[future] = float("-inf")
            output[:, head] = torch.softmax(scores, dim=-1) @ values[:, head // group]
        outputs.append(output)
    return torch.cat(outputs)


def assert_matches_dense(batch: PagedBatch, output: torch.Tensor) -> None:
    assert output.shape == batch.query.shape
    assert output.dtype == batch.query.dtype
    tolerance = TOLERANCES[batch.query.dtype]
    torch.testing.assert_close(output.double(), dense_attention(batch), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_dense_attention(group: int, block_size: int, dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_BATCH, block_size=block_size, group=group, dtype=dtype, seed=group * block_size)
    output = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert_matches_dense(batch, output)


@pytest.mark.parametrize("group", [1, 4])
def test_decode_only_batch_matches_dense_attention(group: int) -> None:
    requests = [(cached, 1) for cached in (0, 15, 16, 40, 3, 99)]
    batch = make_batch(requests, block_size=16, group=group, seed=1)
    output = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert_matches_dense(batch, output)


@pytest.mark.parametrize("cached", [0, 9])
def test_single_prefill_matches_dense_attention(cached: int) -> None:
    batch = make_batch([(cached, 50)], block_size=16, group=4, seed=2)
    output = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert_matches_dense(batch, output)


def test_attention_after_writing_new_tokens_through_slot_mapping() -> None:
    batch = make_batch(MIXED_BATCH, block_size=4, group=4, seed=3, write_new_tokens=False)
    starts = batch.metadata.query_start_loc_cpu
    new_keys = torch.cat([k[len(k) - (starts[r + 1] - starts[r]) :] for r, k in enumerate(batch.keys)])
    new_values = torch.cat([v[len(v) - (starts[r + 1] - starts[r]) :] for r, v in enumerate(batch.values)])
    write_kv_cache(new_keys, new_values, batch.key_cache, batch.value_cache, batch.metadata.slot_mapping)
    output = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert_matches_dense(batch, output)


def test_write_kv_cache_writes_exactly_the_mapped_slots() -> None:
    generator = torch.Generator().manual_seed(4)
    shape = (6, 4, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    key_before, value_before = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([21, 3, 8, 9, 14], dtype=torch.int64)
    key = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=generator)

    write_kv_cache(key, value, key_cache, value_cache, slots)

    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    for cache, before, written in ((key_cache, key_before, key), (value_cache, value_before, value)):
        flat, flat_before = cache.view(24, NUM_KV_HEADS, HEAD_DIM), before.view(24, NUM_KV_HEADS, HEAD_DIM)
        assert torch.equal(flat[slots], written)
        assert torch.equal(cache[5, 1], written[0])  # slot 21 = block 5, offset 1
        assert torch.equal(flat[untouched], flat_before[untouched])


def test_build_attention_metadata_maps_new_tokens_to_slots() -> None:
    metadata = build_attention_metadata([3, 1], [6, 9], [[5, 2], [7, 1, 3]], block_size=4, device="cpu")
    # r0: positions 3, 4, 5 -> block 5 offset 3, block 2 offsets 0 and 1; r1: position 8 -> block 3.
    assert metadata.slot_mapping.tolist() == [23, 8, 9, 12]
    assert metadata.slot_mapping.dtype == torch.int64
    assert metadata.query_start_loc.tolist() == [0, 3, 4]
    assert metadata.seq_lens.tolist() == [6, 9]
    assert metadata.block_tables.tolist() == [[5, 2, 0], [7, 1, 3]]
    assert {metadata.query_start_loc.dtype, metadata.seq_lens.dtype, metadata.block_tables.dtype} == {torch.int32}
    assert (metadata.query_start_loc_cpu, metadata.seq_lens_cpu) == ((0, 3, 4), (6, 9))
    assert (metadata.max_query_len, metadata.max_seq_len) == (3, 9)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "block_tables", "message"),
    [
        ([1, 1], [4], [[1], [2]], "one entry per request"),
        ([1], [4], [[1], [2]], "one entry per request"),
        ([5], [4], [[1, 2]], "exceeds seq_lens"),
        ([0], [4], [[1]], "at least 1"),
        ([1], [9], [[1, 2]], "needs 3 blocks"),
        ([1], [4], [[-1]], "non-negative"),
    ],
)
def test_build_attention_metadata_rejects_inconsistent_input(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(query_lens, seq_lens, block_tables, block_size=4, device="cpu")


def test_build_attention_metadata_rejects_non_positive_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        build_attention_metadata([1], [1], [[1]], block_size=0, device="cpu")


@pytest.fixture
def no_cuda_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the CUDA kernels fail to import, whether or not they exist."""
    monkeypatch.setitem(sys.modules, "kvserve.kernels.cuda_backend", None)
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)


@pytest.mark.usefixtures("no_cuda_kernels")
def test_automatic_selection_is_torch_on_a_cuda_device_without_cuda_kernels() -> None:
    assert get_attention_backend(torch.device("cuda")).name == "torch"


@pytest.mark.usefixtures("no_cuda_kernels")
def test_explicit_name_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV_VAR, "cuda")
    assert get_attention_backend("cpu", name="torch").name == "torch"
    with pytest.raises(RuntimeError, match="cuda"):
        get_attention_backend("cpu")
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert get_attention_backend("cpu").name == "torch"


@pytest.mark.usefixtures("no_cuda_kernels")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_cuda_without_kernels_raises_runtime_error(device: str) -> None:
    with pytest.raises(RuntimeError, match="'cuda'"):
        get_attention_backend(device, name="cuda")


@pytest.mark.usefixtures("no_cuda_kernels")
def test_unknown_backend_name_lists_the_valid_names(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="valid names: torch, cpu, cuda"):
        get_attention_backend("cpu", name="triton")
    monkeypatch.setenv(BACKEND_ENV_VAR, "flash")
    with pytest.raises(ValueError, match=BACKEND_ENV_VAR):
        get_attention_backend("cpu")


def test_torch_backend_delegates_to_the_reference_kernels() -> None:
    backend = TorchReferenceBackend()
    assert isinstance(backend, AttentionBackend)
    batch = make_batch(MIXED_BATCH, block_size=16, group=4, seed=5)
    output = backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    expected = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert torch.equal(output, expected)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf"), True, "0.125"])
def test_paged_attention_rejects_a_scale_that_is_not_positive_and_finite(scale: object) -> None:
    batch = make_batch(MIXED_BATCH, block_size=16, group=2)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale)
