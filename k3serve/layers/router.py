"""MoE router (k3-model-spec.md §5.2; HF-REF `KimiMoEGate`): FP32 sigmoid scores, bias-corrected
selection (noaux_tc), grouped top-k, unbiased renormalised weights, routed scaling factor."""

from __future__ import annotations

import torch

from k3serve.config.model_config import MoEConfig


def route_scalars(cfg: MoEConfig) -> tuple[int, bool, bool, float, int, int]:
    """The router's settings in the one order every compiled route op takes them after x, weight
    and bias (kernels/cpu/registry.cpp moe_route, backends/graph_ops.py moe_route): top_k,
    sigmoid, renormalize, scaling, groups, topk_group."""
    return (
        cfg.top_k,
        cfg.router_activation == "sigmoid",
        cfg.renormalize,
        cfg.routed_scaling_factor,
        cfg.num_expert_group,
        cfg.topk_group,
    )


def route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cfg: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] -> (expert ids [N, k] int64, weights [N, k] fp32)."""
    logits = x.float() @ weight.float().t()  # [N, E]
    scores = torch.sigmoid(logits) if cfg.router_activation == "sigmoid" else torch.softmax(logits, -1)
    choice = scores + bias.float()
    if cfg.num_expert_group > 1:
        choice = _group_filter(choice, cfg.num_expert_group, cfg.topk_group)
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=True).indices
    w = scores.gather(-1, ids)  # unbiased scores of the chosen experts
    if cfg.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


def _group_filter(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """DeepSeek rule: group score = sum of its top-2; experts outside the top `keep` groups -> -inf."""
    N, E = choice.shape
    g = choice.view(N, groups, E // groups)
    group_scores = g.topk(min(2, E // groups), dim=-1).values.sum(-1)  # [N, groups]
    top = group_scores.topk(keep, dim=-1).indices
    mask = torch.zeros(N, groups, dtype=torch.bool, device=choice.device).scatter_(1, top, True)
    return g.masked_fill(~mask[..., None], -torch.inf).view(N, E)
