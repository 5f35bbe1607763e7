"""RMSNorm as HF-REF computes it: variance in FP32, weight applied after casting back (spec §11)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] -> same dtype; weight [n]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * x32.to(x.dtype)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output gate: RMSNorm_D(o) * sigmoid(gate). o [N, H, D] fp32, gate [N, H * D], weight
    [D] fp32 -> [N, H * D] fp32. (The Triton KDA op keeps a copy: kernels/ sit below layers/.)"""
    N, H, D = o.shape
    return (rms_norm(o, weight, eps) * torch.sigmoid(gate.view(N, H, D))).reshape(N, H * D)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the sqrt, FLA's convention)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
