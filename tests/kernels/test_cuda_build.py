"""Building and selecting the CUDA kernels, as far as a machine without a GPU can tell."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvserve.kernels import cuda_backend, cuda_build, get_attention_backend
from kvserve.kernels.backend import BACKEND_ENV_VAR
from kvserve.kernels.cuda_build import CudaExtensionBuildError


def test_arch_list_from_the_environment_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_build.ARCH_LIST_ENV, "8.0;9.0+PTX")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cuda_build.cuda_arch_flags() == ([], "arch_8_0_9_0_ptx")


def test_an_arch_list_without_code_for_the_gpu_is_a_build_error_not_a_failed_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(cuda_build.ARCH_LIST_ENV, "8.0;8.6")
    with pytest.raises(CudaExtensionBuildError, match=r"TORCH_CUDA_ARCH_LIST='8.0;8.6' has no code this GPU runs .*9\.0"):
        cuda_build.cuda_arch_flags()


@pytest.mark.parametrize(
    "arch_list, capability, runs",
    [
        ("9.0", (9, 0), True),
        ("8.0", (8, 6), True),  # binary code runs on later minor versions of its major
        ("8.6", (8, 0), False),
        ("8.0", (9, 0), False),
        ("8.0+PTX", (9, 0), True),  # PTX is compiled by the driver for any later GPU
        ("9.0+PTX", (8, 0), False),
        ("9.0a", (9, 0), True),
        ("9.0a", (9, 1), False),  # architecture-specific code runs on that GPU only
        ("7.5 8.0;9.0", (9, 0), True),
        ("sm_90", (9, 0), True),
        ("Hopper", (9, 0), True),  # a name: torch's to judge
    ],
)
def test_which_arch_lists_run_on_which_gpus(arch_list: str, capability: tuple[int, int], runs: bool) -> None:
    assert cuda_build.arch_list_runs_on(arch_list, *capability) is runs


def test_without_an_arch_list_the_build_targets_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda_build.ARCH_LIST_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cuda_build.cuda_arch_flags() == (["-gencode=arch=compute_90,code=sm_90"], "sm90")


def test_build_directory_is_per_architecture_under_the_kvserve_cache_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    sm90, sm80 = cuda_build.build_directory("sm90"), cuda_build.build_directory("sm80")
    assert sm90.parent.parent == tmp_path / "torch_extensions"
    assert sm90.name == "kvserve_paged_attention_cuda_sm90" and sm90 != sm80


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_cpu_torch_is_a_clear_build_error() -> None:
    with pytest.raises(CudaExtensionBuildError, match="built without CUDA"):
        cuda_build.load_cuda_extension()


@pytest.fixture
def failing_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise CudaExtensionBuildError("nvcc not found (test)")

    monkeypatch.setattr(cuda_backend, "load_cuda_extension", fail)
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)


@pytest.mark.usefixtures("failing_cuda_build")
def test_automatic_selection_on_cuda_falls_back_to_torch_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.backend"):
        assert get_attention_backend("cuda").name == "torch"
    assert "nvcc not found (test)" in caplog.text


@pytest.mark.usefixtures("failing_cuda_build")
def test_explicit_cuda_without_a_build_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="'cuda' is unavailable: nvcc not found"):
        get_attention_backend("cuda", name="cuda")


def test_explicit_cuda_on_a_cpu_device_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="'cuda' needs a CUDA device"):
        get_attention_backend("cpu", name="cuda")


def test_invalid_split_size_is_rejected_before_building() -> None:
    with pytest.raises(ValueError, match="split_tokens"):
        cuda_backend.CudaAttentionBackend(split_tokens=100)
