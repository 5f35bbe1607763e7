"""MoE experts in Triton: the (token, expert) assignments aligned on the device into
fixed-capacity blocks of one expert each, then one grouped GEMM per projection that reads
MXFP4 experts packed (E2M1 nibbles and E8M0 scales decoded in registers: no bf16 copy of an
expert is ever made), NVFP4 ones likewise (E4M3 scale bytes per 16 through a per-expert factor
table), or dense ones, with SwiGLU/SiTU between. Reference: layers/experts.py
`experts_reference`, and the graph backend's `moe_experts` body.

Shapes: N tokens, k experts each, M = N * k assignments; E experts; `in` -> I (w1 gate, w3 up)
-> out (w2). Packed: w [E, rows, cols / 2] uint8 (low nibble = even column), s [E, rows,
cols / 32] uint8. Capacity CAP = M + min(E, M) * (BM - 1) rounded to BM rows: every chosen
expert's group padded to whole BM blocks fits, whatever the routing, so all shapes are fixed by N.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

BM = 16  # rows of a block (tl.dot's minimum)


def align(ids: torch.Tensor, num_experts: int, bm: int = BM):
    """ids [N, k] -> (row_token [CAP] token of each block row or -1, row_assign [CAP] flat
    assignment or -1, block_expert [CAP / bm] expert of each block or -1 past the last one).
    Fixed-shape torch on the device: scatter_add counts, a stable sort, searchsorted."""
    flat = ids.reshape(-1)
    M, k = flat.shape[0], ids.shape[1]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(M, device=ids.device) - (counts.cumsum(0) - counts)[sorted_e]
    dest = (ends - padded)[sorted_e] + rank  # [M] row of each sorted assignment
    # at most min(E, M) groups are non-empty, each padded by < bm rows (vLLM's moe_align bound)
    cap = (M + min(num_experts, M) * (bm - 1) + bm - 1) // bm * bm
    row_assign = torch.full((cap,), -1, dtype=torch.int64, device=ids.device).scatter_(0, dest, order)
    row_token = torch.where(row_assign >= 0, row_assign // k, -1)
    starts = torch.arange(0, cap, bm, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    return row_token, row_assign, torch.where(block_expert < num_experts, block_expert, -1)


@triton.jit
def _e2m1(code):
    """E2M1 code (0..15, int32) -> float32: sign bit 3, exponent bits 2..1, mantissa bit 0."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _mx_tile(w_ptr, s_ptr, t_ptr, e, n, nm, j, jm, sw_e, sw_r, ss_e, ss_r, NV: tl.constexpr):
    """Packed FP4 weight columns 2j (low nibbles) and 2j + 1 (high) of rows n of expert e,
    decoded in registers -> two [BN, BK / 2] fp32 tiles. MXFP4: an E8M0 scale per 32 columns
    (16 bytes); NVFP4 (NV): an E4M3 byte per 16 columns (8 bytes) read through the expert's
    group-factor table t [E, 256] = e4m3(b) / global (weights/nvfp4.py)."""
    mask = nm[:, None] & jm[None, :]
    byte = tl.load(w_ptr + e * sw_e + n[:, None] * sw_r + j[None, :], mask=mask, other=0).to(tl.int32)
    if NV:
        s = tl.load(s_ptr + e * ss_e + n[:, None] * ss_r + (j // 8)[None, :], mask=mask, other=0).to(tl.int32)
        scale = tl.load(t_ptr + e * 256 + s)
    else:
        s = tl.load(s_ptr + e * ss_e + n[:, None] * ss_r + (j // 16)[None, :], mask=mask, other=127)
        scale = tl.exp2(s.to(tl.float32) - 127.0)
    return _e2m1(byte & 15) * scale, _e2m1(byte >> 4) * scale


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def _grouped_kernel(
    x_ptr,
    x_rows_ptr,
    out_ptr,
    out_rows_ptr,
    block_expert_ptr,
    wa_ptr,
    sa_ptr,
    wb_ptr,
    sb_ptr,
    ta_ptr,
    tb_ptr,
    K,
    NOUT,
    x_stride,
    out_stride,
    sw_e,
    sw_r,
    ss_e,
    ss_r,
    beta,
    linear_beta,
    PACKED: tl.constexpr,
    NV: tl.constexpr,
    GLU: tl.constexpr,
    SITU: tl.constexpr,
    LINEAR_TANH: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One block of BM rows (one expert) x BN output columns: out[out_rows] = x[x_rows] @ Wa[e]^T,
    or act(x @ Wa[e]^T, x @ Wb[e]^T) with GLU. Rows with x_rows < 0 (padding) are skipped."""
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    if e >= 0:
        rows = blk * BM + tl.arange(0, BM)
        xr = tl.load(x_rows_ptr + rows)
        rm = xr >= 0
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < NOUT
        acc_a = tl.zeros([BM, BN], tl.float32)
        acc_b = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            if PACKED:
                j = k0 // 2 + tl.arange(0, BK // 2)
                jm = j < K // 2
                xm = rm[:, None] & jm[None, :]
                xe = tl.load(x_ptr + xr[:, None] * x_stride + 2 * j[None, :], mask=xm, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + xr[:, None] * x_stride + 2 * j[None, :] + 1, mask=xm, other=0.0).to(tl.float32)
                lo, hi = _mx_tile(wa_ptr, sa_ptr, ta_ptr, e, n, nm, j, jm, sw_e, sw_r, ss_e, ss_r, NV)
                acc_a += tl.dot(xe, tl.trans(lo), input_precision="ieee") + tl.dot(
                    xo, tl.trans(hi), input_precision="ieee"
                )
                if GLU:
                    lo, hi = _mx_tile(wb_ptr, sb_ptr, tb_ptr, e, n, nm, j, jm, sw_e, sw_r, ss_e, ss_r, NV)
                    acc_b += tl.dot(xe, tl.trans(lo), input_precision="ieee") + tl.dot(
                        xo, tl.trans(hi), input_precision="ieee"
                    )
            else:
                kk = k0 + tl.arange(0, BK)
                km = kk < K
                x = tl.load(x_ptr + xr[:, None] * x_stride + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(
                    tl.float32
                )
                woff = e * sw_e + n[:, None] * sw_r + kk[None, :]
                wmask = nm[:, None] & km[None, :]
                acc_a += tl.dot(
                    x, tl.trans(tl.load(wa_ptr + woff, mask=wmask, other=0.0).to(tl.float32)), input_precision="ieee"
                )
                if GLU:
                    acc_b += tl.dot(
                        x,
                        tl.trans(tl.load(wb_ptr + woff, mask=wmask, other=0.0).to(tl.float32)),
                        input_precision="ieee",
                    )
        if ROUND_BF16:  # the reference's GEMM outputs are in the model dtype before the activation
            acc_a = acc_a.to(tl.bfloat16).to(tl.float32)
            acc_b = acc_b.to(tl.bfloat16).to(tl.float32)
        y = acc_a
        if GLU:
            if SITU:  # beta * tanh(g / beta) * sigmoid(g) * [linear_beta * tanh(u / linear_beta)]
                act = beta * _tanh(acc_a / beta) * _sigmoid(acc_a)
                lin = acc_b
                if LINEAR_TANH:
                    lin = linear_beta * _tanh(acc_b / linear_beta)
                y = act * lin
            else:
                y = acc_a * _sigmoid(acc_a) * acc_b
        orow = tl.load(out_rows_ptr + rows)
        tl.store(
            out_ptr + orow[:, None] * out_stride + n[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=rm[:, None] & nm[None, :],
        )


def _grouped(x, x_rows, out, out_rows, block_expert, wa, sa, wb, sb, glu, situ, beta, linear_beta, ta=None, tb=None):
    """Launch over every block x output tile; wa/wb [E, NOUT, K or K/2], sa/sb their scales,
    ta/tb their NVFP4 group-factor tables [E, 256] (None: MXFP4 or dense)."""
    packed = sa is not None
    nv = ta is not None
    nout = wa.shape[1]
    K = wa.shape[2] * (2 if packed else 1)
    BN = min(64, max(16, triton.next_power_of_2(nout)))
    BK = min(128, max(32, triton.next_power_of_2(K)))
    ss = sa.stride() if packed else (0, 0, 0)
    _grouped_kernel[(block_expert.shape[0], triton.cdiv(nout, BN))](
        x,
        x_rows,
        out,
        out_rows,
        block_expert,
        wa,
        sa if packed else wa,
        wb if glu else wa,
        (sb if packed else wa) if glu else wa,
        ta if nv else wa,
        (tb if nv and glu else ta) if nv else wa,
        K,
        nout,
        x.stride(0),
        out.stride(0),
        wa.stride(0),
        wa.stride(1),
        ss[0],
        ss[1],
        float(beta),
        float(linear_beta or 0.0),
        PACKED=packed,
        NV=nv,
        GLU=glu,
        SITU=situ,
        LINEAR_TANH=linear_beta is not None,
        ROUND_BF16=x.dtype == torch.bfloat16,
        BM=BM,
        BN=BN,
        BK=BK,
    )


def moe_experts(
    z: Tensor,
    ids: Tensor,
    weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor,
    s1: Optional[Tensor],
    s2: Optional[Tensor],
    s3: Optional[Tensor],
    situ: bool,
    beta: float,
    linear_beta: Optional[float],
    a8: bool = False,
    tables: Optional[Tensor] = None,
) -> Tensor:
    """Routed sum: z [N, in] (model dtype), ids [N, k] local expert ids, weights [N, k] ->
    FP32 [N, out]. w* dense [E, rows, cols] or packed MXFP4 with scales s* (see the module), or
    packed NVFP4 with E4M3 scale bytes s* and `tables`, w1's, w2's and w3's group factors [3, E, 256]."""
    from k3serve.weights.mxfp8 import fake_quantize_mxfp8

    linear_beta = linear_beta or None  # 0.0 stands for none (the layers' `situ` pair)
    N, k = ids.shape
    E, I = w1.shape[0], w1.shape[1]
    row_token, row_assign, block_expert = align(ids, E)
    cap = row_token.shape[0]
    x = (fake_quantize_mxfp8(z) if a8 else z).contiguous()
    h = (torch.zeros if a8 else torch.empty)(cap, I, dtype=z.dtype, device=z.device)
    every = torch.arange(cap, device=z.device)
    t1, t2, t3 = tables.unbind(0) if tables is not None else (None, None, None)
    _grouped(x, row_token, h, every, block_expert, w1, s1, w3, s3, True, situ, beta, linear_beta, t1, t3)
    if a8:
        h = fake_quantize_mxfp8(h)
    y = torch.empty(N * k, w2.shape[1], dtype=z.dtype, device=z.device)  # one row per assignment
    _grouped(
        h,
        torch.where(row_assign >= 0, every, -1),
        y,
        row_assign,
        block_expert,
        w2,
        s2,
        None,
        None,
        False,
        situ,
        beta,
        linear_beta,
        t2,
    )
    return (y.view(N, k, -1).float() * weights.float().unsqueeze(-1)).sum(1)
