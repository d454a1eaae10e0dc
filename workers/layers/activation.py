"""SiLU-and-mul: the gated activation of the Llama MLP."""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    """x = [gate ; up] -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2 * I] -> [T, I]
        return silu_and_mul(x)
