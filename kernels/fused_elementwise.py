"""The decoder layer's small elementwise steps, each one kernel on the GPU.

In a decode step the matmuls and attention read the weights and the cache; what is
left is elementwise work on a few hundred KiB, which costs its launch, not its bytes.
Written as torch ops, a residual add + RMSNorm is nine kernels, RoPE seven and
SiLU-and-mul two: about 27 of a layer's 35 kernels, a few microseconds each even
inside a CUDA graph.  Here each is one kernel:

* :func:`add_rms_norm`: ``residual = x + residual``; ``weight * norm(residual)``;
* :func:`rotate_half`: RoPE (Hugging Face's rotate-half layout) of ``[n, heads, dim]``;
* :func:`rope_and_write_kv`: RoPE of a packed qkv row's q and k heads, with its k and v
  heads written into the paged cache in the same kernel (one launch where RoPE and the
  backend's cache write were two);
* :func:`silu_and_mul`: ``silu(x[:, :d]) * x[:, d:]``.

Each rounds where torch's ops round (every op's result to the tensor's dtype), so
the fused and the unfused layer agree to a unit in the last place (the norm's sum
of squares is added in another order; the compiler may contract a product into a
sum; ``exp`` may differ in its last float32 bit).  :func:`fused_kernels_apply` says
when the layers use them: half-precision CUDA tensors (float32 stays on torch's ops,
bit for bit Hugging Face's, for the parity tests).

Two implementations, by ``KVSERVE_FUSED_KERNELS``:

* unset or ``1``: the CUDA extension's (``csrc/layer_ops_kernels.cuh``) once this process
  has loaded it (the CUDA attention backend builds it), else Triton's.  A Triton launch
  costs tens of microseconds of Python on the host (binding and specialising its
  arguments), the extension's a C++ call: an eager step launches about four of these a
  layer, so that is the host's time of eager (mixed) steps.  ``rotate_half`` (the q/k
  rotation of models that normalise the heads first) is Triton's only.
* ``triton``: Triton's always;
* ``0``: neither, torch's ops.

``TRITON_INTERPRET=1`` runs the Triton kernels on CPU tensors, which is how CPU-only CI
tests them; the CUDA ones are compile-checked there and tested on a GPU.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

MODE_ENV = "KVSERVE_FUSED_KERNELS"
_HALF = (torch.bfloat16, torch.float16)
_extension: ModuleType | None = None


@functools.cache
def _mode() -> str:
    mode = os.environ.get(MODE_ENV, "1").strip().lower()
    if mode not in ("0", "1", "triton"):
        raise ValueError(f"{MODE_ENV}={mode!r}: expected 1 (the default), triton or 0")
    return mode


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return _mode() != "0"


def cuda_extension() -> ModuleType | None:
    """The CUDA extension whose kernels the functions here launch, or ``None`` (Triton's then):
    the one this process has loaded, unless ``KVSERVE_FUSED_KERNELS`` says otherwise.  It is
    never built here."""
    global _extension
    if _extension is None and _mode() == "1":  # found once, then kept (set only in mode 1)
        from kvserve.kernels.cuda_build import loaded_cuda_extension

        _extension = loaded_cuda_extension()
    return _extension


def fused_kernels_apply(x: torch.Tensor) -> bool:
    """Whether the layers run ``x`` through these kernels: half precision on CUDA, the CUDA
    extension loaded or Triton installed, ``KVSERVE_FUSED_KERNELS`` not ``0``."""
    return x.is_cuda and x.dtype in _HALF and (triton_available() or cuda_extension() is not None)


def _triton() -> ModuleType:
    """The Triton kernels' module, imported on first use (see :mod:`kvserve.kernels.triton_elementwise`)."""
    from kvserve.kernels import triton_elementwise

    return triton_elementwise


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight * norm(x + residual), x + residual)`` for ``x, residual [n, hidden]``; without
    ``residual``, ``(weight * norm(x), None)``.  The norm is Hugging Face's: float32 mean of
    squares, rounded to ``x``'s dtype before the weight."""
    extension = cuda_extension() if x.is_cuda else None
    if extension is not None:
        return extension.add_rms_norm(x, residual, weight, eps)
    n, hidden = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("add_rms_norm needs rows with unit stride")
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if n:
        _triton().add_rms_norm_kernel[(n,)](
            x, residual if residual is not None else x, weight, out,
            residual_out if residual_out is not None else out,
            x.stride(0), residual.stride(0) if residual is not None else 0, hidden, hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=_next_power_of_2(hidden),
        )
    return out, residual_out


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x [n, heads, head_dim]`` (any strides, unit stride within a head) by
    ``cos, sin [n, 1, head_dim // 2]`` (or ``[n, head_dim // 2]``): a new contiguous tensor,
    ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``."""
    n, heads, head_dim = x.shape
    half = head_dim // 2
    cos, sin = cos.reshape(n, half), sin.reshape(n, half)
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotate_half needs unit stride within each head and like cos/sin")
    out = torch.empty((n, heads, head_dim), dtype=x.dtype, device=x.device)
    if n:
        _triton().rotate_half_kernel[(n, heads)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), heads,
            HALF=half, BLOCK=_next_power_of_2(half),
        )
    return out


def rope_and_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """The rotated query heads ``[n, num_heads, head_dim]`` of a packed ``qkv [n, (num_heads +
    2 * kv_heads) * head_dim]`` row (q heads, then k, then v), by ``cos, sin`` as in
    :func:`rotate_half`; its rotated k heads and its v heads are written into the caches
    ``[num_blocks, block_size, kv_heads, head_dim]`` at ``slot_mapping`` (int64 ``[n]``; a
    negative slot writes nothing), as ``reference.write_kv_cache`` would write them.

    The same values as :func:`rotate_half` on the q and k heads followed by a cache write.
    """
    n = qkv.shape[0]
    extension = cuda_extension() if qkv.is_cuda else None
    if extension is not None:
        half = key_cache.shape[-1] // 2
        return extension.rope_and_write_kv(
            qkv, cos.reshape(n, half), sin.reshape(n, half), key_cache, value_cache, slot_mapping, num_heads)
    head_dim, num_kv_heads = key_cache.shape[-1], key_cache.shape[-2]
    half = head_dim // 2
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(
            f"qkv rows of {qkv.shape[1]} are not {num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
    if value_cache.shape != key_cache.shape or slot_mapping.shape != (n,) or slot_mapping.dtype != torch.int64:
        raise ValueError("rope_and_write_kv needs equal key/value caches and an int64 slot per row")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or key_cache.dtype != qkv.dtype:
        raise ValueError("rope_and_write_kv needs contiguous caches of the rows' dtype")
    cos, sin = cos.reshape(n, half), sin.reshape(n, half)
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_and_write_kv needs rows with unit stride and like cos/sin")
    query = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        _triton().rope_and_write_kv_kernel[(n, num_heads + num_kv_heads)](
            qkv, cos, sin, slot_mapping, query, key_cache, value_cache, qkv.stride(0), cos.stride(0),
            num_heads, num_kv_heads, HALF=half, BLOCK=_next_power_of_2(half),
        )
    return query


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` of ``x [n, 2d]``, rounded like torch's two ops."""
    extension = cuda_extension() if x.is_cuda else None
    if extension is not None:
        return extension.silu_and_mul(x)
    n, width = x.shape
    d = width // 2
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows with unit stride")
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    block = min(1024, _next_power_of_2(d))
    if n:
        _triton().silu_and_mul_kernel[(n, -(-d // block))](x, out, x.stride(0), d, BLOCK=block)
    return out
