"""Depthwise causal short convolution with a carried window (k3-model-spec.md §3.2).

c_t = SiLU(sum_j w[:, j] * u_{t-K+1+j}); tap K-1 multiplies the current token; u_{<0} = 0
at a sequence start. The state is the last K-1 *pre-conv* inputs, so prefill-then-decode
equals one longer prefill exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(u: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """u [T, C] (fp32), weight [C, K], state [K-1, C] -> (SiLU(conv) [T, C], new state [K-1, C])."""
    k = weight.shape[-1]
    x = torch.cat((state, u), dim=0)  # [T+K-1, C]
    windows = x.unfold(0, k, 1)  # [T, C, K]
    out = (windows * weight).sum(-1)
    return F.silu(out), x[x.shape[0] - (k - 1) :].clone()


def short_conv_step(u: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched single-token decode: u [B, C], state [B, K-1, C] -> ([B, C], [B, K-1, C])."""
    x = torch.cat((state, u.unsqueeze(1)), dim=1)  # [B, K, C]
    out = (x * weight.t().unsqueeze(0)).sum(1)
    return F.silu(out), x[:, 1:].clone()
