"""The graph backend's kernels as `torch.library` custom ops (namespace `k3serve`), with schemas.

Each op is one node to torch.compile and one dispatch in eager mode (an aten op count per layer
in the tens, not the hundreds: bench/step_profile.py), and the slot a device kernel fills:
the bodies here are fixed-shape, sync-free torch (the reference arithmetic, so greedy tokens
agree with the `torch` backend); the GPU-kernels issue registers Triton implementations for
CUDA under the same schemas. Each op has a fake (meta) implementation giving output shapes, so
the compiled step and FakeTensorMode never run a body. `BODIES` are the same functions
uncalled through the dispatcher: the sync audit runs them to see inside (tests/model/test_graph.py).
The fakes and the registrar are kernels/graph_registry.py (the Triton ops register through it too).

Shapes: N rows; P = H * D (KDA heads x head dim); c = kv_lora_rank, r = rope dim; E experts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from k3serve.kernels.graph_registry import register
from k3serve.layers.activation import situ_and_mul, silu_and_mul
from k3serve.layers.attnres import attnres_mix as _attnres_mix
from k3serve.layers.gemm import dense
from k3serve.layers.kda_ops import kda_step
from k3serve.forward.cache import from_cache, write_rows
from k3serve.layers.mla import attend_absorbed_batched
from k3serve.layers.norm import l2_normalize
from k3serve.layers.norm import gated_rms_norm
from k3serve.layers.norm import rms_norm as _rms_norm
from k3serve.layers.router import route
from k3serve.weights.mxfp8 import fake_quantize_mxfp8
from k3serve.layers.short_conv import short_conv_step


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., n] -> same dtype (layers/norm.py)."""
    return _rms_norm(x, weight, eps)


def _kda_position(u, g, beta, conv_w, conv_state, state, H: int, D: int):
    """One position of B sequences: u [B, 3P], g [B, H, D] log decay, beta [B, H]; conv_state
    [B, K-1, 3P], state [B, H, D, D] -> (o [B, H, D], conv_state, state), the reference's decode
    arithmetic (short_conv_step, per-head l2 norm with q * D^-1/2, kda_step)."""
    c, conv_state = short_conv_step(u, conv_w, conv_state)
    q, k, v = c.view(u.shape[0], 3, H, D).unbind(1)
    o, state = kda_step(l2_normalize(q) * D**-0.5, l2_normalize(k), v, g, beta, state)
    return o, conv_state, state


def _kda_gates(z, b, gate, decay, dt_bias, o_norm, H, D, lower_bound, eps):
    """Log decay g [N, H, D] and beta [N, H] of every row, and the output gate's closure."""
    N = z.shape[0]
    z = z + dt_bias
    g = lower_bound * torch.sigmoid(decay * z) if lower_bound is not None else -decay * F.softplus(z)

    def gated(o):  # [N, H, D] -> RMSNorm_D(o) * sigmoid(gate) [N, P] fp32
        return gated_rms_norm(o, gate, o_norm, eps)

    return g.view(N, H, D), torch.sigmoid(b), gated


def kda_decode(
    u: Tensor,
    z: Tensor,
    b: Tensor,
    gate: Tensor,
    conv_w: Tensor,
    decay: Tensor,
    dt_bias: Tensor,
    o_norm: Tensor,
    rec: Tensor,
    conv: Tensor,
    slots: Tensor,
    head_dim: int,
    lower_bound: Optional[float],
    eps: float,
) -> Tensor:
    """One KDA decode step per row, state read and written through `slots` [N].
    u [N, 3P] (q|k|v before the conv), z [N, P] (decay logits before dt_bias), b [N, H] (beta
    logits), gate [N, P]: fp32. conv_w [3P, K]; decay [P] = exp(A_log) per channel; dt_bias [P];
    o_norm [D]. rec [S, H, D, D], conv [S, K-1, 3P] updated in place. -> gated-normed o [N, P] fp32."""
    H, D = b.shape[1], head_dim
    g, beta, gated = _kda_gates(z, b, gate, decay, dt_bias, o_norm, H, D, lower_bound, eps)
    o, conv_new, state = _kda_position(
        u, g, beta, conv_w, conv.index_select(0, slots), rec.index_select(0, slots), H, D
    )
    conv.index_copy_(0, slots, conv_new)
    rec.index_copy_(0, slots, state.to(rec.dtype))  # a bf16 state pool (--mamba-ssm-cache-dtype) rounds here
    return gated(o)


