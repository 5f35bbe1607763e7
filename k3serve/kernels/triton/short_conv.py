"""Short-convolution update with state indices, in Triton: KDA's causal depthwise conv (kernel
KW, SiLU after) for B sequences of T new positions each, reading each sequence's window [KW-1, C]
from the state pool at its first slot and writing the window after every position t to its slot
t (`slots` [B, T]: a decode's T = 1 updates the slot in place; a verify pass's row of slots is
cache/draft_slots.py's, so rollback picks a slot and copies nothing). Reference:
layers/short_conv.py `short_conv_step` applied T times.

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
    out_ptr,
    N,
    T,
    C,
    P,
    KW: tl.constexpr,
    BC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = c < C
    state = pool_ptr + tl.load(slots_ptr + b * T).to(tl.int64) * (KW - 1) * C  # the window it starts from
    u = u_ptr + b * T * C
    plane, p = c // P, c % P  # out is [3, N, P]: q | k | v planes
    for t in range(T):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(KW):
            w = tl.load(w_ptr + c * KW + j, mask=m, other=0.0).to(tl.float32)
            acc += w * _x_row(state, u, t + j, c, m, KW, C)
        y = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(out_ptr + plane * N * P + (b * T + t) * P + p, y, mask=m)
        if t > 0:  # the window after position t, into slot t (never the starting slot, still read)
            dst = pool_ptr + tl.load(slots_ptr + b * T + t).to(tl.int64) * (KW - 1) * C
            for j in tl.static_range(KW - 1):
                row = _x_row(state, u, t + 1 + j, c, m, KW, C)
                tl.store(dst + j * C + c, row.to(dst.dtype.element_ty), mask=m)
    # the window after position 0, over the starting slot last; ascending rows: row j reads
    # X[1+j], an index above j, so nothing read here was overwritten yet
    for j in tl.static_range(KW - 1):
        row = _x_row(state, u, 1 + j, c, m, KW, C)
        tl.store(state + j * C + c, row.to(state.dtype.element_ty), mask=m)


def short_conv_update(u: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """u [B*T, C] (sequence-major), weight [C, KW], pool [S, KW-1, C]; slots [B] (a decode, T = 1)
    or [B, T]: each sequence starts from the window at its first slot, the window after position t
    goes to its slot t. -> out [3, B*T, C/3] fp32 after SiLU."""
    N, C = u.shape
    B, KW = slots.shape[0], weight.shape[1]
    T = N // B
    if slots.numel() != N:
        raise ValueError(f"short_conv_update: {N} rows take {N} slots (B x T), got {tuple(slots.shape)}")
    out = torch.empty(3, N, C // 3, dtype=torch.float32, device=u.device)
    BC = min(triton.next_power_of_2(C), 256)
    _short_conv_kernel[(B, triton.cdiv(C, BC))](
        u.contiguous(), weight.contiguous(), pool, slots.contiguous(), out, N, T, C, C // 3, KW=KW, BC=BC
    )
    return out


@triton.jit
def _short_conv_varlen_kernel(
    u_ptr, w_ptr, pool_ptr, slots_ptr, cu_ptr, out_ptr, C, KW: tl.constexpr, BC: tl.constexpr
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = c < C
    start = tl.load(cu_ptr + b).to(tl.int64)
    T = tl.load(cu_ptr + b + 1).to(tl.int64) - start
    state = pool_ptr + tl.load(slots_ptr + b).to(tl.int64) * (KW - 1) * C
    u = u_ptr + start * C
    for t in range(T):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(KW):
            w = tl.load(w_ptr + c * KW + j, mask=m, other=0.0).to(tl.float32)
            acc += w * _x_row(state, u, t + j, c, m, KW, C)
        tl.store(out_ptr + (start + t) * C + c, acc / (1.0 + tl.exp(-acc)), mask=m)
    # the window after the last position, in place; ascending rows: row j reads X[T+j], an
    # index above j, so nothing read here was overwritten yet
    for j in tl.static_range(KW - 1):
        row = _x_row(state, u, T + j, c, m, KW, C)
        tl.store(state + j * C + c, row.to(state.dtype.element_ty), mask=m)


def short_conv_varlen(u: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, lens: list[int]):
    """Prefill chunks of S sequences: u [N, C] (rows sequence-major, lens [S] each), weight
    [C, KW]; each sequence starts from the window at slots [S] of pool [S', KW-1, C] and leaves
    there the window after its last row. -> SiLU(conv) [N, C] fp32. Reference: layers/short_conv.py
    `short_conv` per sequence."""
    N, C = u.shape
    KW = weight.shape[1]
    cu = torch.tensor([0, *lens], dtype=torch.long).cumsum(0).to(u.device)
    out = torch.empty(N, C, dtype=torch.float32, device=u.device)
    BC = min(triton.next_power_of_2(C), 256)
    _short_conv_varlen_kernel[(len(lens), triton.cdiv(C, BC))](
        u.contiguous(), weight.contiguous(), pool, slots.contiguous(), cu, out, C, KW=KW, BC=BC
    )
    return out
