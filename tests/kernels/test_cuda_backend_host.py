"""Host-side checks of the CUDA backend that need no GPU: the inputs it hands the kernels."""

from __future__ import annotations

import torch

from kvserve.kernels.cuda_backend import _index_tensor, _vector_ready


def strides_vectorizable(tensor: torch.Tensor) -> bool:
    elems = 16 // tensor.element_size()
    return tensor.stride(-1) == 1 and all(s % elems == 0 for s in tensor.stride()[:-1]) and tensor.data_ptr() % 16 == 0


def test_a_fused_qkv_view_is_used_as_it_is() -> None:
    qkv = torch.randn(5, (4 + 2 * 2) * 64, dtype=torch.float16)
    query = qkv[:, : 4 * 64].view(5, 4, 64)

    assert _vector_ready(query) is query


def test_an_odd_stride_of_a_size_one_dimension_is_copied_with_every_stride_aligned() -> None:
    # .contiguous() would return this view itself (a size-1 dimension's stride does not count).
    base = torch.randn(256, dtype=torch.float16)
    view = base.as_strided((1, 2, 64), (3, 64, 1))
    assert view.is_contiguous() and not strides_vectorizable(view)

    ready = _vector_ready(view)

    assert strides_vectorizable(ready)
    assert torch.equal(ready, view)


def test_a_misaligned_start_is_copied() -> None:
    base = torch.randn(2 * 64 + 1, dtype=torch.float16)
    view = base[1:].view(2, 1, 64)  # starts 2 bytes into the allocation

    ready = _vector_ready(view)

    assert strides_vectorizable(ready) and torch.equal(ready, view)


def test_index_tensors_of_another_width_or_layout_are_converted_and_the_right_ones_passed_as_they_are() -> None:
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert _index_tensor(table, torch.int32) is table

    wide = _index_tensor(table.long(), torch.int32)
    strided = _index_tensor(table.t(), torch.int32)

    assert wide.dtype == torch.int32 and torch.equal(wide, table)
    assert strided.is_contiguous() and torch.equal(strided, table.t())
