"""Gated MLA's attention over a latent cache sharded by token (decode context parallelism:
parallel/dcp.py says which rank holds which position; issue 62 item 2).

The absorbed form (layers/mla.py `attend_absorbed`) split by keys: softmax over all keys is the
merge of softmaxes over disjoint key sets weighted by their log-sum-exp (flash-decoding's
split-K, vLLM's `cp_lse_ag_out_rs`). Per MLA layer and step, over the N ranks of the group:

  1. each rank's heads in the latent space, q_abs = q_nope W_UK | q_pe [T, H/N, c + r],
     all-gathered: every head's [T, H, c + r] on every rank;
  2. each rank writes the new rows it holds and attends every head over its rows:
     mixed_r [T, H, c] (softmax over its keys, times their latents), lse_r [T, H];
  3. lse all-gathered [T, N, H]: G = logsumexp over ranks, w_r = exp(lse_r - G); the weighted
     mixed_r reduce-scattered by head: each rank gets its own heads' merged [H/N, T, c];

then W_UV for its heads, as `attend_absorbed` ends. Every query attends in the absorbed form
(prefill chunks too: the decompressed K/V of `attend_fused` would need every row on every rank).
"""

from __future__ import annotations

import torch

from k3serve.forward.cache import from_cache, to_cache


def partial_attention(q_abs, q_pe, latent, k_pe, key_pos, query_pos, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention over some of a sequence's keys. q_abs [T, H, c], q_pe [T, H, r];
    latent [L, c], k_pe [L, r] at positions key_pos [L]; query t at query_pos[t] sees the keys
    at or before it. Returns (mixed [T, H, c]: softmax over the visible keys times their
    latents, 0 where none is visible; lse [T, H]: their log-sum-exp, -inf where none)."""
    scores = (torch.einsum("thc,lc->thl", q_abs, latent) + torch.einsum("thr,lr->thl", q_pe, k_pe)) * scale
    visible = key_pos[None, :] <= query_pos[:, None]  # [T, L]
    scores = scores.masked_fill(~visible[:, None, :], -torch.inf)
    lse = torch.logsumexp(scores, -1)  # [T, H]
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # exp(-inf) = 0: no key, no weight
    return torch.einsum("thl,lc->thc", p, latent), lse


def merge(mixed: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The single-process reference of step 3: mixed [N, T, H, c], lse [N, T, H] of N disjoint
    key sets -> the softmax over all of them times their latents [T, H, c]."""
    return (mixed * torch.exp(lse - torch.logsumexp(lse, 0))[..., None]).sum(0)


def attend_dcp(layer, q, latent, batch, store, out, kv_scale, group, layout) -> None:
    """`GatedMLA.attend_rest` under DCP for every sequence of the step: q [T, H/N, n + r] fp32
    (this rank's heads), latent [T, c + r] (the step's new rows, every position; this rank
    writes those it holds into `store`, its local rows), out [T, H/N, v] filled in place."""
    m, N = layer.cfg, group.size
    c, n = m.kv_lora_rank, m.qk_nope_head_dim
    T, heads = q.shape[0], m.num_heads
    w_kv_b = layer.kv_b_proj.weight.float().view(heads, -1, c)
    q_abs = torch.einsum("thn,hnc->thc", q[..., :n], w_kv_b[:, :n])  # [T, H/N, c]
    every = group.all_gather(torch.cat((q_abs, q[..., n:]), -1).reshape(T, -1)).view(
        T, N * heads, -1
    )  # rank = head order
    mixed = torch.zeros(T, N * heads, c, dtype=torch.float32, device=q.device)
    lse = torch.full((T, N * heads), -torch.inf, dtype=torch.float32, device=q.device)
    for i, (s, e) in enumerate(batch.seq_bounds()):
        if s == e:
            continue
        ctx = batch.context_lens[i]
        pos, rows = batch.dcp_rows(i, layout, group.rank)  # [L'] positions this rank holds, their rows
        new = pos >= ctx
        store[rows[new]] = to_cache(latent[s:e][pos[new] - ctx], store.dtype, kv_scale)
        seq = from_cache(store[rows], kv_scale)  # [L', c + r]
        query_pos = torch.arange(ctx, ctx + e - s, device=q.device)
        mixed[s:e], lse[s:e] = partial_attention(
            every[s:e, :, :c], every[s:e, :, c:], seq[:, :c], seq[:, c:], pos, query_pos, layer.scale
        )
    ranks = group.all_gather(lse).view(T, N, N * heads)  # every rank's lse
    weight = torch.exp(lse - torch.logsumexp(ranks, 1))  # [T, H]; position 0 is on some rank: finite
    mine = group.reduce_scatter((mixed * weight[..., None]).transpose(0, 1).contiguous())  # [H/N, T, c]
    out.copy_(torch.einsum("htc,hvc->thv", mine, w_kv_b[:, n:]))
