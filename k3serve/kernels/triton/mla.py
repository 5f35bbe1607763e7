"""Paged MLA decode in Triton: absorbed queries against the latent cache rows [c_n | k_pe]
(576 wide at K3's shapes, one row per position), found through the block table, split-KV with a
fixed grid per batch bucket. Reference: layers/mla.py `attend_absorbed_batched` (the `graph`
backend's mla_decode body).

Shapes: N query rows (B sequences of T rows each: decode T = 1, verify 1 + k); H heads;
c = kv_lora_rank, r = rope dim; store [rows, c + r]; table [B, W] blocks of `block_size` rows.
A row n attends positions < lens[n] of sequence n // T (causal within a verify block, since its
rows' lens grow by one). Program (n, split, head block) runs an online softmax over its slice
of the context and writes a partial (normalized output, log-sum-exp); `combine` merges splits.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from k3serve.forward.cache import write_rows


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """layers/norm.py's RMSNorm (FP32 variance, weight after the cast back), here so that the
    kernels import no layer; tests/kernels/test_triton_mla.py holds the op to the graph body."""
    x32 = x.float()
    return weight.to(x.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@triton.jit
def _mla_split_kernel(
    q_ptr,
    qpe_ptr,
    store_ptr,
    table_ptr,
    lens_ptr,
    part_ptr,
    lse_ptr,
    H,
    C,
    R,
    W,
    T,
    row_stride,
    chunk,
    scale,
    BLOCK_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    BH: tl.constexpr,
    BC: tl.constexpr,
    BR: tl.constexpr,
    BL: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    h = tl.program_id(2) * BH + tl.arange(0, BH)
    c, r, l = tl.arange(0, BC), tl.arange(0, BR), tl.arange(0, BL)
    hm, cm, rm = h < H, c < C, r < R
    q = tl.load(q_ptr + (n * H + h[:, None]) * C + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
    qpe = tl.load(qpe_ptr + (n * H + h[:, None]) * R + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
    seq = n // T
    length = tl.load(lens_ptr + n)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BC], tl.float32)
    for p0 in range(start, end, BL):
        p = p0 + l
        pm = p < end
        block = tl.load(table_ptr + seq * W + p // BLOCK_SIZE, mask=pm, other=0)
        rows = block * BLOCK_SIZE + p % BLOCK_SIZE
        kv = tl.load(store_ptr + rows[:, None] * row_stride + c[None, :], mask=pm[:, None] & cm[None, :], other=0.0).to(
            tl.float32
        )
        kpe = tl.load(
            store_ptr + rows[:, None] * row_stride + C + r[None, :], mask=pm[:, None] & rm[None, :], other=0.0
        ).to(tl.float32)
        s = tl.dot(q, tl.trans(kv), input_precision="ieee") + tl.dot(qpe, tl.trans(kpe), input_precision="ieee")
        s = tl.where(pm[None, :], s * scale, float("-inf"))  # [BH, BL]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        e = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(e, 1)
        acc = acc * alpha[:, None] + tl.dot(e, kv, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    base = (n * SPLITS + split) * H + h
    tl.store(part_ptr + base[:, None] * C + c[None, :], out, mask=hm[:, None] & cm[None, :])
    tl.store(lse_ptr + base, lse, mask=hm)


def paged_attention(q_lat, q_pe, store, table, lens, block_size: int, scale: float, splits: int = 4):
    """q_lat [N, H, c], q_pe [N, H, r] fp32; store [rows, c + r]; table [B, W]; lens [N]
    -> the attention-weighted latent [N, H, c] fp32 (before W_UV)."""
    N, H, C = q_lat.shape
    R = q_pe.shape[2]
    B, W = table.shape
    L = W * block_size
    BL = 16
    chunk = triton.cdiv(triton.cdiv(L, splits), BL) * BL  # a split's positions, whole BL tiles
    BH = min(max(16, triton.next_power_of_2(H)), 32)
    part = torch.empty(N, splits, H, C, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(N, splits, H, dtype=torch.float32, device=q_lat.device)
    _mla_split_kernel[(N, splits, triton.cdiv(H, BH))](
        q_lat.contiguous(),
        q_pe.contiguous(),
        store,
        table,
        lens,
        part,
        lse,
        H,
        C,
        R,
        W,
        N // B,
        store.stride(0),
        chunk,
        scale,
        BLOCK_SIZE=block_size,
        SPLITS=splits,
        BH=BH,
        BC=max(16, triton.next_power_of_2(C)),
        BR=max(16, triton.next_power_of_2(R)),
        BL=BL,
    )
    # merge splits: weights exp(lse_s - max); an empty split has lse -inf and weight 0
    w = torch.softmax(lse, dim=1)  # [N, S, H]
    return (part * w.unsqueeze(-1)).sum(1)


def mla_decode(
    q: Tensor,
    ckv: Tensor,
    kv_norm: Tensor,
    store: Tensor,
    cache_rows: Tensor,
    table: Tensor,
    lens: Tensor,
    kv_b: Tensor,
    nope: int,
    v_dim: int,
    scale: float,
    eps: float,
    block_size: int,
    kv_scale: Optional[Tensor] = None,
) -> Tensor:
    """The graph backend's `mla_decode` with the kernel inside: q [N, H, nope + r] fp32; ckv
    [N, c + r] (latent before its norm | k_pe); store written at cache_rows [N] in place; table
    [B, W]; lens [N]; kv_b [H, nope + v, c] fp32; kv_scale: the fp8 cache's 0-d scale or None
    (attention is linear in the rows: the queries and the mix take it, the kernel reads raw
    rows). -> [N, H, v] fp32."""
    c = kv_norm.shape[0]
    latent = torch.cat((rms_norm(ckv[:, :c], kv_norm, eps), ckv[:, c:]), -1)
    write_rows(store, cache_rows, latent, kv_scale)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    q_lat = torch.einsum("nhd,hdc->nhc", q[..., :nope], w_uk)
    q_pe = q[..., nope:]
    if kv_scale is not None:
        q_lat, q_pe = q_lat * kv_scale, q_pe * kv_scale
    mixed = paged_attention(q_lat, q_pe, store, table, lens, block_size, scale)
    if kv_scale is not None:
        mixed = mixed * kv_scale
    return torch.einsum("nhc,hvc->nhv", mixed, w_uv).contiguous()
