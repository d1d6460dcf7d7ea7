"""The C++ CPU kernels against the torch reference, their build, and backend selection on CPU.

Equivalence tests run once per code path this CPU has (AVX-512, AVX2, portable),
lowering the kernels' instruction set through ``set_cpu_capability``.

The extension is built once for the whole file (a cold build compiles for
10-30 s; later runs reuse the build directory).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvserve.kernels import build_attention_metadata, cpu_build, get_attention_backend, reference
from kvserve.kernels.backend import BACKEND_ENV_VAR, AttentionBackend
from kvserve.kernels.cpu_backend import CpuAttentionBackend
from kvserve.kernels.cpu_build import CpuExtensionBuildError, build_directory, check_toolchain, load_cpu_extension
from kvserve.kernels.reference import paged_attention, write_kv_cache
from tests.kernels.paged_batch import HEAD_DIM, MIXED_BATCH, NUM_KV_HEADS, PagedBatch, make_batch

# NOTE: both sides compute in float32 but sum in different orders; bfloat16 and
# float16 outputs may then round one unit in the last place apart.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# Decodes only: contexts of one token, ending just before, on and after a block
# boundary, and long enough to span many blocks.
DECODE_CONTEXTS = [1, 15, 16, 17, 40, 99, 700]
# Prefill chunks of every length around the 8 positions of a tile and the 16 rows
# of a row tile, over no context and over contexts ending mid-block.
PREFILL_CHUNKS = [(0, n) for n in (2, 7, 8, 9, 16, 17, 33)] + [(c, n) for c, n in ((3, 5), (21, 8), (40, 19))]
CAPABILITIES = ("avx512", "avx2", "portable")


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    try:
        check_toolchain()
    except CpuExtensionBuildError as exc:
        pytest.skip(f"cannot build the C++ CPU kernels here: {exc}")
    return CpuAttentionBackend()


@pytest.fixture(params=CAPABILITIES)
def capability(request: pytest.FixtureRequest, backend: CpuAttentionBackend) -> Iterator[str]:
    """Each code path this CPU can run: the kernels used at most ``request.param``."""
    extension = load_cpu_extension()
    detected = extension.cpu_capability()
    if CAPABILITIES.index(request.param) < CAPABILITIES.index(detected):
        pytest.skip(f"this CPU has no {request.param}")
    extension.set_cpu_capability(request.param)
    try:
        yield request.param
    finally:
        extension.set_cpu_capability(detected)


def run_both(backend: CpuAttentionBackend, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    return backend.paged_attention(*args), paged_attention(*args)


def assert_matches_reference(backend: CpuAttentionBackend, batch: PagedBatch) -> None:
    output, expected = run_both(backend, batch)
    assert output.shape == expected.shape and output.dtype == expected.dtype
    assert not output.isnan().any()
    tolerance = TOLERANCES[batch.query.dtype]
    torch.testing.assert_close(output, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_reference(
    backend: CpuAttentionBackend, capability: str, group: int, block_size: int, dtype: torch.dtype
) -> None:
    batch = make_batch(MIXED_BATCH, block_size=block_size, group=group, dtype=dtype, seed=10 + group * block_size)
    assert_matches_reference(backend, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_only_batch_matches_reference(
    backend: CpuAttentionBackend, capability: str, group: int, block_size: int, dtype: torch.dtype
) -> None:
    requests = [(context - 1, 1) for context in DECODE_CONTEXTS]
    batch = make_batch(requests, block_size=block_size, group=group, dtype=dtype, seed=20 + group * block_size)
    assert_matches_reference(backend, batch)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_head_dims_and_groups_match_reference(
    backend: CpuAttentionBackend, capability: str, group: int, head_dim: int
) -> None:
    requests = MIXED_BATCH + [(context - 1, 1) for context in DECODE_CONTEXTS]
    batch = make_batch(requests, block_size=16, group=group, head_dim=head_dim, seed=30 + group + head_dim)
    assert_matches_reference(backend, batch)


@pytest.mark.parametrize("head_dim", [12, 8])
def test_head_dims_off_the_vector_width_match_reference(
    backend: CpuAttentionBackend, capability: str, head_dim: int
) -> None:
    requests = MIXED_BATCH + [(context - 1, 1) for context in DECODE_CONTEXTS]
    batch = make_batch(requests, block_size=16, group=2, head_dim=head_dim, seed=head_dim)
    assert_matches_reference(backend, batch)


@pytest.mark.parametrize("block_size", [1, 5, 8, 32])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_chunks_across_tiles_and_odd_blocks_match_reference(
    backend: CpuAttentionBackend, capability: str, group: int, block_size: int
) -> None:
    requests = PREFILL_CHUNKS + [(context - 1, 1) for context in DECODE_CONTEXTS]
    batch = make_batch(requests, block_size=block_size, group=group, seed=40 + group * block_size)
    assert_matches_reference(backend, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_decodes_over_shared_prefixes_match_reference(
    backend: CpuAttentionBackend, capability: str, group: int, block_size: int, dtype: torch.dtype
) -> None:
    # Groups of 5 share up to 96 positions: cascades of 2 to 5 requests, prefixes cut
    # short by a member's own short context, and a group of one.
    contexts = [97, 98, 130, 99, 300, 40, 41, 33, 34, 35, 120, 121, 122, 123, 124, 200]
    requests = [(context - 1, 1) for context in contexts] + PREFILL_CHUNKS[:3]
    batch = make_batch(
        requests, block_size=block_size, group=group, dtype=dtype, seed=50 + group + block_size,
        shared_prefix=(96 // block_size, 5),
    )
    assert_matches_reference(backend, batch)


def test_float16_decodes_match_reference(backend: CpuAttentionBackend, capability: str) -> None:
    batch = make_batch([(c - 1, 1) for c in DECODE_CONTEXTS], block_size=16, group=4, dtype=torch.float16, seed=3)
    assert_matches_reference(backend, batch)


def test_float64_decodes_fall_back_to_the_reference(backend: CpuAttentionBackend) -> None:
    batch = make_batch(MIXED_BATCH, block_size=4, group=4, dtype=torch.float64, seed=4)
    output, expected = run_both(backend, batch)
    assert torch.equal(output, expected)


def test_a_query_of_another_dtype_than_the_cache_falls_back_to_the_reference(backend: CpuAttentionBackend) -> None:
    # The kernel refused it ("out, query and the caches must share one dtype"); write_kv_cache fell back already.
    batch = make_batch(MIXED_BATCH, block_size=4, group=4, dtype=torch.bfloat16, seed=5)
    query = batch.query.float()
    args = (batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert torch.equal(backend.paged_attention(query, *args), paged_attention(query, *args))


def test_one_head_of_any_stride_is_taken_as_dense(backend: CpuAttentionBackend, capability: str) -> None:
    # [tokens, 1, head_dim] transposed into place: contiguous to torch (a size-1
    # dim's stride does not count), refused by the kernel as "not dense".
    batch = make_batch([(0, 5), (7, 1)], block_size=4, group=1, num_kv_heads=1, seed=6)
    num_tokens, _, head_dim = batch.query.shape
    transposed = torch.empty(num_tokens, head_dim, 1).transpose(1, 2)
    transposed.copy_(batch.query)
    assert transposed.is_contiguous() and transposed.stride(1) == 1
    args = (batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(backend.paged_attention(transposed, *args), paged_attention(batch.query, *args),
                               atol=1e-5, rtol=0)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    backend.write_kv_cache(transposed, transposed, key_cache, value_cache, batch.metadata.slot_mapping)
    write_kv_cache(batch.query, batch.query, batch.key_cache, batch.value_cache, batch.metadata.slot_mapping)
    # The caches are NaN-filled outside the batch's blocks.
    torch.testing.assert_close(key_cache, batch.key_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, batch.value_cache, atol=0, rtol=0, equal_nan=True)


def test_views_of_a_fused_projection_give_the_contiguous_result(backend: CpuAttentionBackend, capability: str) -> None:
    batch = make_batch(MIXED_BATCH + [(99, 1)], block_size=16, group=2, seed=8)
    num_tokens, num_heads, head_dim = batch.query.shape
    fused = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim)
    query_view = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    query_view.copy_(batch.query)
    args = (batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    assert torch.equal(backend.paged_attention(query_view, *args), backend.paged_attention(batch.query, *args))


def test_prefill_rows_take_the_reference_without_avx2(backend: CpuAttentionBackend, capability: str) -> None:
    batch = make_batch(MIXED_BATCH, block_size=16, group=4, seed=5)
    output, expected = run_both(backend, batch)
    starts = batch.metadata.query_start_loc_cpu
    prefill_rows = [slice(start, end) for start, end in zip(starts, starts[1:]) if end - start > 1]
    assert prefill_rows
    for rows in prefill_rows:
        if capability != "portable":
            torch.testing.assert_close(output[rows], expected[rows], atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(output[rows], expected[rows])


def test_backend_leaves_to_the_reference_only_the_prefill_rows_without_avx2(
    backend: CpuAttentionBackend, capability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_batch(MIXED_BATCH, block_size=16, group=2, seed=12)
    _, expected = run_both(backend, batch)
    prefill_calls: list[list[int]] = []
    prefill_attention = reference.prefill_attention

    def recording_prefill(*args: object) -> None:
        prefill_calls.append(list(args[5]))
        prefill_attention(*args)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the kernel computes these rows")

    monkeypatch.setattr(reference, "prefill_attention", recording_prefill)
    monkeypatch.setattr(reference, "decode_attention", forbidden)
    monkeypatch.setattr(reference, "paged_attention", forbidden)
    output = backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    starts = batch.metadata.query_start_loc_cpu
    prefill_reqs = [r for r in range(len(MIXED_BATCH)) if starts[r + 1] - starts[r] > 1]
    assert prefill_calls == ([] if capability != "portable" else [prefill_reqs])


def test_kernel_reports_whether_it_computed_the_prefill_rows(backend: CpuAttentionBackend, capability: str) -> None:
    batch = make_batch(MIXED_BATCH, block_size=16, group=2, seed=9)
    metadata = batch.metadata
    out = torch.empty_like(batch.query)
    computed = load_cpu_extension().paged_attention(
        out, batch.query, batch.key_cache, batch.value_cache, metadata.block_tables, metadata.seq_lens,
        batch.scale, query_start_loc=metadata.query_start_loc,
    )
    assert computed == (capability != "portable")


def test_result_does_not_depend_on_the_number_of_threads(backend: CpuAttentionBackend) -> None:
    requests = [(c - 1, 1) for c in DECODE_CONTEXTS] * 3 + PREFILL_CHUNKS
    batch = make_batch(requests, block_size=16, group=4, seed=6, shared_prefix=(4, 3))
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    num_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = backend.paged_attention(*args)
        torch.set_num_threads(2)
        parallel = backend.paged_attention(*args)
    finally:
        torch.set_num_threads(num_threads)
    assert torch.equal(single, parallel)


def kernel_inputs(**overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    """Valid inputs for two decode rows over a cache of 4 blocks of 4, with some replaced."""
    generator = torch.Generator().manual_seed(7)
    cache_shape = (4, 4, NUM_KV_HEADS, HEAD_DIM)
    inputs = {
        "out": torch.empty(2, NUM_KV_HEADS * 2, HEAD_DIM),
        "query": torch.randn(2, NUM_KV_HEADS * 2, HEAD_DIM, generator=generator),
        "key_cache": torch.randn(cache_shape, generator=generator),
        "value_cache": torch.randn(cache_shape, generator=generator),
        "block_tables": torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        "seq_lens": torch.tensor([6, 3], dtype=torch.int32),
    }
    return inputs | overrides


def test_kernel_writes_the_reference_result_into_out(backend: CpuAttentionBackend) -> None:
    inputs = kernel_inputs()
    load_cpu_extension().paged_attention(*inputs.values(), 0.25)
    metadata = build_attention_metadata([1, 1], [6, 3], [[1, 2], [3]], block_size=4, device="cpu")
    expected = paged_attention(inputs["query"], inputs["key_cache"], inputs["value_cache"], metadata, 0.25)
    torch.testing.assert_close(inputs["out"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block_tables": torch.tensor([[1, 4], [3, 0]], dtype=torch.int32)}, "not a block of the cache"),
        ({"block_tables": torch.tensor([[1, -1], [3, 0]], dtype=torch.int32)}, "not a block of the cache"),
        ({"seq_lens": torch.tensor([9, 3], dtype=torch.int32)}, "seq_lens\\[0\\] = 9"),
        ({"seq_lens": torch.tensor([6, 0], dtype=torch.int32)}, "seq_lens\\[1\\] = 0"),
        ({"seq_lens": torch.tensor([6, 3], dtype=torch.int64)}, "int32"),
        ({"query": torch.randn(2, 3, HEAD_DIM), "out": torch.empty(2, 3, HEAD_DIM)}, "multiple of num_kv_heads"),
        ({"key_cache": torch.randn(4, 4, 0, HEAD_DIM), "value_cache": torch.randn(4, 4, 0, HEAD_DIM)}, "num_kv_heads"),
        ({"key_cache": torch.randn(4, 0, 2, HEAD_DIM), "value_cache": torch.randn(4, 0, 2, HEAD_DIM)}, "block_size"),
        ({"query": torch.randn(2, 4, HEAD_DIM, dtype=torch.float64)}, "float32, bfloat16 or float16"),
        ({"key_cache": torch.randn(4, NUM_KV_HEADS, 4, HEAD_DIM).transpose(1, 2)}, "contiguous"),
        ({"query": torch.randn(2, HEAD_DIM, 4).transpose(1, 2)}, "contiguous heads and dims"),
        # Shapes and numbers are formatted without C++ streams (kernels/csrc/check_message.h).
        ({"out": torch.empty(3, 4, HEAD_DIM)}, rf"^out \[3, 4, {HEAD_DIM}\] must have query's shape \[2, 4, {HEAD_DIM}\]$"),
        ({"query": torch.randn(3, 4, HEAD_DIM), "out": torch.empty(3, 4, HEAD_DIM)}, "one row per request"),
    ],
)
def test_kernel_rejects_invalid_inputs(
    backend: CpuAttentionBackend, overrides: dict[str, torch.Tensor], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        load_cpu_extension().paged_attention(*kernel_inputs(**overrides).values(), 0.25)


@pytest.mark.parametrize(
    ("query_start_loc", "message"),
    [
        ([0, 1, 3], "run from 0 to 2"),
        ([0, 2, 2], "increasing"),
        ([0, 2], "3 entries"),
        ([0, 0, 2], "increasing"),
    ],
)
def test_kernel_rejects_invalid_query_start_loc(
    backend: CpuAttentionBackend, query_start_loc: list[int], message: str
) -> None:
    inputs = kernel_inputs()
    with pytest.raises(RuntimeError, match=message):
        load_cpu_extension().paged_attention(
            *inputs.values(), 0.25, query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32)
        )


def test_kernel_rejects_a_chunk_longer_than_its_context(backend: CpuAttentionBackend) -> None:
    # Request 0 has 2 new tokens but a context of 1: its causal rows would see nothing.
    inputs = kernel_inputs(
        query=torch.randn(3, NUM_KV_HEADS * 2, HEAD_DIM),
        out=torch.empty(3, NUM_KV_HEADS * 2, HEAD_DIM),
        seq_lens=torch.tensor([1, 3], dtype=torch.int32),
    )
    with pytest.raises(RuntimeError, match="2 new tokens but seq_lens"):
        load_cpu_extension().paged_attention(
            *inputs.values(), 0.25, query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32)
        )


@pytest.mark.parametrize("scale", [0.0, -0.25, float("nan")])
def test_backend_rejects_a_scale_that_is_not_positive_and_finite(backend: CpuAttentionBackend, scale: float) -> None:
    batch = make_batch(MIXED_BATCH, block_size=16, group=2)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale)


def test_capability_is_one_of_the_known_instruction_sets(backend: CpuAttentionBackend) -> None:
    assert load_cpu_extension().cpu_capability() in CAPABILITIES


def test_unknown_capability_is_rejected(backend: CpuAttentionBackend) -> None:
    with pytest.raises(RuntimeError, match="unknown CPU capability 'sse9'"):
        load_cpu_extension().set_cpu_capability("sse9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_matches_the_reference(
    backend: CpuAttentionBackend, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    generator = torch.Generator().manual_seed(11)
    shape = (6, 4, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    # Key and value as views of a fused projection, as the model passes them.
    fused = torch.randn(5, 3 * NUM_KV_HEADS * HEAD_DIM, generator=generator).to(dtype)
    key = fused[:, : NUM_KV_HEADS * HEAD_DIM].view(5, NUM_KV_HEADS, HEAD_DIM)
    value = fused[:, 2 * NUM_KV_HEADS * HEAD_DIM :].view(5, NUM_KV_HEADS, HEAD_DIM)
    slot_mapping = torch.tensor([23, 4, 5, 0, 17])
    write_kv_cache(key, value, *expected, slot_mapping)

    def forbidden(*args: object) -> None:
        raise AssertionError("the kernel writes the cache")

    monkeypatch.setattr(reference, "write_kv_cache", forbidden)
    backend.write_kv_cache(key, value, *caches, slot_mapping)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("slot", [24, -1])
def test_cache_write_rejects_a_slot_outside_the_cache(backend: CpuAttentionBackend, slot: int) -> None:
    caches = [torch.zeros(6, 4, NUM_KV_HEADS, HEAD_DIM) for _ in range(2)]
    rows = torch.ones(2, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="is not a slot of the cache"):
        backend.write_kv_cache(rows, rows, *caches, torch.tensor([3, slot]))
    assert not caches[0].any(), "nothing is written when a slot is invalid"


def test_second_load_returns_the_loaded_module(backend: CpuAttentionBackend) -> None:
    assert load_cpu_extension() is load_cpu_extension()


def test_build_directory_is_under_the_kvserve_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cpu_build.CACHE_DIR_ENV, str(tmp_path))
    directory = build_directory()
    assert directory.parent.parent == tmp_path / "torch_extensions"
    assert directory.name == cpu_build.EXTENSION_NAME


def test_missing_compiler_is_a_clear_build_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_build, "_outcome", None)
    monkeypatch.setenv("CXX", "kvserve-no-such-compiler")
    with pytest.raises(CpuExtensionBuildError, match="no C\\+\\+ compiler: 'kvserve-no-such-compiler'"):
        load_cpu_extension()


@pytest.fixture
def no_cuda_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvserve.kernels.cuda_backend", None)
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)


@pytest.fixture
def failing_cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the CPU kernels fail to build, whether or not this machine can build them."""
    monkeypatch.setattr(cpu_build, "_outcome", CpuExtensionBuildError("no C++ compiler (test)"))


