"""The attention backend seam: one interface, a torch reference, C++ CPU and CUDA kernels.

Selection, first match wins:

1. the ``name`` argument of :func:`get_attention_backend`;
2. the ``KVSERVE_ATTENTION_BACKEND`` environment variable;
3. automatic: ``"cuda"`` on a CUDA device when the CUDA kernels build (else a
   warning), ``"cpu"`` on a CPU device when its C++ extension builds (else a
   warning), else ``"torch"``.

``"torch"`` forces the pure-torch reference on any device.

The CUDA kernels plug in as module ``kvserve.kernels.cuda_backend`` exposing a
class ``CudaAttentionBackend`` (constructed without arguments) that satisfies
:class:`AttentionBackend`; its constructor raises
:class:`~kvserve.kernels.cuda_build.CudaExtensionBuildError` when the kernels
cannot be built here.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from kvserve.kernels import reference
from kvserve.kernels.attention_backend import AttentionBackend
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.cpu_backend import CpuAttentionBackend
from kvserve.kernels.cpu_build import CpuExtensionBuildError
from kvserve.kernels.cuda_build import CudaExtensionBuildError

logger = logging.getLogger(__name__)

BACKEND_ENV_VAR = "KVSERVE_ATTENTION_BACKEND"
BACKEND_NAMES = ("torch", "cpu", "cuda")
_CUDA_MODULE = "kvserve.kernels.cuda_backend"
_CUDA_CLASS = "CudaAttentionBackend"


class TorchReferenceBackend(AttentionBackend):
    """The pure-torch reference kernels; runs on any device."""

    __slots__ = ()
    name = "torch"

    def _write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return reference.attend_checked(query, key_cache, value_cache, metadata, scale)

    def __repr__(self) -> str:
        return "TorchReferenceBackend()"


def get_attention_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """The attention backend for tensors on ``device``.

    Raises ``ValueError`` for a name not in :data:`BACKEND_NAMES`, and
    ``RuntimeError`` when ``"cpu"`` or ``"cuda"`` is asked for explicitly
    (argument or environment) but the device is not of that type or the kernels
    do not build or import.  The first ``"cpu"`` backend on a machine takes
    10-30 s, and the first ``"cuda"`` one 15-60 s: they compile their kernels,
    which later processes reuse.
    """
    device = torch.device(device)
    requested = name if name is not None else os.environ.get(BACKEND_ENV_VAR) or None
    if requested is None:
        backend = _automatic_backend(device)
    elif requested == "torch":
        backend = TorchReferenceBackend()
    elif requested == "cpu":
        backend = _cpu_backend(device)
    elif requested == "cuda":
        backend = _cuda_backend(device)
    else:
        source = "name" if name is not None else BACKEND_ENV_VAR
        raise ValueError(
            f"unknown attention backend {requested!r} (from {source}); valid names: {', '.join(BACKEND_NAMES)}"
        )
    logger.debug("attention backend %r for device %s (requested: %r)", backend.name, device, requested)
    return backend


def _automatic_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        try:
            return _load_cuda_backend()
        except ImportError as exc:
            logger.info("CUDA attention kernels unavailable (%s); using the torch reference", exc)
        except CudaExtensionBuildError as exc:
            logger.warning("CUDA attention kernels unavailable; using the slower torch reference: %s", exc)
    elif device.type == "cpu":
        try:
            return CpuAttentionBackend()
        except CpuExtensionBuildError as exc:
            logger.warning("C++ CPU attention kernels unavailable; using the slower torch reference: %s", exc)
    return TorchReferenceBackend()


def _cpu_backend(device: torch.device) -> AttentionBackend:
    if device.type != "cpu":
        raise RuntimeError(f"attention backend 'cpu' needs a CPU device, got {device}")
    try:
        return CpuAttentionBackend()
    except CpuExtensionBuildError as exc:
        raise RuntimeError(
            f"attention backend 'cpu' is unavailable: {exc}; use 'torch' or unset {BACKEND_ENV_VAR}"
        ) from exc


def _cuda_backend(device: torch.device) -> AttentionBackend:
    if device.type != "cuda":
        raise RuntimeError(f"attention backend 'cuda' needs a CUDA device, got {device}")
    try:
        return _load_cuda_backend()
    except ImportError as exc:
        raise RuntimeError(
            f"attention backend 'cuda' is unavailable: cannot import {_CUDA_MODULE} ({exc}); "
            f"use 'torch' or unset {BACKEND_ENV_VAR}"
        ) from exc
    except CudaExtensionBuildError as exc:
        raise RuntimeError(
            f"attention backend 'cuda' is unavailable: {exc}; use 'torch' or unset {BACKEND_ENV_VAR}"
        ) from exc


def _load_cuda_backend() -> AttentionBackend:
    module = importlib.import_module(_CUDA_MODULE)
    try:
        backend_class = getattr(module, _CUDA_CLASS)
    except AttributeError as exc:
        raise ImportError(f"{_CUDA_MODULE} defines no {_CUDA_CLASS}") from exc
    return backend_class()
