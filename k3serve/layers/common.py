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


def kernel_matrix(w: torch.Tensor | None, kernels) -> torch.Tensor | None:
    """A projection weight [N, K] in the form the compiled blocks read fastest: panels of 16
    rows where the build takes them (kernels/cpu/core/panels.h; fp32: 2.5-6x a row-major GEMV at a
    decode's few rows, bf16 with AVX512-BF16: 1.3-1.7x), else w itself. A copy: the modules
    build it once, in their cached block arguments (reset by use_kernels, after the last load
    or move)."""
    return w if kernels is None or w is None or w.numel() == 0 else kernels.panel_form(w)


EXPERT_PANEL_BYTES = 1 << 20  # an expert matrix's fp32 form up to this stays in cache


def kernel_experts(w, kernels, fp32_model: bool) -> list:
    """One routed-expert matrix (layers/expert_weights.py) as moe_experts takes it: [packed codes,
    E8M0 scales] or [dense, None]; an fp32 model's experts whose fp32 form is at most 1 MB a
    matrix as fp32 panels [E, O/16, I, 16] and None (kernels/cpu/core/panels.h expert_panel_form, the
    MXFP4 values exactly: a 4-bit value times a power of two). Cache-resident experts are
    compute bound, and there decoding a 4-bit row for each token it meets cost more than the
    dot (the bundled demo's 5-row verify: ~70 of ~345 us); larger ones stream from memory, where
    the packed bytes are the point. A copy: built once, in the modules' cached block arguments."""
    E, O, I = w.shape
    if kernels is not None and fp32_model and E * O * I * 4 <= EXPERT_PANEL_BYTES:
        value = w.value
        dense = value.dequantize(torch.float32) if w.is_packed else value.float()
        panels = kernels.expert_panel_form(dense.contiguous())
        if panels.dim() == 4:
            return [panels, None]
    return [w.packed, w.scale] if w.is_packed else [w.value.contiguous(), None]


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
        return self.backend.rms_norm(self, x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