def kda_verify(
    u: Tensor,
    z: Tensor,
    b: Tensor,
    gate: Tensor,
    conv_w: Tensor,
    decay: Tensor,
    dt_bias: Tensor,
    o_norm: Tensor,
    rec: Tensor,
    conv: Tensor,
    slots: Tensor,
    head_dim: int,
    lower_bound: Optional[float],
    eps: float,
) -> Tensor:
    """A verify pass: B sequences of T positions each (rows b * T + t, N = B * T; the inputs as
    `kda_decode`'s), run as T consecutive decode steps from the states at slots[:, 0], the state
    after position t written to slots[:, t] [B, T] (cache/draft_slots.py: rollback then picks the
    accepted position's slot, copying nothing; column 0 is read before it is overwritten).
    Positions past a sequence's drafts write its spare slots, never read. -> o [N, P] fp32."""
    B, T = slots.shape
    H, D = b.shape[1], head_dim
    g, beta, gated = _kda_gates(z, b, gate, decay, dt_bias, o_norm, H, D, lower_bound, eps)
    u, g, beta = u.view(B, T, -1), g.view(B, T, H, D), beta.view(B, T, H)
    conv_state, state = conv.index_select(0, slots[:, 0]), rec.index_select(0, slots[:, 0])
    outs = []
    for t in range(T):
        o, conv_state, state = _kda_position(u[:, t], g[:, t], beta[:, t], conv_w, conv_state, state, H, D)
        state = state.to(rec.dtype)  # as a decode would store it (bf16 pools round every position)
        outs.append(o)
        rec.index_copy_(0, slots[:, t], state)
        conv.index_copy_(0, slots[:, t], conv_state)
    return gated(torch.stack(outs, 1).view(B * T, H, D))


def mla_decode(
    q: Tensor,
    ckv: Tensor,
    kv_norm: Tensor,
    store: Tensor,
    cache_rows: Tensor,
    context_rows: Tensor,
    lens: Tensor,
    kv_b: Tensor,
    nope: int,
    v_dim: int,
    scale: float,
    eps: float,
    kv_scale: Optional[Tensor] = None,
) -> Tensor:
    """One absorbed-attention decode per row. q [N, H, nope + r] fp32; ckv [N, c + r] (the
    kv_a projection: latent before its norm | k_pe); kv_norm [c]; store [rows, c + r] written at
    cache_rows [N] in place; context_rows [N, L] and lens [N] the rows each attends; kv_b
    [H, nope + v, c] fp32; kv_scale: the fp8 cache's 0-d scale (forward/cache.py), or None.
    -> [N, H, v] fp32."""
    c = kv_norm.shape[0]
    latent = torch.cat((_rms_norm(ckv[:, :c], kv_norm, eps), ckv[:, c:]), -1)
    write_rows(store, cache_rows, latent, kv_scale)
    seq = from_cache(store[context_rows], kv_scale)  # [N, L, c + r]
    out = attend_absorbed_batched(q[..., :nope], q[..., nope:], seq[..., :c], seq[..., c:], lens, kv_b, v_dim, scale)
    return out.contiguous()  # the strides the fake implementation states


def moe_route(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    top_k: int,
    sigmoid: bool,
    renormalize: bool,
    scaling: float,
    groups: int,
    topk_group: int,
) -> tuple[Tensor, Tensor]:
    """x [N, d] -> expert ids [N, k] int64, weights [N, k] fp32 (layers/router.py)."""
    cfg = SimpleNamespace(
        router_activation="sigmoid" if sigmoid else "softmax",
        num_expert_group=groups,
        topk_group=topk_group,
        top_k=top_k,
        renormalize=renormalize,
        routed_scaling_factor=scaling,
    )
    return route(x, weight, bias, cfg)


