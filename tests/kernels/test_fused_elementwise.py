"""The fused elementwise kernels against the torch ops they replace, under Triton's
interpreter on CPU and, as ``gpu`` tests, on CUDA: the residual sum bit for bit (in
bfloat16 only on the GPU: the interpreter truncates where the GPU rounds to nearest),
the rest within a unit in the last place."""

from __future__ import annotations

import os
import subprocess
import sys
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
        # aligned one again; a single head (an integer argument of 1, which Triton compiles as a
        # constant); each against torch
        for view in (randn(7, 101, dtype=dtype)[:, 1:97], x):
            out, summed = fused.add_rms_norm(view, weight, 1e-5, residual)
            _assert_close(summed, view + residual, exact)
        one_head = qk[:, :1]
        _assert_close(fused.rotate_half(one_head, cos, sin),
                      torch.cat((one_head[..., :16] * cos - one_head[..., 16:] * sin,
                                 one_head[..., 16:] * cos + one_head[..., :16] * sin), dim=-1), exact=False)

        # no rows: nothing launched, empty results
        empty = randn(0, 96, dtype=dtype)
        assert fused.add_rms_norm(empty, weight, 1e-5, empty)[0].shape == (0, 96)
        assert fused.silu_and_mul(randn(0, 64, dtype=dtype)).shape == (0, 32)


def test_kernels_match_torch_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = "from tests.kernels.test_fused_elementwise import check_against_torch; check_against_torch('cpu', False)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_layers_keep_torch_ops_off_cuda_and_in_float32():
    from kvserve.kernels.fused_elementwise import fused_kernels_apply

    assert not fused_kernels_apply(torch.zeros(2, 4, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        assert not fused_kernels_apply(torch.zeros(2, 4, device="cuda"))


@pytest.mark.gpu
def test_kernels_match_torch_on_cuda():
    check_against_torch("cuda", exact_bf16=True)


@pytest.mark.gpu
def test_fused_layers_match_unfused_layers_on_cuda(monkeypatch):
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
    for module in ("layernorm", "rotary_embedding", "activation"):
        monkeypatch.setattr(f"kvserve.worker.layers.{module}.fused_kernels_apply", lambda tensor: False)
    unfused = run()
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-2)
