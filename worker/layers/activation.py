"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.fused_elementwise import fused_kernels_apply, silu_and_mul


class SiluAndMul(nn.Module):
    """``[..., 2d] -> [..., d]``: ``silu(x[..., :d]) * x[..., d:]`` (gate first, then up);
    one fused kernel for half-precision CUDA rows (``kernels.fused_elementwise``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_kernels_apply(x) and x.dim() == 2:
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
