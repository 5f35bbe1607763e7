"""KDA decode and verify on the state pool: the short conv (short_conv.py), then fla-core's
`fused_recurrent_kda` kernel with K3's gate, beta sigmoid and the q/k l2 norm inside it, then
the gated RMSNorm of the output (torch). Reference: backends/graph_ops.py `kda_decode` /
`kda_verify` (the `graph` backend's bodies) and layers/kda_ops.py `kda_recurrent`.

Shapes: N = B * T rows, sequence-major; H heads of D; P = H * D; S state slots.
  decode: the recurrent state is read and written in place through `slots` [B] (fla's
          continuous-batching form with 1-D state indices).
  verify: `slots` [B, T] (fla's 2-D state indices, vLLM's spec-decode layout): each sequence
          starts from the state at slots[b, 0] and the state after position t goes to
          slots[b, t] (cache/draft_slots.py: rollback picks the accepted slot, copying nothing).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
import triton
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd_kernel

from k3serve.kernels.triton.short_conv import short_conv_update


def _recurrent(q, k, v, z, b, a_log, dt_bias, pool, slots, lower_bound, T):
    """q, k, v, z [N, H, D] fp32 (z: decay logits before dt_bias), b [N, H] beta logits ->
    o [N, H, D] fp32; pool updated in place: the state after token t of sequence n goes to
    slots[n] (T = 1) or slots[n, t] ([B, T]), each sequence starting from its first slot's."""
    N, H, D = q.shape
    B = slots.shape[0]
    slots = slots.contiguous()
    o = torch.empty_like(v)
    cu = torch.arange(0, N + 1, T, dtype=torch.int32, device=q.device)  # [B + 1], every sequence T rows
    BV = min(32, triton.next_power_of_2(D))
    fused_recurrent_kda_fwd_kernel[(triton.cdiv(D, BV) * B * H,)](
        q=q,
        k=k,
        v=v,
        g=z,
        beta=b,
        A_log=a_log,
        dt_bias=dt_bias,
        o=o,
        h0=pool,
        ht=pool,
        cu_seqlens=cu,
        ssm_state_indices=slots,
        num_accepted_tokens=None,  # the starting state is always column 0 (rollback swapped it there)
        lower_bound=lower_bound,
        scale=D**-0.5,
        N=B,
        T=N,
        H=H,
        HV=H,
        K=D,
        V=D,
        BK=triton.next_power_of_2(D),
        BV=BV,
        stride_init_state_token=pool.stride(0),
        stride_final_state_token=pool.stride(0),
        stride_indices_seq=slots.stride(0),
        stride_indices_tok=1,
        IS_BETA_HEADWISE=False,
        USE_QK_L2NORM_IN_KERNEL=True,
        INPLACE_FINAL_STATE=True,
        USE_GATE_IN_KERNEL=True,
        APPLY_BETA_SIGMOID=True,
        ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False,
        num_warps=4,
        num_stages=2,
    )
    return o


def _gated(o, gate, o_norm, eps):
    """RMSNorm_D(o) * sigmoid(gate): o [N, H, D], gate [N, P] -> [N, P] fp32: layers/norm.py
    gated_rms_norm's body, written here because kernels/ never import layers/ (the equality
    tests against the graph step hold the two together)."""
    N, H, D = o.shape
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm
    return (normed * torch.sigmoid(gate.view(N, H, D))).reshape(N, H * D)


def kda_decode(
    u: Tensor,
    z: Tensor,
    b: Tensor,
    gate: Tensor,
    conv_w: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    o_norm: Tensor,
    rec: Tensor,
    conv: Tensor,
    slots: Tensor,
    head_dim: int,
    lower_bound: Optional[float],
    eps: float,
) -> Tensor:
    """One step per row: u [N, 3P], z [N, P], b [N, H], gate [N, P] fp32; conv_w [3P, K];
    a_log [H] fp32 (the gate's A_log); dt_bias [P]; o_norm [D]; rec [S, H, D, D] fp32 and conv
    [S, K-1, 3P] updated in place at slots [N] (int). -> [N, P] fp32."""
    N, H, D = u.shape[0], b.shape[1], head_dim
    qkv = short_conv_update(u, conv_w, conv, slots)
    q, k, v = (x.view(N, H, D) for x in qkv)
    o = _recurrent(q, k, v, z.contiguous().view(N, H, D), b.contiguous(), a_log, dt_bias, rec, slots, lower_bound, 1)
    return _gated(o, gate, o_norm, eps)


def kda_verify(
    u: Tensor,
    z: Tensor,
    b: Tensor,
    gate: Tensor,
    conv_w: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    o_norm: Tensor,
    rec: Tensor,
    conv: Tensor,
    slots: Tensor,
    head_dim: int,
    lower_bound: Optional[float],
    eps: float,
) -> Tensor:
    """B sequences of T rows (the inputs as `kda_decode`'s), slots [B, T]: each starts from the
    states at slots[:, 0], the state after position t goes to slots[:, t] -> o [N, P] fp32."""
    N, H, D = u.shape[0], b.shape[1], head_dim
    T = slots.shape[1]
    qkv = short_conv_update(u, conv_w, conv, slots)
    q, k, v = (x.view(N, H, D) for x in qkv)
    o = _recurrent(q, k, v, z.contiguous().view(N, H, D), b.contiguous(), a_log, dt_bias, rec, slots, lower_bound, T)
    return _gated(o, gate, o_norm, eps)


def kda_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, rec: Tensor, slots: Tensor, lens: list[int]):
    """Prefill chunks (and any single rows beside them) of S sequences in one varlen call of
    fla-core's `chunk_kda`: q, k (l2-normed, q * D^-1/2), v, g (log decay) [N, H, D] fp32 and
    beta [N, H], rows sequence-major with lens [S] rows each; each sequence starts from the
    state at slots [S] of rec [S', H, D, D] and its state after its last row is written back
    there. -> o [N, H, D] fp32. Reference: layers/kda_ops.py `kda_chunked` per sequence."""
    from fla.ops.kda import chunk_kda

    cu_cpu = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)
    o, final = chunk_kda(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        scale=1.0,
        initial_state=rec.index_select(0, slots).float(),
        output_final_state=True,
        cu_seqlens=cu_cpu.to(q.device),
        cu_seqlens_cpu=cu_cpu,  # the host copy fla would otherwise make (a sync)
    )
    rec.index_copy_(0, slots, final.to(rec.dtype))
    return o[0]
