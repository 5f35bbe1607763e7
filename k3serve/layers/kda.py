"""Kimi Delta Attention layer (k3-model-spec.md §3; HF-REF `KimiDeltaAttention`).

x [N, d] (normed) -> q/k/v proj [N, P] -> short conv (state) + SiLU -> per-head l2norm,
q * D^-1/2 -> beta = sigmoid(b_proj x) -> decay g (K3: lb * sigmoid(exp(A_log) z); Kimi-Linear:
-exp(A_log) softplus(z), z = f_b(f_a x) + dt_bias) -> gated delta rule (chunked for prefill,
one batched recurrent step for decodes) -> RMSNorm_D(o) * sigmoid(gate) -> o_proj.
States live in `CacheTensors` rows chosen by the batch's state slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config.model_config import ModelConfig
from k3serve.parallel.group import NO_TP, TPGroup
from k3serve.layers.backend import TORCH
from k3serve.layers.common import WeightOnly, linear
from k3serve.layers.kda_ops import flush_denormals, kda_chunked, kda_step
from k3serve.layers.norm import gated_rms_norm, l2_normalize
from k3serve.layers.short_conv import short_conv, short_conv_step
from k3serve.forward import CacheTensors, ForwardBatch


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = NO_TP):
        super().__init__()
        k, d = cfg.kda, cfg.hidden_size
        # under tensor parallelism this rank holds heads H/N (every per-channel tensor follows
        # its heads; f_a / g_a and o_norm are shared by all heads, so replicated); o_proj then
        # gives a partial sum the decoder layer all-reduces
        heads = tp.split(k.num_heads, "linear_attn_config.num_heads")
        self.layer_idx, self.heads, self.head_dim = layer_idx, heads, k.head_dim
        self.lower_bound, self.eps = k.gate_lower_bound, cfg.rms_norm_eps
        P = heads * k.head_dim
        self.q_proj, self.k_proj, self.v_proj = linear(P, d), linear(P, d), linear(P, d)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (WeightOnly(P, 1, k.conv_kernel) for _ in range(3))
        self.f_a_proj, self.f_b_proj = linear(k.head_dim, d), linear(P, k.head_dim)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.b_proj = linear(heads, d)
        if k.use_full_rank_gate:
            self.g_proj = linear(P, d)
        else:
            self.g_a_proj, self.g_b_proj = linear(k.head_dim, d), linear(P, k.head_dim)
        self.o_norm = WeightOnly(k.head_dim)
        self.o_proj = linear(d, P)
        self.backend = TORCH  # how forward runs (k3serve/backends), chosen once by use_kernels

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        return self.backend.kda_layer(self, x, batch, cache)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> u = q|k|v before the conv [N, 3P], z = f_b(f_a x) [N, P] (decay logits before
        dt_bias), b [N, H] (beta logits), gate [N, P]; all fp32."""
        u = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), -1).float()
        z = self.f_b_proj(self.f_a_proj(x)).float()
        b = self.b_proj(x).float()
        gate = (self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))).float()
        return u, z, b, gate

    def reference(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """The torch path (every backend's reference): batched recurrent decodes, verify passes
        recording per-position states, chunked prefill."""
        N = x.shape[0]
        u, z, b, gate = self.projections(x)
        conv_w = self.conv_weight()  # [3P, K]
        o = torch.empty(N, self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        beta, g = torch.sigmoid(b), self.decay(z).view(N, self.heads, self.head_dim)
        rec, conv = cache.recurrent[self.layer_idx], cache.conv[self.layer_idx]
        with flush_denormals():
            if batch.verify:
                self._verify(u, conv_w, g, beta, batch, cache, o)
            self._run(batch.step.decodes, u, conv_w, g, beta, batch, rec, conv, o)
        return self.o_proj(self.gated_norm(o, gate).to(x.dtype))

    def conv_weight(self) -> torch.Tensor:
        return torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight), 0).squeeze(1).float()

    def _verify(self, u, conv_w, g, beta, batch, cache, o) -> None:
        """Speculating sequences (last token + drafts): consecutive batched recurrent steps, the
        decode arithmetic, recording the state after every position for rollback (spec_decode/rollback.py)."""
        rec, conv = cache.recurrent[self.layer_idx], cache.conv[self.layer_idx]
        bounds, idx = batch.seq_bounds(), batch.verify
        lens = [batch.seq_lens[i] for i in idx]
        T = max(lens)
        rec_buf = torch.empty(len(idx), T, *rec.shape[1:], device=rec.device)
        conv_buf = torch.empty(len(idx), T, *conv.shape[1:], device=conv.device)
        for t in range(T):
            act = [j for j in range(len(idx)) if lens[j] > t]
            rows = batch.index(("verify rows", t), [bounds[idx[j]][0] + t for j in act])
            slots = batch.index(("verify slots", t), [batch.state_slots[idx[j]] for j in act])
            at = batch.index(("verify seqs", t), act)
            c, conv[slots] = short_conv_step(u[rows], conv_w, conv[slots])
            q, k, v = self.qkv(c)
            o[rows], new = kda_step(q, k, v, g[rows], beta[rows], rec[slots].float())
            rec[slots] = new.to(rec.dtype)  # a bf16 pool (--mamba-ssm-cache-dtype) rounds here
            rec_buf[at, t], conv_buf[at, t] = rec[slots].float(), conv[slots]
        batch.keep_kda_records(self.layer_idx, (rec_buf, conv_buf))

    def _run(self, decodes, u, conv_w, g, beta, batch, rec, conv, o) -> None:
        bounds = batch.seq_bounds()
        if decodes:
            self._decode(decodes, bounds, u, conv_w, g, beta, batch, rec, conv, o)
        for i, (s, e) in enumerate(bounds):
            if i in decodes or s == e or i in batch.verify:
                continue
            slot = batch.state_slots[i]
            fresh = batch.context_lens[i] == 0  # a new sequence starts from zero state
            c0 = torch.zeros_like(conv[slot]) if fresh else conv[slot]
            s0 = rec.new_zeros(rec.shape[1:], dtype=torch.float32) if fresh else rec[slot].float()
            c, conv[slot] = short_conv(u[s:e], conv_w, c0)
            q, k, v = self.qkv(c)
            o[s:e], rec[slot] = kda_chunked(q, k, v, g[s:e], beta[s:e], s0)

    def _decode(self, idx, bounds, u, conv_w, g, beta, batch, rec, conv, o) -> None:
        """All single-token decodes of the batch in one vectorized recurrent step."""
        rows = batch.index(("decode rows", tuple(idx)), [bounds[i][0] for i in idx])
        slots = batch.index(("decode slots", tuple(idx)), [batch.state_slots[i] for i in idx])
        c, conv[slots] = short_conv_step(u[rows], conv_w, conv[slots])
        q, k, v = self.qkv(c)
        o[rows], new = kda_step(q, k, v, g[rows], beta[rows], rec[slots].float())
        rec[slots] = new.to(rec.dtype)  # a bf16 pool (--mamba-ssm-cache-dtype) rounds here

    def qkv(self, c: torch.Tensor):
        """Post-conv [T, 3P] -> q (l2norm, * D^-1/2), k (l2norm), v, each [T, H, D]."""
        q, k, v = c.view(c.shape[0], 3, self.heads, self.head_dim).unbind(1)
        return l2_normalize(q) * self.head_dim**-0.5, l2_normalize(k), v

    def decay(self, z: torch.Tensor) -> torch.Tensor:
        """Log decay g [N, P] (<= 0), FP32, from z = f_b(f_a x) [N, P]."""
        z = z + self.dt_bias.float()
        a = self.A_log.float().exp().repeat_interleave(self.head_dim)  # per channel
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(a * z)
        return -a * F.softplus(z)

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm_D(o) * sigmoid(gate): o [N, H, D], gate [N, P] fp32 -> [N, P] fp32."""
        return gated_rms_norm(o, gate, self.o_norm.weight.float(), self.eps)
