"""The attention backend interface is declared once: every backend implements only its
kernel paths and says which inputs it cannot take, which then go to the reference."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import reference
from kvserve.kernels.attention_backend import AttentionBackend
from kvserve.kernels.attention_metadata import build_attention_metadata
from kvserve.kernels.backend import TorchReferenceBackend
from kvserve.kernels.cpu_backend import CpuAttentionBackend
from kvserve.kernels.cuda_backend import CudaAttentionBackend


@pytest.mark.parametrize("backend_class", [TorchReferenceBackend, CpuAttentionBackend, CudaAttentionBackend])
def test_every_backend_keeps_the_one_interface(backend_class) -> None:
    assert issubclass(backend_class, AttentionBackend)
    # The public calls (and their fall-back to the reference) are the base class's alone.
    for method in ("write_kv_cache", "paged_attention"):
        assert getattr(backend_class, method) is getattr(AttentionBackend, method)


def test_an_input_a_backend_cannot_take_goes_to_the_reference() -> None:
    calls = []

    class Float16Only(AttentionBackend):
        name = "test"

        def cannot_write(self, key, value, key_cache, value_cache):
            return None if key_cache.dtype == torch.float16 else "not float16"

        def cannot_attend(self, query, key_cache, value_cache):
            return None if query.dtype == torch.float16 else "not float16"

        def _falls_back(self, reason):
            calls.append(reason)

        def _write(self, *args):
            raise AssertionError("the kernel path ran for an input it cannot take")

        def _attend(self, *args):
            raise AssertionError("the kernel path ran for an input it cannot take")

    key = torch.randn(3, 2, 8)
    key_cache = torch.zeros(4, 4, 2, 8)
    value_cache = torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([4, 5, 6])
    Float16Only().write_kv_cache(key, key, key_cache, value_cache, slots)
    expected_cache = torch.zeros(4, 4, 2, 8)
    reference.write_kv_cache(key, key, expected_cache, torch.zeros(4, 4, 2, 8), slots)
    assert torch.equal(key_cache, expected_cache)
    metadata = build_attention_metadata([3], [3], [[1]], block_size=4, device="cpu")
    query = torch.randn(3, 4, 8)
    out = Float16Only().paged_attention(query, key_cache, value_cache, metadata, 0.5)
    assert torch.equal(out, reference.paged_attention(query, key_cache, value_cache, metadata, 0.5))
    assert calls == ["not float16"]
