"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from kernels.rms_norm import rms_norm
from workers.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """out = weight * x / sqrt(mean(x^2) + eps), computed in float32 and cast back (as Hugging Face does).

    With `residual`, first adds it: x = x + residual, and returns (norm(x), x) so the caller carries the new
    residual stream without a separate add. quantize=True: norm(x) as `QuantizedRows`, quantized in the same
    kernel, for an FP8 linear that `takes_quantized_rows`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = False):
        # x: [T, hidden]; residual: [T, hidden] | None -> out | (out, x + residual)
        return rms_norm(x, self.weight, self.eps, residual, quantize)
