"""Gated delta rule with per-channel decay (KDA core): chunked prefill + recurrent step.

Math: k3-model-spec.md §3.5 (recurrence) and §3.7 (chunked WY form); FLA `fla/ops/kda/naive.py`
is the external reference the tests compare against. Per head, state S [D_k, D_v] (FP32):
    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
Inputs are already normalised and scaled (q = l2norm(q) / sqrt(D), k = l2norm(k)).
The chunked form never factors exp(G_i - G_j) into exp(G_i) * exp(-G_j): with the K3 lower
bound g >= -5, G reaches -320 inside a 64-chunk and exp(320) overflows FP32.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

CHUNK = 64


@contextmanager
def flush_denormals() -> Iterator[None]:
    """FTZ/DAZ for the KDA math only: long products of decays produce FP32 denormals, which
    make CPU arithmetic 10-50x slower (the chunk solve went from 5 ms to 120 ms) while being
    < 1.2e-38. Scoped because other code (MXFP4 scales down to 2^-127) needs denormals.
    PyTorch has no getter, so the flag is restored to its default (off)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def kda_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch. q,k,g [B,H,Dk], v [B,H,Dv], beta [B,H], state [B,H,Dk,Dv]."""
    s = state * g.exp().unsqueeze(-1)  # decay key rows
    pred = torch.einsum("bhk,bhkv->bhv", k, s)  # S^T k
    s = s + torch.einsum("bhk,bhv->bhkv", beta.unsqueeze(-1) * k, v - pred)
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: token-by-token. q,k,g [T,H,Dk], v [T,H,Dv], beta [T,H], state [H,Dk,Dv]."""
    outs, s = [], state.unsqueeze(0)
    for t in range(q.shape[0]):
        o, s = kda_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        outs.append(o)
    return torch.cat(outs, 0), s[0]


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked-parallel prefill (WY form), same contract as `kda_recurrent`.

    A ragged tail is padded with k = v = 0, g = 0, beta = 0: padded steps neither decay nor
    write the state, so the result is exact for any length.
    """
    T = q.shape[0]
    pad = (-T) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = q.shape[0] // chunk
    # [T, H, D] -> [H, n, C, D]
    q, k, v, g = (x.reshape(n, chunk, *x.shape[1:]).permute(2, 0, 1, 3) for x in (q, k, v, g))
    beta = beta.reshape(n, chunk, -1).permute(2, 0, 1)  # [H, n, C]
    # Gamma: cumulative log decay inside each chunk, in FP64: with strong decay Gamma reaches
    # -1e3..-1e4 and FP32 differences of such sums would lose ~1e-4 relative accuracy.
    gam = g.double().cumsum(-2)
    outs, s = [], state
    step = max(1, _MAX_INTRA_ELEMS // (q.shape[0] * chunk * (chunk + 4 * q.shape[-1])))
    for c0 in range(0, n, step):  # intra-chunk terms for a group of chunks at once
        sl = slice(c0, min(n, c0 + step))
        w, u, qk, qg = _intra_chunk(q[:, sl], k[:, sl], v[:, sl], gam[:, sl], beta[:, sl])
        for c in range(w.shape[1]):  # the only sequential part: the state hand-off
            v_new = u[:, c] - w[:, c] @ s  # pseudo-values V' = U - W S
            outs.append(qg[:, c] @ s + qk[:, c] @ v_new)
            g_last = gam[:, c0 + c, -1:]  # [H, 1, Dk]
            s = (
                _exp(g_last, s.dtype).transpose(1, 2) * s
                + (_exp(g_last - gam[:, c0 + c], s.dtype) * k[:, c0 + c]).transpose(1, 2) @ v_new
            )
    o = torch.stack(outs, 1).reshape(q.shape[0], n * chunk, -1).transpose(0, 1)  # [T+pad, H, Dv]
    return o[:T], s


_MAX_INTRA_ELEMS = 1 << 24  # bounds the [H, chunks, C, C] and [H, chunks, C, Dk] intra-chunk tensors


def _intra_chunk(q, k, v, gam, beta):
    """State-independent WY terms. q,k,gam [H,n,C,Dk], v [H,n,C,Dv], beta [H,n,C].

    Returns W = T (exp(G) * K), U = T V, masked A_qk (diagonal kept) and Q * exp(G), where
    T = (I + L)^-1 Diag(beta), L_ij = beta_i sum_k k_ik exp(G_ik - G_jk) k_jk for j < i.
    """
    C = q.shape[2]
    kk, qk = _decayed_dots(k, q, gam)
    lower = beta.unsqueeze(-1) * kk.tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(lower)
    t = torch.linalg.solve_triangular(eye + lower, torch.diag_embed(beta), upper=False, unitriangular=True)
    eg = _exp(gam, q.dtype)
    return t @ (eg * k), t @ v, qk.tril(), q * eg


def _decayed_dots(k, q, gam):
    """kk_ij = sum_d k_id e^(G_id - G_jd) k_jd and qk_ij (the same with q_i), for j <= i; above
    the diagonal both are 0. k, q [H, n, C, D], gam [H, n, C, D] (FP64 cumulative log decays).

    By bisection of the chunk: every pair j < i is first split at one level of halving, into a
    row block [m, m + b) and the column block [m - b, m) just before it, and is factored there
    through the reference position m: e^(G_i - G_m) <= 1 for i >= m and e^(G_m - G_j) <= 1 for
    j < m (G never increases), so neither factor can overflow whatever the decay, and one that
    underflows belongs to a product below 1e-38 anyway. Each level is one batched matmul over
    all its blocks; the diagonal is e^0 = 1.
    """
    H, n, C, D = k.shape
    if C & (C - 1):  # a chunk that is not a power of two: pad to one, crop the result
        pad = (1 << C.bit_length()) - C
        k, q = F.pad(k, (0, 0, 0, pad)), F.pad(q, (0, 0, 0, pad))
        gam = torch.cat([gam, gam[:, :, -1:].expand(H, n, pad, D)], 2)
        kk, qk = _decayed_dots(k, q, gam)
        return kk[:, :, :C, :C], qk[:, :, :C, :C]
    k, q = k.contiguous(), q.contiguous()  # reshaped once per level below
    kk = k.new_zeros(H, n, C, C)
    qk = k.new_zeros(H, n, C, C)
    b = C // 2
    while b >= 1:
        pairs = C // (2 * b)  # [column block, row block] pairs at this level
        g = gam.reshape(H, n, pairs, 2, b, D)
        ref = g[:, :, :, 1, :1]  # G_m: the first row of each row block, [H, n, P, 1, D]
        left = _exp(g[:, :, :, 1] - ref, k.dtype)  # [H, n, P, b, D]
        right = k.reshape(H, n, pairs, 2, b, D)[:, :, :, 0] * _exp(ref - g[:, :, :, 0], k.dtype)
        rows = slice(b, 2 * b)
        for x, out in ((k, kk), (q, qk)):
            xr = x.reshape(H, n, pairs, 2, b, D)[:, :, :, 1]
            block = (xr * left) @ right.transpose(-1, -2)  # [H, n, P, b(i), b(j)]
            # the P blocks sit on the diagonal of a [P, 2b] x [P, 2b] grid of `out`
            grid = out.view(H, n, pairs, 2 * b, pairs, 2 * b)
            torch.diagonal(grid, dim1=2, dim2=4)[:, :, rows, :b] = block.permute(0, 1, 3, 4, 2)
        b //= 2
    idx = torch.arange(C, device=k.device)
    kk[:, :, idx, idx] = (k * k).sum(-1)
    qk[:, :, idx, idx] = (q * k).sum(-1)
    return kk, qk


def _exp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of FP64 log-decays into `dtype`, flushing results below FP32's normal range to 0.

    Denormal FP32 operands make CPU arithmetic ~50x slower (measured: the triangular solve
    went from 2 ms to 120 ms); values under 1e-38 are negligible next to the O(1) terms
    they are summed with.
    """
    # The FP64 difference is formed first (that is where FP32 would lose digits of large sums);
    # once formed it rounds to `dtype` with a relative error of 2^-24, so e^x in FP32 is off by
    # under 2^-24 |x| + 1 ulp: <= 6e-8 for |x| <= 1, 5e-6 only for terms below e^-80. In FP32 and
    # without a [x]-sized fill + where, the chunk solve's exps took 55 ms of a 126 ms layer (400 M).
    y = x.to(dtype)
    if y is x:  # already `dtype` (a float64 run): never write into the caller's tensor
        y = y.clone()
    return y.masked_fill_(y < _FLUSH, -torch.inf).exp_()


_FLUSH = -87.0  # e^-87 ~ 1.6e-38, FP32's smallest normal is 1.2e-38
