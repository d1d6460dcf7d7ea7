"""The fused elementwise kernels against the torch ops they replace, under Triton's
interpreter on CPU and, as ``gpu`` tests, on CUDA: the residual sum bit for bit (in
bfloat16 only on the GPU: the interpreter truncates where the GPU rounds to nearest),
the rest within a unit in the last place."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()
    else:  # two bf16 roundings may each be off by one unit in the last place (2^-8 relative)
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-6, atol=1e-2)


def check_against_torch(device: str, exact_bf16: bool) -> None:
    """Each kernel on odd shapes and strided views against torch's ops, fp16 and bf16."""
    from kvserve.kernels import fused_elementwise as fused

    generator = torch.Generator().manual_seed(0)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    for dtype in (torch.float16, torch.bfloat16):
        exact = exact_bf16 or dtype == torch.float16
        # add + RMSNorm, with and without the residual, rows of a wider tensor
        x, residual, weight = randn(7, 100, dtype=dtype)[:, :96], randn(7, 96, dtype=dtype), randn(96, dtype=dtype)
        out, summed = fused.add_rms_norm(x, weight, 1e-5, residual)
        expected_sum = x + residual
        s = expected_sum.float()
        expected = weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        _assert_close(summed, expected_sum, exact)
        # the sum of squares may be added in another order: allow one unit in the last place
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-6 if not exact else 2**-7, atol=1e-2)
        out, none = fused.add_rms_norm(x, weight, 1e-5)
        assert none is None
        xf = x.float()
        torch.testing.assert_close(
            out.float(), (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)).float(),
            rtol=2**-6, atol=1e-2)

        # RoPE on the q/k heads of a packed qkv row (strided), 5 tokens x 6 heads x 32
        qkv = randn(5, 8 * 32, dtype=dtype)
        qk = qkv[:, : 6 * 32].view(5, 6, 32)
        positions = torch.tensor([0, 3, 17, 255, 1000], device=device)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2, device=device).float() / 32)
        freqs = positions[:, None].float() * inv_freq
        cos, sin = freqs.cos().unsqueeze(1).to(dtype), freqs.sin().unsqueeze(1).to(dtype)
        x1, x2 = qk[..., :16], qk[..., 16:]
        rotated = fused.rotate_half(qk, cos, sin)
        assert rotated.is_contiguous() and rotated.shape == qk.shape
        # within one unit in the last place: on the GPU the compiler may contract a product
        # into the sum (seen in float16 on an H200)
        _assert_close(rotated, torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1), exact=False)

        # SiLU-and-mul, a width that is not a power of two; exp may differ from torch's
        # in its last float32 bit, so a rounding may go the other way
        gate_up = randn(3, 2 * 1500, dtype=dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        _assert_close(fused.silu_and_mul(gate_up), F.silu(gate) * up, exact=False)

        # other specialisations of the same kernels: a base pointer off 16-byte alignment, then an
        # aligned one again, then contiguous rows (16-byte accesses in the CUDA kernels); a single
        # head (an integer argument of 1, which Triton compiles as a constant); each against torch
        for view in (randn(7, 101, dtype=dtype)[:, 1:97], x, randn(7, 96, dtype=dtype)):
            out, summed = fused.add_rms_norm(view, weight, 1e-5, residual)
            _assert_close(summed, view + residual, exact)
            s = summed.float()
            expected = weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
            torch.testing.assert_close(out.float(), expected.float(), rtol=2**-6, atol=1e-2)
        gate_up = randn(3, 2 * 1024, dtype=dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        _assert_close(fused.silu_and_mul(gate_up), F.silu(gate) * up, exact=False)
        one_head = qk[:, :1]
        _assert_close(fused.rotate_half(one_head, cos, sin),
                      torch.cat((one_head[..., :16] * cos - one_head[..., 16:] * sin,
                                 one_head[..., 16:] * cos + one_head[..., :16] * sin), dim=-1), exact=False)

        # no rows: nothing launched, empty results
        empty = randn(0, 96, dtype=dtype)
        assert fused.add_rms_norm(empty, weight, 1e-5, empty)[0].shape == (0, 96)
        assert fused.silu_and_mul(randn(0, 64, dtype=dtype)).shape == (0, 32)


def check_rope_and_write_kv(device: str, exact: bool) -> None:
    """RoPE with the cache write in one kernel against ``rotate_half`` and the reference cache
    write: the same query, the same cache (padding rows and every other slot untouched),
    then the attention layer's packed path with the fused kernel against its two-call path."""
    from kvserve.kernels import fused_elementwise as fused
    from kvserve.kernels import reference
    from kvserve.kernels.attention_metadata import build_attention_metadata
    from kvserve.kernels.backend import TorchReferenceBackend
    from kvserve.worker.layers import Attention, RotaryEmbedding
    from kvserve.worker.layers import attention as attention_module
    from kvserve.worker.layers import rotary_embedding as rope_module

    generator = torch.Generator().manual_seed(1)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    heads, kv_heads, head_dim, block_size = 6, 2, 32, 4
    for dtype in (torch.float16, torch.bfloat16):
        # 5 tokens' packed rows, each a row of a wider tensor; token 2 is a padding row
        qkv = randn(5, (heads + 2 * kv_heads) * head_dim + 16, dtype=dtype)[:, : (heads + 2 * kv_heads) * head_dim]
        slots = torch.tensor([3, 7, -1, 12, 0], device=device)
        rope = RotaryEmbedding(head_dim, 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(device)
        cos, sin = rope.cos_sin(torch.tensor([0, 5, 9, 255, 1000], device=device), dtype)
        key_cache, value_cache = randn(2, 4, block_size, kv_heads, head_dim, dtype=dtype).unbind(0)
        expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()

        query = fused.rope_and_write_kv(qkv, cos, sin, key_cache, value_cache, slots, heads)

        qk = fused.rotate_half(qkv[:, : (heads + kv_heads) * head_dim].view(5, -1, head_dim), cos, sin)
        value = qkv[:, (heads + kv_heads) * head_dim :].reshape(5, kv_heads, head_dim)
        real = slots >= 0
        reference.write_kv_cache(
            qk[:, heads:][real], value[real], expected_key_cache, expected_value_cache, slots[real])
        assert query.shape == (5, heads, head_dim) and query.is_contiguous()
        _assert_close(query, qk[:, :heads], exact)
        _assert_close(key_cache, expected_key_cache, exact)
        assert torch.equal(value_cache, expected_value_cache)

        # the attention layer, fused and not, on a batch of a 3-token chunk and two decodes
        metadata = build_attention_metadata(
            query_lens=[3, 1, 1], seq_lens=[3, 6, 2], block_tables=[[0], [2, 1], [3]], block_size=block_size,
            device=device)
        positions = torch.tensor([0, 1, 2, 5, 1], device=device)
        layer = Attention(heads, head_dim, head_dim**-0.5, kv_heads, TorchReferenceBackend())
        outputs, fused_calls = [], []
        try:
            # the layer's one-kernel path, seen to run
            attention_module.rope_and_write_kv = lambda *args: fused_calls.append(1) or fused.rope_and_write_kv(*args)
            for fuse in (True, False):
                # the two-call path's RoPE through Triton too (on CPU the fused path is Triton's):
                # bit for bit the same values under the interpreter
                attention_module.fused_kernels_apply = lambda x, fuse=fuse: fuse
                rope_module.fused_kernels_apply = lambda x: True
                rope.clear_cache()
                caches = tuple(torch.zeros(4, block_size, kv_heads, head_dim, dtype=dtype, device=device)
                               for _ in "kv")
                outputs.append((layer.forward_packed(positions, qkv, rope, caches, metadata), *caches))
                assert len(fused_calls) == 1, fuse  # once with fuse, not again without
        finally:
            attention_module.fused_kernels_apply = rope_module.fused_kernels_apply = fused.fused_kernels_apply
            attention_module.rope_and_write_kv = fused.rope_and_write_kv
        for fused_result, unfused_result in zip(*outputs):
            _assert_close(fused_result, unfused_result, exact)
        assert outputs[0][0].shape == (5, heads * head_dim) and outputs[0][1].abs().sum() > 0

    with pytest.raises(ValueError, match="heads"):
        fused.rope_and_write_kv(qkv[:, :-head_dim], cos, sin, key_cache, value_cache, slots, heads)
    with pytest.raises(ValueError, match="int64"):
        fused.rope_and_write_kv(qkv, cos, sin, key_cache, value_cache, slots.int(), heads)


def test_kernels_match_torch_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = ("from tests.kernels.test_fused_elementwise import check_against_torch, check_rope_and_write_kv; "
            "check_against_torch('cpu', False); check_rope_and_write_kv('cpu', True)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_layers_keep_torch_ops_off_cuda_and_in_float32():
    from kvserve.kernels.fused_elementwise import fused_kernels_apply

    assert not fused_kernels_apply(torch.zeros(2, 4, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        assert not fused_kernels_apply(torch.zeros(2, 4, device="cuda"))


class CountingExtension:
    """The CUDA extension, counting the calls of each of its functions."""

    def __init__(self, extension) -> None:
        self._extension, self.calls = extension, Counter()

    def __getattr__(self, name: str):
        function = getattr(self._extension, name)

        def counted(*args):
            self.calls[name] += 1
            return function(*args)

        return counted


@pytest.fixture(params=["cuda", "triton"])
def implementation(request, monkeypatch) -> CountingExtension | None:
    """The fused functions on the CUDA extension's kernels (counted), or on Triton's (``None``)."""
    from kvserve.kernels import fused_elementwise

    extension = None
    if request.param == "cuda":
        from kvserve.kernels.cuda_build import load_cuda_extension

        extension = CountingExtension(load_cuda_extension())
    monkeypatch.setattr(fused_elementwise, "cuda_extension", lambda: extension)
    return extension


@pytest.mark.gpu
def test_kernels_match_torch_on_cuda(implementation):
    check_against_torch("cuda", exact_bf16=True)
    check_rope_and_write_kv("cuda", exact=False)
    if implementation is not None:
        assert set(implementation.calls) == {"add_rms_norm", "rope_and_write_kv", "silu_and_mul"}


@pytest.mark.gpu
def test_extension_kernels_refuse_what_they_do_not_run():
    from kvserve.kernels.cuda_build import load_cuda_extension

    extension = load_cuda_extension()
    rows = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        extension.add_rms_norm(rows.float(), None, rows[0].float(), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        extension.add_rms_norm(rows, None, rows[0, :32], 1e-6)
    with pytest.raises(RuntimeError, match="even width"):
        extension.silu_and_mul(rows[:, :63])
    cache = torch.zeros(2, 16, 1, 16, device="cuda", dtype=torch.bfloat16)
    angles = torch.ones(4, 8, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(4, device="cuda")
    with pytest.raises(RuntimeError, match="are not 3 \\+ 2 x 1 heads of 16"):
        extension.rope_and_write_kv(rows, angles, angles, cache, cache.clone(), slots, 3)
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        extension.rope_and_write_kv(rows, angles, angles, cache, cache.clone(), slots.int(), 2)
    # no rows: empty results, nothing launched
    assert extension.silu_and_mul(rows[:0]).shape == (0, 32)
    out, residual = extension.add_rms_norm(rows[:0], rows[:0], rows[0], 1e-6)
    assert out.shape == residual.shape == (0, 64)


@pytest.mark.gpu
def test_fused_layers_match_unfused_layers_on_cuda(monkeypatch, implementation):
    """RMSNorm, RoPE and SiLU-and-mul modules give the same bf16 results with the kernels
    as through torch's ops."""
    from kvserve.worker.layers import RMSNorm, RotaryEmbedding, SiluAndMul

    torch.manual_seed(0)
    norm = RMSNorm(512, 1e-6).to(device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    rope = RotaryEmbedding(64, 1.0 / 500000 ** (torch.arange(0, 64, 2).float() / 64)).cuda()
    act = SiluAndMul()
    x, residual = torch.randn(2, 33, 512, device="cuda", dtype=torch.bfloat16).unbind(0)
    heads = torch.randn(33, 12, 64, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(33, device="cuda") * 11

    def run():
        rope.clear_cache()
        return (*norm(x, residual), norm(x), rope.rotate(positions, heads), act(x))

    fused = run()
    if implementation is not None:
        assert set(implementation.calls) == {"add_rms_norm", "silu_and_mul"}  # RoPE alone is Triton's only
    for module in ("layernorm", "rotary_embedding", "activation"):
        monkeypatch.setattr(f"kvserve.worker.layers.{module}.fused_kernels_apply", lambda tensor: False)
    unfused = run()
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-2)


def test_triton_kernels_compile_for_hopper_without_a_gpu():
    """Each Triton kernel through Triton's whole compiler (to a cubin for sm_90), as on a GPU: the
    interpreter runs the kernels' Python, not their compilation (types, closures, constexprs)."""
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from kvserve.kernels import fused_elementwise as fused

    kernels = fused._triton()
    norm, rotate, silu, rope = (kernels.add_rms_norm_kernel, kernels.rotate_half_kernel, kernels.silu_and_mul_kernel,
                                kernels.rope_and_write_kv_kernel)
    pointers = lambda *names: {name: "*bf16" for name in names}  # noqa: E731
    integers = lambda *names: {name: "i32" for name in names}  # noqa: E731
    cases = [
        (norm, {**pointers("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr"),
                **integers("x_stride", "residual_stride", "out_stride", "hidden"), "eps": "fp32"},
         {"HAS_RESIDUAL": True, "BLOCK": 4096}),
        (rotate, {**pointers("x_ptr", "cos_ptr", "sin_ptr", "out_ptr"),
                  **integers("x_token_stride", "x_head_stride", "cos_stride", "num_heads")},
         {"HALF": 64, "BLOCK": 64}),
        (silu, {**pointers("x_ptr", "out_ptr"), **integers("x_stride", "d")}, {"BLOCK": 1024}),
        (rope, {**pointers("qkv_ptr", "cos_ptr", "sin_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"),
                "slot_ptr": "*i64", **integers("qkv_stride", "cos_stride", "num_heads", "num_kv_heads")},
         {"HALF": 64, "BLOCK": 64}),
    ]
    for kernel, signature, constexprs in cases:
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        compiled = compiler.compile(compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                    target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel
