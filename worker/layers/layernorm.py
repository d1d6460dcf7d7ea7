"""RMSNorm, with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.fused_elementwise import add_rms_norm, fused_kernels_apply
from kvserve.worker.layers.linear import new_parameter


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 like Hugging Face's.

    ``forward(x)`` returns the normalized ``x``. ``forward(x, residual)`` first adds:
    it returns ``(norm(x + residual), x + residual)``, so a decoder layer carries the
    residual stream without a separate add.  Half-precision CUDA tensors take one
    fused kernel for both (``kernels.fused_elementwise``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = new_parameter(hidden_size)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # NOTE: the same operations in the same order, in one call (bit for bit
            # the code below in float32; not in half precision, where it rounds
            # differently from Hugging Face's).
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused_kernels_apply(x) and x.dim() == 2 and self.weight.dtype == x.dtype:
            out, residual = add_rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