def _glu(gate: Tensor, up: Tensor, situ: bool, beta: float, linear_beta: float) -> Tensor:
    # linear_beta 0.0 stands for none (the layers' `situ` pair, the kernels' convention): u passes
    return situ_and_mul(gate, up, beta, linear_beta or None) if situ else silu_and_mul(gate, up)


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
    pair_lut: Optional[Tensor],
    scale_lut: Optional[Tensor],
    situ: bool,
    beta: float,
    linear_beta: float,
    a8: bool = False,
) -> Tensor:
    """Routed sum, FP32 [N, out], shapes fixed by N. w* [E, out, in] dense, or with scales s*
    packed MXFP4 ([E, out, in/2] codes, [E, out, in/32] E8M0) decoded by the lookup tables
    (pair_lut [256, 2], scale_lut [256] in z's dtype), or packed NVFP4 ([E, out, in/16] E4M3
    bytes) with scale_lut the group-factor tables of w1, w2, w3 [3, E, 256] float32 (products
    in float32, the reference's rounding: weights/nvfp4.py). When the N * k assignments are fewer than
    the experts each assignment's expert is gathered (exactly the selected weights read);
    otherwise every expert runs on every row, weighted by that row's routing weight for it
    (zero when not chosen): E matrices read, no sort, no count, no host sync. `a8`: the GEMM
    inputs (z, and the GLU's output before w2) rounded through MXFP8 first (layers/experts.py)."""
    if a8:
        z = fake_quantize_mxfp8(z)
    glu = _glu if not a8 else lambda g, u, *rest: fake_quantize_mxfp8(_glu(g, u, *rest))
    N, k = ids.shape
    E = w1.shape[0]

    def select(w, s, idx, m):  # matrix m's experts idx: [M, out, in] in z's dtype
        if s is None:
            return w[idx].to(z.dtype)
        packed, sb = w[idx], s[idx].to(torch.int64)
        vals = pair_lut[packed.to(torch.int64)].view(*packed.shape[:-1], -1, 2 * packed.shape[-1] // s.shape[-1])
        if scale_lut.dim() == 1:  # MXFP4: powers of two, exact in z's dtype
            return (vals * scale_lut[sb].unsqueeze(-1)).view(*packed.shape[:-1], -1)
        factor = scale_lut[m][idx.view(-1, 1, 1), sb]  # NVFP4 [M, out, in/16] float32
        return (vals.float() * factor.unsqueeze(-1)).view(*packed.shape[:-1], -1).to(z.dtype)

    if N * k <= E:
        flat = ids.reshape(-1)
        xs = z.repeat_interleave(k, 0).unsqueeze(1)  # [N*k, 1, in]
        h = glu(
            torch.bmm(xs, select(w1, s1, flat, 0).transpose(1, 2)),
            torch.bmm(xs, select(w3, s3, flat, 2).transpose(1, 2)),
            situ,
            beta,
            linear_beta,
        )
        y = torch.bmm(h, select(w2, s2, flat, 1).transpose(1, 2)).view(N, k, -1)  # [N, k, out]
        return (y.float() * weights.float().unsqueeze(-1)).sum(1)
    every = torch.arange(E, device=z.device)
    h = glu(
        torch.einsum("ni,eoi->eno", z, select(w1, s1, every, 0)),
        torch.einsum("ni,eoi->eno", z, select(w3, s3, every, 2)),
        situ,
        beta,
        linear_beta,
    )
    y = torch.einsum("eni,eoi->eno", h, select(w2, s2, every, 1))  # [E, N, out]
    # scatter_add: a row's ids may repeat (expert parallelism maps other ranks' experts to local
    # expert 0 with weight 0), and a plain scatter would let such a 0 overwrite a real weight
    dense_w = torch.zeros(N, E, dtype=torch.float32, device=z.device).scatter_add_(1, ids, weights.float())
    return torch.einsum("ne,eno->no", dense_w, y.float()).contiguous()


def glu_mlp(
    x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, situ: bool, beta: float, linear_beta: float
) -> Tensor:
    """down(act(gate x, up x)): x [N, d] -> [N, d] (the dense MLP and the shared experts)."""
    return dense(_glu(dense(x, gate_w), dense(x, up_w), situ, beta, linear_beta), down_w)


def attnres_mix(bank: list[Tensor], w: Tensor, eps: float) -> Tensor:
    """n candidates [N, d] -> [N, d] (layers/attnres.py)."""
    return _attnres_mix(bank, w, eps)


BODIES = SimpleNamespace(
    rms_norm=rms_norm,
    kda_decode=kda_decode,
    kda_verify=kda_verify,
    mla_decode=mla_decode,
    moe_route=moe_route,
    moe_experts=moe_experts,
    glu_mlp=glu_mlp,
    attnres_mix=attnres_mix,
)


OPS = register("", BODIES)
