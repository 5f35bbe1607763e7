"""Short-convolution update with state indices, in Triton: KDA's causal depthwise conv (kernel
KW, SiLU after) for B sequences of T new positions each, reading and writing each sequence's
window [KW-1, C] in the state pool through `slots`. Reference: layers/short_conv.py
`short_conv_step` applied T times.

The positions of sequence b form X = window rows (KW-1) ++ its T inputs, so output t is
silu(sum_j w[:, j] * X[t + j]) and the window after t is X[t+1 : t+KW]: each row is read from
the pool or from u by its index, no register shifting. Out is written split into q | k | v
planes ([3, N, P], contiguous each, what fla's kernel reads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _x_row(state, u, i, c, m, KW: tl.constexpr, C):
    """Row i of X (window rows, then inputs) at channels c [BC]."""
    ii = tl.zeros_like(c) + i
    from_state = ii < KW - 1
    a = tl.load(state + ii * C + c, mask=m & from_state, other=0.0).to(tl.float32)
    b = tl.load(u + (ii - (KW - 1)) * C + c, mask=m & (ii >= KW - 1), other=0.0).to(tl.float32)
    return a + b


@triton.jit
def _short_conv_kernel(
    u_ptr,
    w_ptr,
    pool_ptr,
    slots_ptr,
    last_ptr,
    out_ptr,
    rec_ptr,
    N,
    T,
    C,
    P,
    KW: tl.constexpr,
    BC: tl.constexpr,
    HAS_LAST: tl.constexpr,
    RECORD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = c < C
    state = pool_ptr + tl.load(slots_ptr + b).to(tl.int64) * (KW - 1) * C
    u = u_ptr + b * T * C
    plane, p = c // P, c % P  # out is [3, N, P]: q | k | v planes
    for t in range(T):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(KW):
            w = tl.load(w_ptr + c * KW + j, mask=m, other=0.0).to(tl.float32)
            acc += w * _x_row(state, u, t + j, c, m, KW, C)
        y = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(out_ptr + plane * N * P + (b * T + t) * P + p, y, mask=m)
        if RECORD:  # the window after position t: rec [B, T, KW-1, C]
            for j in tl.static_range(KW - 1):
                tl.store(
                    rec_ptr + ((b * T + t) * (KW - 1) + j) * C + c, _x_row(state, u, t + 1 + j, c, m, KW, C), mask=m
                )
    last = 0
    if HAS_LAST:
        last = tl.load(last_ptr + b).to(tl.int64)
    # the window after the last live position, in place; ascending rows: row j reads X[last+1+j],
    # an index above j, so nothing read here was overwritten yet
    for j in tl.static_range(KW - 1):
        row = _x_row(state, u, last + 1 + j, c, m, KW, C)
        tl.store(state + j * C + c, row.to(state.dtype.element_ty), mask=m)


def short_conv_update(
    u: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    last: torch.Tensor | None = None,
    record: bool = False,
):
    """u [B*T, C] (sequence-major), weight [C, KW], pool [S, KW-1, C] updated in place at `slots`
    [B] with the window after each sequence's `last` [B] position (default 0, a decode).
    -> (out [3, B*T, C/3] fp32 after SiLU, rec [B, T, KW-1, C] fp32 when `record`, else None)."""
    N, C = u.shape
    B, KW = slots.shape[0], weight.shape[1]
    T = N // B
    out = torch.empty(3, N, C // 3, dtype=torch.float32, device=u.device)
    rec = torch.empty(B, T, KW - 1, C, dtype=torch.float32, device=u.device) if record else out
    BC = min(triton.next_power_of_2(C), 256)
    _short_conv_kernel[(B, triton.cdiv(C, BC))](
        u.contiguous(),
        weight.contiguous(),
        pool,
        slots,
        last if last is not None else slots,
        out,
        rec,
        N,
        T,
        C,
        C // 3,
        KW=KW,
        BC=BC,
        HAS_LAST=last is not None,
        RECORD=record,
    )
    return out, (rec if record else None)
