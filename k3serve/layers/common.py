"""Small module helpers so parameter names match checkpoint names exactly."""

from __future__ import annotations

import torch
from torch import nn

from k3serve.layers.backend import TORCH
from k3serve.layers.gemm import Linear
from k3serve.layers.norm import rms_norm


def linear(out_features: int, in_features: int) -> nn.Linear:
    """Bias-free linear; weight [out, in] as in the checkpoint (gemm.Linear: bf16 prefill GEMMs
    in FP32 where the CPU has no bf16 dot instructions)."""
    return Linear(in_features, out_features, bias=False)


class WeightOnly(nn.Module):
    """A module whose only parameter is `weight` (norms, conv taps, AttnRes vectors)."""

    def __init__(self, *shape: int, fill: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, fill))


class RMSNorm(WeightOnly):
    def __init__(self, size: int, eps: float):
        super().__init__(size)
        self.eps = eps
        self.backend = TORCH  # how forward runs (k3serve/backends), chosen once by use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
