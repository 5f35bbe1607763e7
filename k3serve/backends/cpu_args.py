"""What the compiled CPU blocks take from a layer besides its weights: the scalar arguments of
the GLU and MoE blocks (in registry.cpp's order) and the rows at which dense experts leave the
block for torch's GEMM. *How* a layer runs, so it lives with the backend, not in layers/."""

from __future__ import annotations

# Past this many rows, dense (bf16 / fp32) experts of at least DENSE_GEMM_ELEMS weights per
# matrix run as one torch matmul per selected expert (oneDNN's GEMM) instead of the compiled
# block's per-row dots. 400 M Kimi-Linear (512 x 1024 experts), 7 MoE layers, 2 cores: 32 rows
# 38 vs 48 ms, 64 rows 70 vs 55 ms, 256 rows 238 vs 88 ms (a prefill: 4x). Small experts stay
# compiled: tiny Kimi-Linear's (32 x 64) 512-token prefill takes 13-14 ms so, 17 ms through torch.
DENSE_KERNEL_ROWS = 48
DENSE_GEMM_ELEMS = 1 << 16


def big_experts(moe) -> bool:
    """A LatentMoE's routed experts are big enough for torch's GEMM past DENSE_KERNEL_ROWS rows."""
    return moe.w1.shape[1] * moe.w1.shape[2] >= DENSE_GEMM_ELEMS


def glu_scalars(mlp) -> tuple[list[int], list[float]]:
    """A GLU's (dense layer, shared experts) ints {situ}, floats {beta, linear_beta}."""
    beta, linear_beta = mlp.situ or (0.0, 0.0)
    return [int(mlp.situ is not None)], [beta, linear_beta]


def moe_scalars(moe) -> tuple[list[int], list[float]]:
    """A LatentMoE's ints {top_k, sigmoid, renormalize, groups, topk_group, situ}, floats
    {scaling, beta, linear_beta, eps}."""
    m = moe.cfg
    beta, linear_beta = moe.situ or (0.0, 0.0)
    ints = [
        m.top_k,
        int(m.router_activation == "sigmoid"),
        int(m.renormalize),
        m.num_expert_group,
        m.topk_group,
        int(moe.situ is not None),
    ]
    return ints, [m.routed_scaling_factor, beta, linear_beta, moe.eps]
