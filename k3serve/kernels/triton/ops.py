"""The Triton kernels as `torch.library` custom ops (namespace `k3serve`, prefix `triton_`),
each with the graph op's fake implementation (backends/graph_ops.py FAKES): one node to
torch.compile, nothing run at trace time, and what FakeTensorMode's sync audit sees (tests/model/test_graph.py). Their schemas follow the
graph backend's ops (backends/graph_ops.py) except where the kernel reads other inputs:
KDA takes A_log per head (the gate is computed inside fla's kernel), MLA the block table and
block size (it pages through the cache itself), MoE no decode tables (it decodes in registers).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from torch import Tensor

from k3serve.backends.graph_ops import register
from k3serve.kernels.triton import kda, mla, moe


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
    return kda.kda_decode(u, z, b, gate, conv_w, a_log, dt_bias, o_norm, rec, conv, slots, head_dim, lower_bound, eps)


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
    last: Tensor,
    head_dim: int,
    lower_bound: Optional[float],
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return kda.kda_verify(
        u, z, b, gate, conv_w, a_log, dt_bias, o_norm, rec, conv, slots, last, head_dim, lower_bound, eps
    )


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
) -> Tensor:
    return mla.mla_decode(q, ckv, kv_norm, store, cache_rows, table, lens, kv_b, nope, v_dim, scale, eps, block_size)


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
) -> Tensor:
    # linear_beta 0.0 stands for none (the layers' `situ` pair)
    return moe.moe_experts(z, ids, weights, w1, w2, w3, s1, s2, s3, situ, beta, linear_beta or None)


BODIES = SimpleNamespace(kda_decode=kda_decode, kda_verify=kda_verify, mla_decode=mla_decode, moe_experts=moe_experts)


OPS = register("triton_", BODIES)
