"""The block kernels' weights by name (kernels/cpu/packs.h): one frozen dataclass per block,
its fields the op schema's weight arguments in their order (kernels/cpu/registry.cpp;
tests/model/test_kernel_ops.py checks the two agree). Built once per layer by the `cpp` backend
(backends/cpu.py); `args` is what the op takes after its input rows and, as a list, what the
decode stack's add_layer takes for the layer (absent weights None in both). `kernel_matrix` and
`kernel_experts` turn a layer's weights into the forms the packs hold."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch


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


class _Pack:
    @cached_property
    def args(self) -> tuple:
        """The weights in schema order (None where absent), built once: a block call spreads them."""
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class KdaPack(_Pack):
    """A KDA attention block: projections in kernel form (kernel_matrix),
    g_proj the full gate or the low-rank gate's first half (g_b_proj its second), conv taps
    [P, 1, K], dt_bias [P], a_log [H], o_norm [D]."""

    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    f_a_proj: torch.Tensor
    f_b_proj: torch.Tensor
    b_proj: torch.Tensor
    g_proj: torch.Tensor
    g_b_proj: torch.Tensor | None
    o_proj: torch.Tensor
    q_conv: torch.Tensor
    k_conv: torch.Tensor
    v_conv: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    o_norm: torch.Tensor


@dataclass(frozen=True)
class MlaPack(_Pack):
    """A gated-MLA attention block: q_a_proj is q_proj without a q LoRA (q_a_norm and q_b_proj
    then None); kv_b_proj as the checkpoint holds it; g_proj None without the output gate."""

    q_a_proj: torch.Tensor
    q_a_norm: torch.Tensor | None
    q_b_proj: torch.Tensor | None
    kv_a_proj: torch.Tensor
    kv_a_norm: torch.Tensor
    kv_b_proj: torch.Tensor
    g_proj: torch.Tensor | None
    o_proj: torch.Tensor


@dataclass(frozen=True)
class MoePack(_Pack):
    """A MoE block: router, the latent MoE's down / norm / up (None for Kimi-Linear), routed
    experts with their E8M0 scales (None when dense or fp32 panels: layers/common.py
    kernel_experts), shared experts (None without)."""

    gate: torch.Tensor
    score_bias: torch.Tensor
    latent_down: torch.Tensor | None
    latent_norm: torch.Tensor | None
    latent_up: torch.Tensor | None
    w1: torch.Tensor
    w1_scale: torch.Tensor | None
    w3: torch.Tensor
    w3_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    shared_gate: torch.Tensor | None
    shared_up: torch.Tensor | None
    shared_down: torch.Tensor | None


@dataclass(frozen=True)
class GluPack(_Pack):
    """A GLU MLP (dense layers, shared experts): gate, up, down in kernel form."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


# pack -> the op whose schema names its fields (GLU runs as linear / glu / linear: no op of its own)
PACK_OPS = {KdaPack: "kda_block", MlaPack: "mla_block", MoePack: "moe_block"}
