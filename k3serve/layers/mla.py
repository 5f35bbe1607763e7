"""Gated MLA, NoPE (k3-model-spec.md §4; HF-REF `KimiMLAAttention`, LCPP absorbed form).

Per token: q = q_b(RMSNorm(q_a x)) or q_proj x -> [H, nope | rope]; kv_a x -> latent c | k_pe;
c_n = RMSNorm(c). The cache holds [c_n | k_pe] (576 values/token/layer for K3). Keys are
[W_UK c_n ; k_pe], values W_UV c_n, scale 1/sqrt(nope + rope), causal; K3 then multiplies
by sigmoid(g_proj x) before o_proj. No rotary embedding anywhere.

Two attention algorithms over the same cache: `attend_absorbed` (W_UK folded into q, scores
against the latent, W_UV applied after mixing; used for decode) and `attend_naive`
(decompress K/V; used for prefill and as the reference).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config.model_config import ModelConfig
from k3serve.parallel.group import NO_TP, TPGroup
from k3serve.layers.backend import TORCH
from k3serve.layers.common import RMSNorm, linear
from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.forward.cache import from_cache, to_cache
from k3serve.layers.mla_dcp import attend_dcp
from k3serve.parallel.dcp import layout_of

MLA_NORM_EPS = 1e-6  # HF-REF KimiRMSNorm default for q_a/kv_a layernorms


def attend_naive(q_nope, q_pe, latent, k_pe, w_kv_b, v_dim, start, scale):
    """q_nope [T,H,n], q_pe [T,H,r], latent [L,c], k_pe [L,r], w_kv_b [H, n+v, c]; queries sit at
    positions start..start+T-1 of the L cached ones. Returns [T, H, v]."""
    kv = torch.einsum("lc,hdc->lhd", latent, w_kv_b)  # [L, H, n+v]
    k_nope, v = kv[..., :-v_dim], kv[..., -v_dim:]
    scores = torch.einsum("thn,lhn->htl", q_nope, k_nope) + torch.einsum("thr,lr->htl", q_pe, k_pe)
    p = _causal_softmax(scores * scale, start)
    return torch.einsum("htl,lhv->thv", p, v)


def attend_fused(q_nope, q_pe, latent, k_pe, w_kv_b, v_dim, start, scale):
    """`attend_naive` through torch's fused attention (scaled_dot_product_attention: on CPU a
    flash kernel, no [H, T, L] score tensor, no separate mask and softmax passes); the prefill
    path. Same contract; summation order differs (tests/model/test_layers.py compares the two).
    Torch takes its flash kernel only for 4-D inputs whose q/k and v head dims are equal, so the
    narrower side is zero-padded (zero columns add nothing to a dot product and give zero
    outputs, cut off): tiny K3's 512-token layer 3.9 -> 0.9 ms, 400 M 11 -> 4.9 ms."""
    kv = torch.einsum("lc,hdc->lhd", latent, w_kv_b)  # [L, H, n+v]
    k_nope, v = kv[..., :-v_dim], kv[..., -v_dim:]
    H, T, L = q_nope.shape[1], q_nope.shape[0], latent.shape[0]
    q = torch.cat((q_nope, q_pe), -1).transpose(0, 1)  # [H, T, n+r]
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, H, -1)), -1).transpose(0, 1)  # [H, L, n+r]
    v = v.transpose(0, 1)  # [H, L, v]
    width = max(q.shape[-1], v_dim)
    q, k, v = (F.pad(x, (0, width - x.shape[-1]))[None] for x in (q, k, v))  # [1, H, *, width]
    mask = None
    if not (start == 0 and T == L):  # query t (position start + t) sees keys 0..start+t
        mask = torch.arange(L, device=q.device)[None, :] <= (start + torch.arange(T, device=q.device))[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o[0, ..., :v_dim].transpose(0, 1)  # [T, H, v]


def attend_absorbed(q_nope, q_pe, latent, k_pe, w_kv_b, v_dim, start, scale):
    """Same contract as `attend_naive`, computed in the latent space (no K/V decompression)."""
    w_uk, w_uv = w_kv_b[:, :-v_dim], w_kv_b[:, -v_dim:]  # [H, n, c], [H, v, c]
    q_abs = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, c]
    scores = torch.einsum("thc,lc->htl", q_abs, latent) + torch.einsum("thr,lr->htl", q_pe, k_pe)
    p = _causal_softmax(scores * scale, start)
    mixed = torch.einsum("htl,lc->thc", p, latent)  # [T, H, c]
    return torch.einsum("thc,hvc->thv", mixed, w_uv)


