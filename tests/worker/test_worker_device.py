"""Which device a worker takes: a CUDA device always by index (``torch.cuda.set_device``
refuses ``"cuda"`` without one), the rank's GPU among those visible, and a clear error when
CUDA is asked for on a machine without it.

The GPU counts are torch's own functions patched: this machine has no GPU.  The real path
runs in ``tests/engine/test_llm_cuda_parity.py`` on a GPU (``device="cuda"``).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.worker.worker import resolve_device, resolve_dtype
from kvserve.worker.worker_config import DTYPE_NAMES, WorkerConfig


def with_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("asked", ["cuda", None])
def test_cuda_without_an_index_is_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch, asked: str | None) -> None:
    with_gpus(monkeypatch, 2)
    devices = [resolve_device(WorkerConfig("m", rank=rank, tp_size=4, device=asked)) for rank in range(4)]
    assert devices == [torch.device("cuda", index) for index in (0, 1, 0, 1)]


def test_one_visible_gpu_per_actor_is_index_0_for_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    with_gpus(monkeypatch, 1)
    assert resolve_device(WorkerConfig("m", rank=3, tp_size=4, device="cuda")) == torch.device("cuda", 0)


def test_an_explicit_index_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    with_gpus(monkeypatch, 2)
    assert resolve_device(WorkerConfig("m", rank=0, tp_size=2, device="cuda:1")) == torch.device("cuda", 1)


def test_cpu_is_chosen_without_a_gpu_and_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with_gpus(monkeypatch, 0)
    assert resolve_device(WorkerConfig("m")) == torch.device("cpu")
    assert resolve_device(WorkerConfig("m", device="cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="'cuda' was asked for, but no CUDA device is visible"):
        resolve_device(WorkerConfig("m", device="cuda"))


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_dtype_a_worker_config_accepts_is_a_torch_dtype_of_that_name(name: str) -> None:
    # WorkerConfig checks the names without torch; the worker maps them to torch's dtypes.
    assert resolve_dtype(WorkerConfig("m", dtype=name), torch.device("cpu")) == getattr(torch, name)


def test_a_dtype_torch_has_but_workers_do_not_run_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"dtype must be 'auto' or one of \['bfloat16', 'float16', 'float32'\]"):
        WorkerConfig("m", dtype="float64")
