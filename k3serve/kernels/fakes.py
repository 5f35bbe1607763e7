"""Fake (meta) implementations of the CPU kernel ops (kernels/cpu/registry.cpp): output shapes
and dtypes without computing, so FakeTensorMode and torch.compile see each op as one node. Each
mirrors its kernel's output allocation; tests/model/test_kernel_ops.py runs torch.library.opcheck
on every op as a real decode and verify step calls it, which compares fake and real outputs."""

from __future__ import annotations

import torch

PANEL = 16  # kernels/cpu/core/common.h kPanel


def _out_features(w: torch.Tensor) -> int:
    return w.shape[0] * PANEL if w.dim() >= 3 else w.shape[0]  # panel forms [N/16, K, 16] / [N/16, K/2, 16, 2]


def register(namespace: str) -> None:
    """Register every op's fake under `namespace` (once per process and namespace)."""
    lib = f"{namespace}::"

    def fake(name):
        return torch.library.register_fake(lib + name)

    @fake("rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @fake("linear")
    def _(x, w):
        return x.new_empty(x.shape[0], _out_features(w))

    @fake("glu")
    def _(gate, up, act, beta, linear_beta):
        return torch.empty_like(gate)

    @fake("attnres_mix")
    def _(candidates, w, eps):
        return torch.empty_like(candidates[0])

    @fake("mxfp4_grouped_matmul")
    def _(x, offsets, packed, scale):
        return x.new_empty(x.shape[0], packed.shape[1])

    @fake("nvfp4_grouped_matmul")
    def _(x, offsets, packed, scale, table):
        return x.new_empty(x.shape[0], packed.shape[1])

    @fake("kda_decode")
    def _(u, conv_w, z, b, gate, dt_bias, a_log, o_norm_w, conv_state, rec_state, slots, starts, lower_bound, eps,
          rec_buf=None, conv_buf=None):  # fmt: skip
        return u.new_empty(u.shape[0], u.shape[1] // 3, dtype=torch.float32)

    @fake("kda_rollback")
    def _(live_rec, live_conv, rec_bufs, conv_bufs, slots, accepted):
        return None

    @fake("mla_decode")
    def _(q, nope, cache, w_kv_b, table, seq, pos, block, scale):
        return q.new_empty(q.shape[0], q.shape[1], w_kv_b.shape[1] - nope, dtype=torch.float32)

    @fake("moe_route")
    def _(x, weight, bias, topk, use_sigmoid, renorm, scaling, groups, keep):
        n = x.shape[0]
        return x.new_empty(n, topk, dtype=torch.int64), x.new_empty(n, topk, dtype=torch.float32)

    @fake("moe_experts")
    def _(z, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, act, beta, linear_beta, round_bf16_steps):
        out = w2.shape[1] * PANEL if w2.dim() == 4 else w2.shape[1]  # fp32 expert panels [E, O/16, I, 16]
        return z.new_empty(z.shape[0], out, dtype=torch.float32)

    @fake("kda_block")
    def _(x, *args, **kwargs):
        return torch.empty_like(x)

    @fake("mla_block")
    def _(x, *args, **kwargs):
        return torch.empty_like(x)

    @fake("moe_block")
    def _(x, *args, **kwargs):
        return torch.empty_like(x)

    @fake("dspark_forward")
    def _(taps, last, w, heads, mask_id, eps):
        return taps.new_empty(taps.shape[0], w[3].shape[0] - 1, w[2].shape[0], dtype=torch.float32)

    @fake("dspark_greedy")
    def _(block, last, u, wt, k):
        return block.new_empty(block.shape[0], block.shape[1], dtype=torch.int64)

    @fake("dspark_draft")
    def _(taps, last, w, heads, mask_id, eps, u, wt, k):
        return taps.new_empty(taps.shape[0], w[3].shape[0] - 1, dtype=torch.int64)