@pytest.mark.usefixtures("no_cuda_kernels")
def test_automatic_selection_on_cpu_is_the_cpu_backend(backend: CpuAttentionBackend) -> None:
    selected = get_attention_backend("cpu")
    assert isinstance(selected, CpuAttentionBackend) and isinstance(selected, AttentionBackend)
    assert selected.name == "cpu"


@pytest.mark.usefixtures("no_cuda_kernels", "failing_cpu_build")
def test_automatic_selection_falls_back_to_torch_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.backend"):
        assert get_attention_backend("cpu").name == "torch"
    assert "no C++ compiler (test)" in caplog.text


@pytest.mark.usefixtures("no_cuda_kernels")
def test_torch_forces_the_reference_on_cpu(monkeypatch: pytest.MonkeyPatch, backend: CpuAttentionBackend) -> None:
    assert get_attention_backend("cpu", name="torch").name == "torch"
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert get_attention_backend("cpu").name == "torch"
    monkeypatch.setenv(BACKEND_ENV_VAR, "cpu")
    assert get_attention_backend("cpu").name == "cpu"


@pytest.mark.usefixtures("no_cuda_kernels", "failing_cpu_build")
def test_explicit_cpu_without_a_build_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="'cpu' is unavailable: no C\\+\\+ compiler"):
        get_attention_backend("cpu", name="cpu")


@pytest.mark.usefixtures("no_cuda_kernels")
def test_explicit_cpu_on_a_cuda_device_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="'cpu' needs a CPU device"):
        get_attention_backend("cuda", name="cpu")
