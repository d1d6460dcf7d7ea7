"""The C++ CPU decode kernel against the torch reference, its build, and backend selection on CPU.

The extension is built once for the whole file (a cold build compiles for
10-30 s; later runs reuse the build directory).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from kvserve.kernels import build_attention_metadata, cpu_build, get_attention_backend
from kvserve.kernels.backend import BACKEND_ENV_VAR, AttentionBackend
from kvserve.kernels.cpu_backend import CpuAttentionBackend
from kvserve.kernels.cpu_build import CpuExtensionBuildError, build_directory, check_toolchain, load_cpu_extension
from kvserve.kernels.reference import paged_attention
from tests.kernels.paged_batch import HEAD_DIM, MIXED_BATCH, NUM_KV_HEADS, PagedBatch, make_batch

# NOTE: both sides compute in float32 but sum in different orders; bfloat16 and
# float16 outputs may then round one unit in the last place apart.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# Decodes only: contexts of one token, ending just before, on and after a block
# boundary, and long enough to span many blocks.
DECODE_CONTEXTS = [1, 15, 16, 17, 40, 99, 700]


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    try:
        check_toolchain()
    except CpuExtensionBuildError as exc:
        pytest.skip(f"cannot build the C++ CPU kernels here: {exc}")
    return CpuAttentionBackend()


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
    backend: CpuAttentionBackend, group: int, block_size: int, dtype: torch.dtype
) -> None:
    batch = make_batch(MIXED_BATCH, block_size=block_size, group=group, dtype=dtype, seed=10 + group * block_size)
    assert_matches_reference(backend, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_only_batch_matches_reference(
    backend: CpuAttentionBackend, group: int, block_size: int, dtype: torch.dtype
) -> None:
    requests = [(context - 1, 1) for context in DECODE_CONTEXTS]
    batch = make_batch(requests, block_size=block_size, group=group, dtype=dtype, seed=20 + group * block_size)
    assert_matches_reference(backend, batch)


def test_float16_decodes_match_reference(backend: CpuAttentionBackend) -> None:
    batch = make_batch([(c - 1, 1) for c in DECODE_CONTEXTS], block_size=16, group=4, dtype=torch.float16, seed=3)
    assert_matches_reference(backend, batch)


def test_float64_decodes_fall_back_to_the_reference(backend: CpuAttentionBackend) -> None:
    batch = make_batch(MIXED_BATCH, block_size=4, group=4, dtype=torch.float64, seed=4)
    output, expected = run_both(backend, batch)
    assert torch.equal(output, expected)


def test_prefill_rows_are_the_reference_bit_for_bit(backend: CpuAttentionBackend) -> None:
    batch = make_batch(MIXED_BATCH, block_size=16, group=4, seed=5)
    output, expected = run_both(backend, batch)
    starts = batch.metadata.query_start_loc_cpu
    prefill_rows = [slice(start, end) for start, end in zip(starts, starts[1:]) if end - start > 1]
    assert prefill_rows
    for rows in prefill_rows:
        assert torch.equal(output[rows], expected[rows])


def test_result_does_not_depend_on_the_number_of_threads(backend: CpuAttentionBackend) -> None:
    batch = make_batch([(c - 1, 1) for c in DECODE_CONTEXTS] * 3, block_size=16, group=4, seed=6)
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
    load_cpu_extension().paged_decode_attention(*inputs.values(), 0.25)
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
        ({"out": torch.empty(3, 4, HEAD_DIM)}, "query's shape"),
    ],
)
def test_kernel_rejects_invalid_inputs(
    backend: CpuAttentionBackend, overrides: dict[str, torch.Tensor], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        load_cpu_extension().paged_decode_attention(*kernel_inputs(**overrides).values(), 0.25)


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
