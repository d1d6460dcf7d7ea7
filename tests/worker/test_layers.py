"""RoPE and RMSNorm: the fast paths are Hugging Face's arithmetic, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvserve.worker.layers import RMSNorm, RotaryEmbedding
from kvserve.worker.layers.rotary_embedding import compute_inv_freq

HEAD_DIM = 16


def make_rope() -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, compute_inv_freq(HEAD_DIM, {"rope_type": "default", "rope_theta": 10000.0}, 4096))


def hugging_face_rotation(
    rope: RotaryEmbedding, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama RoPE on ``[n, heads, head_dim]`` tensors."""
    freqs = positions[None, :, None].float() * rope.inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(query.dtype), emb.sin().to(query.dtype)
    q, k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_hugging_face_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4000, (37,), generator=generator)
    query = torch.randn(37, 4, HEAD_DIM, generator=generator).to(dtype)
    key = torch.randn(37, 2, HEAD_DIM, generator=generator).to(dtype)
    rope = make_rope()
    expected_q, expected_k = hugging_face_rotation(rope, positions, query, key)
    rotated_q, rotated_k = rope(positions, query, key)
    assert torch.equal(rotated_q, expected_q) and torch.equal(rotated_k, expected_k)


def test_q_and_k_rotate_together_as_one_tensor() -> None:
    generator = torch.Generator().manual_seed(1)
    positions = torch.arange(5, 12)
    qk = torch.randn(7, 6, HEAD_DIM, generator=generator)
    rope = make_rope()
    together = rope.rotate(positions, qk)
    rotated_q, rotated_k = rope(positions, qk[:, :4], qk[:, 4:])
    assert torch.equal(together[:, :4], rotated_q) and torch.equal(together[:, 4:], rotated_k)


def test_angles_follow_a_positions_buffer_rewritten_between_passes() -> None:
    rope = make_rope()
    positions = torch.arange(4)
    x = torch.randn(4, 2, HEAD_DIM)
    first = rope.rotate(positions, x)
    assert torch.equal(rope.rotate(positions, x), first), "reused within a pass"
    positions.add_(100)
    rope.clear_cache()
    assert torch.equal(rope.rotate(positions, x), rope.rotate(positions.clone(), x))
    assert not torch.equal(rope.rotate(positions, x), first)


def test_angles_reused_within_a_pass_follow_the_dtype_of_the_rotated_tensor() -> None:
    rope = make_rope()
    positions = torch.arange(3, 9)
    x = torch.randn(6, 2, HEAD_DIM)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        rotated = rope.rotate(positions, x.to(dtype))
        assert rotated.dtype == dtype
        assert torch.equal(rotated, make_rope().rotate(positions, x.to(dtype)))


@pytest.mark.parametrize("with_residual", [False, True])
def test_float32_rms_norm_is_the_explicit_formula_bit_for_bit(with_residual: bool) -> None:
    generator = torch.Generator().manual_seed(2)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=generator)
    x = torch.randn(33, 96, generator=generator) * 4
    residual = torch.randn(33, 96, generator=generator) if with_residual else None
    summed = x if residual is None else x + residual
    expected = norm.weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + norm.eps))
    output = norm(x) if residual is None else norm(x, residual)[0]
    assert torch.equal(output, expected)