def attend_absorbed_batched(q_nope, q_pe, latent, k_pe, lens, w_kv_b, v_dim, scale):
    """Decode form of `attend_absorbed` for B sequences at once, one query each (the newest
    position). q_nope [B,H,n], q_pe [B,H,r]; latent [B,L,c], k_pe [B,L,r] padded to the longest
    sequence; lens [B] valid rows per sequence. Returns [B, H, v]."""
    w_uk, w_uv = w_kv_b[:, :-v_dim], w_kv_b[:, -v_dim:]
    q_abs = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    scores = torch.einsum("bhc,blc->bhl", q_abs, latent) + torch.einsum("bhr,blr->bhl", q_pe, k_pe)
    valid = torch.arange(latent.shape[1], device=latent.device)[None, :] < lens[:, None]  # [B, L]
    p = torch.softmax((scores * scale).masked_fill(~valid[:, None, :], -torch.inf), dim=-1)
    mixed = torch.einsum("bhl,blc->bhc", p, latent)
    return torch.einsum("bhc,hvc->bhv", mixed, w_uv)


def _causal_softmax(scores: torch.Tensor, start: int) -> torch.Tensor:
    """scores [H, T, L]; query t (absolute position start+t) sees keys 0..start+t."""
    T, L = scores.shape[1:]
    allowed = torch.arange(L, device=scores.device)[None, :] <= (start + torch.arange(T, device=scores.device))[:, None]
    return torch.softmax(scores.float().masked_fill(~allowed, -torch.inf), dim=-1)


class GatedMLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = NO_TP):
        super().__init__()
        m, d = cfg.mla, cfg.hidden_size
        # under tensor parallelism: heads H/N (q_b, kv_b, g_proj rows; o_proj columns); the latent
        # projection and its norm are replicated, so every rank caches the whole 576-value latent,
        # as the absorbed form needs; o_proj gives a partial sum the decoder layer all-reduces
        m = replace(m, num_heads=tp.split(m.num_heads, "num_attention_heads"))
        self.layer_idx, self.cfg = layer_idx, m
        self.scale = m.qk_head_dim**-0.5
        if m.q_lora_rank is not None:
            self.q_a_proj = linear(m.q_lora_rank, d)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = linear(m.num_heads * m.qk_head_dim, m.q_lora_rank)
        else:
            self.q_proj = linear(m.num_heads * m.qk_head_dim, d)
        self.kv_a_proj_with_mqa = linear(m.cache_dim, d)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = linear(m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        if m.use_output_gate:
            self.g_proj = linear(m.num_heads * m.v_head_dim, d)
        self.o_proj = linear(d, m.num_heads * m.v_head_dim)
        self.backend = TORCH  # how forward runs (k3serve/backends), chosen once by use_kernels
        # decode context parallelism: the latent cache sharded by token over the TP ranks, each
        # attending over its rows (layers/mla_dcp.py); None: every rank caches every row
        self.dcp = tp if tp.dcp > 1 else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        return self.backend.mla_layer(self, x, batch, cache)

    def reference(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """The torch path (every backend's reference)."""
        m = self.cfg
        q, latent = self.project(x)
        out = torch.empty(x.shape[0], m.num_heads, m.v_head_dim, dtype=torch.float32, device=x.device)
        s = cache.observe(self.layer_idx, latent)
        if self.dcp is not None:
            layout = layout_of(self.dcp, batch.block_size)
            store = cache.latent[self.layer_idx]
            attend_dcp(self, q, latent, batch, store, out, s, self.dcp.context_group, layout)
        else:
            self.attend_rest(q, latent, batch, cache.latent[self.layer_idx], out, done=set(), kv_scale=s)
        return self.output(out, x)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> q [N, H, nope + rope] fp32, latent [N, c + r] = [c_n | k_pe] as cached."""
        m, N = self.cfg, x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank is not None else self.q_proj(x)
        q = q.view(N, m.num_heads, m.qk_head_dim).float()
        ckv = self.kv_a_proj_with_mqa(x)
        return q, torch.cat((self.kv_a_layernorm(ckv[:, : m.kv_lora_rank]), ckv[:, m.kv_lora_rank :]), -1)

    def attend_rest(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        batch: ForwardBatch,
        store: torch.Tensor,
        out: torch.Tensor,
        done: set[int],
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Write the latent rows and attend for every sequence not in `done` (those a backend ran
        itself): decodes batched (absorbed), verify passes absorbed per position, prefill chunks
        through torch's fused attention. out [N, H, v] fp32 is filled in place; kv_scale: the
        fp8 cache's scale (forward/cache.py)."""
        m = self.cfg
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        w_kv_b = (
            self.kv_b_proj.weight.float().view(m.num_heads, -1, m.kv_lora_rank) if len(done) < batch.num_seqs else None
        )
        decodes = [i for i in batch.step.decodes if i not in done]
        if len(decodes) > 1:
            self._decode_batched(decodes, q_nope, q_pe, latent, w_kv_b, batch, store, out, kv_scale)
            done = done | set(decodes)
        for i, (s, e) in enumerate(batch.seq_bounds()):
            if i in done or s == e:
                continue
            ctx = batch.context_lens[i]
            store[batch.cache_rows(i, ctx, ctx + e - s)] = to_cache(latent[s:e], store.dtype, kv_scale)
            seq = from_cache(store[batch.cache_rows(i, 0, ctx + e - s)], kv_scale)  # [L, c + r]
            # verify passes use the decode algorithm for every drafted position (same arithmetic as
            # non-speculative decoding, so greedy outputs agree)
            attend = attend_absorbed if e - s == 1 or i in batch.verify else attend_fused
            out[s:e] = attend(
                q_nope[s:e],
                q_pe[s:e],
                seq[:, : m.kv_lora_rank],
                seq[:, m.kv_lora_rank :],
                w_kv_b,
                m.v_head_dim,
                ctx,
                self.scale,
            )

    def output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention output [N, H, v] fp32 -> gate (K3) -> o_proj [N, d]."""
        out = out.reshape(x.shape[0], -1)
        if self.cfg.use_output_gate:
            out = out * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(out.to(x.dtype))

    def _decode_batched(self, idx, q_nope, q_pe, latent, w_kv_b, batch, store, out, kv_scale=None) -> None:
        """All single-token decodes: write their rows, gather each sequence's rows padded to the
        longest, one batched absorbed attention."""
        m = self.cfg
        bounds = batch.seq_bounds()
        starts = [bounds[i][0] for i in idx]
        lens = [batch.context_lens[i] + 1 for i in idx]
        rows = batch.padded_rows(idx, lens)  # [B, Lmax]
        lens_t = batch.index(("decode lens", tuple(idx)), lens)
        new = rows.gather(1, (lens_t - 1).unsqueeze(1)).squeeze(1)  # each sequence's new row
        at = batch.index(("decode starts", tuple(idx)), starts)
        store[new] = to_cache(latent[at], store.dtype, kv_scale)
        seq = from_cache(store[rows], kv_scale)  # [B, Lmax, c + r]
        out[at] = attend_absorbed_batched(
            q_nope[at],
            q_pe[at],
            seq[..., : m.kv_lora_rank],
            seq[..., m.kv_lora_rank :],
            lens_t,
            w_kv_b,
            m.v_head_dim,
            self.scale,
        )
