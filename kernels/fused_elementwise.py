"""The decoder layer's small elementwise steps, each one Triton kernel on the GPU.

In a decode step the matmuls and attention read the weights and the cache; what is
left is elementwise work on a few hundred KiB, which costs its launch, not its bytes.
Written as torch ops, a residual add + RMSNorm is nine kernels, RoPE seven and
SiLU-and-mul two: about 27 of a layer's 35 kernels, a few microseconds each even
inside a CUDA graph.  Here each is one kernel:

* :func:`add_rms_norm`: ``residual = x + residual``; ``weight * norm(residual)``;
* :func:`rotate_half`: RoPE (Hugging Face's rotate-half layout) of ``[n, heads, dim]``;
* :func:`silu_and_mul`: ``silu(x[:, :d]) * x[:, d:]``.

Each rounds where torch's ops round (every op's result to the tensor's dtype), so
the fused and the unfused layer agree to a unit in the last place (the norm's sum
of squares is added in another order; the compiler may contract a product into a
sum; ``exp`` may differ in its last float32 bit).  :func:`fused_kernels_apply` says when the layers use them:
half-precision CUDA tensors with Triton installed (float32 stays on torch's ops,
bit for bit Hugging Face's, for the parity tests).  ``TRITON_INTERPRET=1`` runs
the kernels on CPU tensors, which is how CPU-only CI tests them.
"""

from __future__ import annotations

import functools
import os

import torch

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("KVSERVE_FUSED_KERNELS", "1") != "0"


def fused_kernels_apply(x: torch.Tensor) -> bool:
    """Whether the layers run ``x`` through these kernels (half precision on CUDA, Triton
    installed, ``KVSERVE_FUSED_KERNELS`` not ``0``)."""
    return x.is_cuda and x.dtype in _HALF and triton_available()


@functools.cache
def _kernels():
    """The Triton kernels, compiled on first use (``triton.jit`` reads ``TRITON_INTERPRET``
    when it wraps a function, so they are defined here rather than at import)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                            x_stride, residual_stride, out_stride, hidden, eps,
                            HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(residual_out_ptr + row * out_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / hidden
        normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * out_stride + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def rotate_half_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_token_stride, x_head_stride, cos_stride,
                           num_heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        mask = cols < HALF
        base = x_ptr + token * x_token_stride + head * x_head_stride
        x1 = tl.load(base + cols, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + cols, mask=mask, other=0.0)
        cos = tl.load(cos_ptr + token * cos_stride + cols, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * cos_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = x1.dtype
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        # Each product rounded, then the sum: torch's x1 * cos - x2 * sin, op by op.
        first = ((x1f * cos).to(dtype).to(tl.float32) - (x2f * sin).to(dtype).to(tl.float32)).to(dtype)
        second = ((x2f * cos).to(dtype).to(tl.float32) + (x1f * sin).to(dtype).to(tl.float32)).to(dtype)
        out = out_ptr + (token * num_heads + head) * (2 * HALF)
        tl.store(out + cols, first, mask=mask)
        tl.store(out + HALF + cols, second, mask=mask)

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, x_stride, d, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * d + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)

    return add_rms_norm_kernel, rotate_half_kernel, silu_and_mul_kernel


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight * norm(x + residual), x + residual)`` for ``x, residual [n, hidden]``; without
    ``residual``, ``(weight * norm(x), None)``.  The norm is Hugging Face's: float32 mean of
    squares, rounded to ``x``'s dtype before the weight."""
    n, hidden = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("add_rms_norm needs rows with unit stride")
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if n:
        kernel = _kernels()[0]
        kernel[(n,)](
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
        _kernels()[1][(n, heads)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), heads,
            HALF=half, BLOCK=_next_power_of_2(half),
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` of ``x [n, 2d]``, rounded like torch's two ops."""
    n, width = x.shape
    d = width // 2
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows with unit stride")
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    block = min(1024, _next_power_of_2(d))
    if n:
        _kernels()[2][(n, -(-d // block))](x, out, x.stride(0), d, BLOCK=block)
    return out
