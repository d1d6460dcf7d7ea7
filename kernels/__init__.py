"""kvserve.kernels: paged KV-cache writes and paged attention.

A pure-torch reference for every kernel (``reference``), C++ kernels for CPUs
(``cpu_backend``: cache writes, decode, and with AVX2 prefill chunks and
shared-prefix cascades) and, on GPUs, CUDA kernels behind the same
:class:`AttentionBackend` interface; pick one with :func:`get_attention_backend`.
"""

from __future__ import annotations

from kvserve.kernels.attention_metadata import AttentionMetadata, build_attention_metadata
from kvserve.kernels.backend import AttentionBackend, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "build_attention_metadata", "get_attention_backend"]
