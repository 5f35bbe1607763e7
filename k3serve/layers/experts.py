"""Routed experts: stacked weights, either packed MXFP4 (K3) / NVFP4, or plain (Kimi-Linear).

`experts_forward` sorts tokens by expert and runs each *selected* expert once on all its
tokens, dequantizing only that expert's MXFP4 weights at use (spec §8.3: compute on the
stored codes; no re-encoding). `experts_reference` is the plain per-token loop the tests
compare against. W4A8 mode rounds expert inputs through MXFP8 (spec §1.3).
"""

from __future__ import annotations

from typing import Callable

import torch

from k3serve.layers.gemm import dense
from k3serve.weights.mxfp4 import PackedMXFP4, decode_mxfp4
from k3serve.weights.mxfp8 import fake_quantize_mxfp8
from k3serve.weights.nvfp4 import PackedNVFP4, decode_nvfp4

ExpertWeight = torch.Tensor | PackedMXFP4 | PackedNVFP4  # [E, out, in]
PACKED = (PackedMXFP4, PackedNVFP4)
Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mxfp4_linear(x: torch.Tensor, w: PackedMXFP4) -> torch.Tensor:
    """x [T, in] @ W^T for one packed matrix [out, in]: LUT-decode codes straight into x's dtype."""
    return dense(x, decode_mxfp4(w.packed, w.scale, x.dtype))


def expert_weights(w: ExpertWeight, experts: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Weights of the selected experts only, one [out, in] matrix each in `dtype`. Dense experts
    are views of the stacked buffer (no copy: gathering them was ~40% of a bf16 decode step);
    packed FP4 is decoded in one pass for all of them (one call per layer and matrix)."""
    if isinstance(w, PackedNVFP4):
        idx = torch.tensor(experts, dtype=torch.long, device=w.packed.device)
        return list(decode_nvfp4(w.packed[idx], w.scale[idx], w.tables()[idx], dtype))
    if isinstance(w, PackedMXFP4):
        idx = torch.tensor(experts, dtype=torch.long, device=w.packed.device)
        return list(decode_mxfp4(w.packed[idx], w.scale[idx], dtype))
    return [w[e].to(dtype) for e in experts]


def _one_expert(x, w1, w2, w3, act: Act, a8: bool) -> torch.Tensor:
    """x [T, in]; w1/w3 [inter, in], w2 [out, inter] already decoded."""
    if a8:
        x = fake_quantize_mxfp8(x)
    h = act(dense(x, w1), dense(x, w3))
    if a8:
        h = fake_quantize_mxfp8(h)
    return dense(h, w2)


def experts_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    act: Act,
    a8: bool = False,
    kernels=None,
) -> torch.Tensor:
    """x [N, h], ids/weights [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x), FP32 [N, h_out].

    With `kernels` (k3serve.kernels) and packed CPU experts, the three matmuls run as grouped
    MXFP4 / NVFP4 kernels on the packed bytes; otherwise each selected expert runs once in torch."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // ids.shape[1]  # token of each sorted assignment
    if kernels is not None and isinstance(w1, PACKED) and x.device.type == "cpu":
        return _experts_grouped(x, flat, order, token, weights, w1, w2, w3, act, a8, kernels)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    out_dim = w2.shape[1]
    out = torch.zeros(x.shape[0], out_dim, dtype=torch.float32, device=x.device)
    used = [e for e, n in enumerate(counts) if n]  # only selected experts are ever dequantized
    W1, W2, W3 = (expert_weights(w, used, x.dtype) for w in (w1, w2, w3))
    pos = 0
    for j, e in enumerate(used):
        n = counts[e]
        sel = order[pos : pos + n]
        y = _one_expert(x[token[pos : pos + n]], W1[j], W2[j], W3[j], act, a8)
        out.index_add_(0, token[pos : pos + n], y.float() * weights.reshape(-1)[sel, None])
        pos += n
    return out


def _grouped_matmul(kernels, x, offsets, w):
    """kernels/cpu: x [M, K] fp32 rows sorted by expert @ W_e^T on the packed bytes -> [M, O] fp32."""
    if isinstance(w, PackedNVFP4):
        return kernels.nvfp4_grouped_matmul(x, offsets, w.packed, w.scale, w.tables())
    return kernels.mxfp4_grouped_matmul(x, offsets, w.packed, w.scale)


def _experts_grouped(x, flat, order, token, weights, w1, w2, w3, act: Act, a8: bool, kernels) -> torch.Tensor:
    """Three grouped kernel calls per layer instead of a Python loop over experts; FP32 inside.
    x [N, h]; assignments sorted by expert; offsets [E + 1] delimit each expert's rows."""
    counts = torch.bincount(flat, minlength=w1.shape[0])
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    xs = x[token].float()  # [N*k, h], one row per (token, expert) pair
    if a8:
        xs = fake_quantize_mxfp8(xs)
    g = _grouped_matmul(kernels, xs, offsets, w1)
    u = _grouped_matmul(kernels, xs, offsets, w3)
    h = act(g, u)
    if a8:
        h = fake_quantize_mxfp8(h)
    y = _grouped_matmul(kernels, h.contiguous(), offsets, w2)  # [N*k, out], sorted by expert
    per = torch.empty_like(y)  # back in (token, slot) order, then each token's k slots summed in
    per[order] = y * weights.reshape(-1)[order, None]  # slot order (batch invariant; index_add_ cost
    return per.view(x.shape[0], -1, y.shape[1]).sum(1)  # ~0.5 ms a call at one token)


def experts_reference(x, ids, weights, w1, w2, w3, act: Act, a8: bool = False) -> torch.Tensor:
    """Plain loop over tokens and their selected experts, dequantize-then-matmul in FP32."""

    def deq(w, e):
        return w.select(e).dequantize(torch.float32) if isinstance(w, PACKED) else w[e].float()

    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xt = fake_quantize_mxfp8(x[t : t + 1]) if a8 else x[t : t + 1]
            h = act(xt.float() @ deq(w1, e).t(), xt.float() @ deq(w3, e).t())
            if a8:
                h = fake_quantize_mxfp8(h)
            out[t] += weights[t, j] * (h @ deq(w2, e).t())[0]
    return out
