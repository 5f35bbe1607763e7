"""Block Attention Residuals (k3-model-spec.md §6; ATTNRES Eq. 8-10; HF-REF `_apply_attn_res`).

Mix(v_0..v_n; w): score_i = sum_k RMSnorm(v_i)_k w_k (no weight in the norm, eps = rms_norm_eps),
p = softmax_i(score), out = sum_i p_i v_i -- all FP32, mixing the raw values, cast back.
w = norm.weight * proj.weight[0] (the two checkpoint tensors are only used as a product).
Depth-wise per token: nothing is cached across positions.
"""

from __future__ import annotations

import torch


def attnres_mix(candidates: list[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
    """candidates: n tensors [N, d] -> [N, d] in the candidates' dtype; w [d]."""
    v = torch.stack([c.float() for c in candidates], 0)  # [n, N, d]
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax(normed @ w.float(), dim=0)  # [n, N]
    return (p.unsqueeze(-1) * v).sum(0).to(candidates[0].dtype)


def attnres_vector(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """Fused score vector [d] from `*_res_norm.weight` [d] and `*_res_proj.weight` [1, d]."""
    return norm_weight.float() * proj_weight.float()[0]
