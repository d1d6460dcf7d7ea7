"""The Triton kernels of :mod:`kvserve.kernels.fused_elementwise` (see there for what each
computes and how it rounds).

Imported on first use only: ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a
function, and Triton may be absent.  Module-level, so that Triton's interpreter, which runs a
kernel's source in its module's globals, finds the helpers a kernel calls.
"""

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
def rotated_halves(head_ptr, cos_ptr, sin_ptr, cols, mask, HALF: tl.constexpr):
    """The two rotated halves of the head at ``head_ptr``, in its dtype: each product
    rounded, then the sum, as torch's ``x1 * cos - x2 * sin`` runs op by op."""
    x1 = tl.load(head_ptr + cols, mask=mask, other=0.0)
    x2 = tl.load(head_ptr + HALF + cols, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    first = ((x1f * cos).to(dtype).to(tl.float32) - (x2f * sin).to(dtype).to(tl.float32)).to(dtype)
    second = ((x2f * cos).to(dtype).to(tl.float32) + (x1f * sin).to(dtype).to(tl.float32)).to(dtype)
    return first, second


@triton.jit
def rotate_half_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_token_stride, x_head_stride, cos_stride,
                       num_heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    first, second = rotated_halves(x_ptr + token * x_token_stride + head * x_head_stride,
                                   cos_ptr + token * cos_stride, sin_ptr + token * cos_stride, cols, mask, HALF)
    out = out_ptr + (token * num_heads + head) * (2 * HALF)
    tl.store(out + cols, first, mask=mask)
    tl.store(out + HALF + cols, second, mask=mask)


@triton.jit
def rope_and_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
                             qkv_stride, cos_stride, num_heads, num_kv_heads,
                             HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads; a k head's program also copies its v head
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    row = qkv_ptr + token * qkv_stride
    first, second = rotated_halves(row + head * (2 * HALF), cos_ptr + token * cos_stride,
                                   sin_ptr + token * cos_stride, cols, mask, HALF)
    if head < num_heads:
        out = query_ptr + (token * num_heads + head) * (2 * HALF)
        tl.store(out + cols, first, mask=mask)
        tl.store(out + HALF + cols, second, mask=mask)
    else:
        slot = tl.load(slot_ptr + token)  # int64; -1 for a padding row, which writes nothing
        if slot >= 0:
            kv_head = head - num_heads
            offset = (slot * num_kv_heads + kv_head) * (2 * HALF)
            tl.store(key_cache_ptr + offset + cols, first, mask=mask)
            tl.store(key_cache_ptr + offset + HALF + cols, second, mask=mask)
            v = row + (num_heads + num_kv_heads + kv_head) * (2 * HALF)
            tl.store(value_cache_ptr + offset + cols, tl.load(v + cols, mask=mask), mask=mask)
            tl.store(value_cache_ptr + offset + HALF + cols, tl.load(v + HALF + cols, mask=mask), mask=mask)


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
