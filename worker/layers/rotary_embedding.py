"""Rotary position embedding (RoPE), rotate-half layout as in Hugging Face Llama.

Supported ``rope_type``: ``default``, ``linear`` and ``llama3``. Others (``dynamic``,
``yarn``, ``longrope``, ...) raise ValueError rather than run silently wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvserve.kernels.fused_elementwise import fused_kernels_apply, rotate_half, triton_available

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of a Hugging Face config as one flat dict with ``rope_type``
    and ``rope_theta``.

    transformers >= 5 keeps them in ``config.rope_parameters``; older versions in
    ``config.rope_scaling`` (``type`` or ``rope_type``) plus ``config.rope_theta``.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types & set(params):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {sorted(params)}")
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any], max_positions: int) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings") or max_positions
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are scaled by 1/factor, short ones kept, the middle band smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, params: dict[str, Any], max_positions: int) -> torch.Tensor:
    """float32 inverse frequencies ``[head_dim // 2]`` for ``params`` (see :func:`rope_parameters`)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported")
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params, max_positions)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token's position.

    ``rotate`` works on any ``[n, heads, head_dim]`` tensor, so a layer whose q and
    k heads are adjacent in memory rotates both in one call.  The result is bit for
    bit Hugging Face's ``x * cos + rotate_half(x) * sin``: each half is
    ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, the same products and sums.

    NOTE: ``inv_freq`` is a float32 buffer; build the model in its final dtype rather
    than casting it with ``.to(dtype)``, which would round the frequencies.
    """

    def __init__(self, head_dim: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self._cached_positions: torch.Tensor | None = None
        self._cached_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def clear_cache(self) -> None:
        """Forget the angles of the last ``positions``; call at the start of a forward pass."""
        self._cached_positions = self._cached_cos_sin = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[n, 1, head_dim // 2]`` of ``positions [n]``: computed in
        float32, then cast to ``dtype``.

        NOTE: one module serves every layer, and every layer of a forward pass gets
        the same ``positions`` tensor: the angles are computed (and cast) for its first
        layer and reused by the others, until :meth:`clear_cache` (so a positions buffer
        rewritten in place between passes is safe; inference tensors carry no
        version counter to tell).
        """
        cached = self._cached_cos_sin
        if positions is not self._cached_positions or cached is None or cached[0].dtype != dtype:
            freqs = positions.unsqueeze(-1).float() * self.inv_freq.float()
            cached = freqs.cos().unsqueeze(1).to(dtype), freqs.sin().unsqueeze(1).to(dtype)
            self._cached_positions, self._cached_cos_sin = positions, cached
        return cached

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x [n, heads, head_dim]`` rotated by ``positions [n]``, as a new contiguous tensor."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if fused_kernels_apply(x) and triton_available():  # rotate_half is Triton's only
            return rotate_half(x, cos, sin)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]``, ``query [n, heads, head_dim]``, ``key [n, kv_heads, head_dim]``."""
        return self.rotate(positions, query), self.rotate(positions, key)


def get_rope(head_dim: int, config: Any) -> RotaryEmbedding:
    """The RotaryEmbedding a Hugging Face config asks for; ValueError if unsupported."""
    params = rope_parameters(config)
    inv_freq = compute_inv_freq(head_dim, params, config.max_position_embeddings)
    return RotaryEmbedding(head_dim, inv_freq)
