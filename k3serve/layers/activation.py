"""GLU activations: SiTU-GLU (K3, spec §5.4) and SwiGLU (Kimi-Linear), computed in FP32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def situ_and_mul(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    """[beta*tanh(g/beta)*sigmoid(g)] * [linear_beta*tanh(u/linear_beta)], cast back."""
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    lin = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (act * lin).to(gate.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
