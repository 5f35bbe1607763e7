"""The registrar of the static step's custom ops (namespace `k3serve`): each op's fake (meta)
implementation, the arguments it mutates, and `register`, which makes a set of bodies into ops.
The graph backend's torch bodies (backends/graph_ops.py) and the Triton kernels
(kernels/triton/ops.py) register through it under the same schemas; it imports neither."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.library import custom_op

# fake (meta) implementations: output shapes only. The Triton ops (kernels/triton/ops.py) share
# them: their arguments differ from these ops' only past the positions a fake reads.
FAKES = SimpleNamespace(
    rms_norm=lambda x, weight, eps: torch.empty_like(x),
    kda_decode=lambda u, z, b, gate, *rest: z.new_empty(z.shape, dtype=torch.float32),
    kda_verify=lambda u, z, b, gate, *rest: z.new_empty(z.shape, dtype=torch.float32),
    mla_decode=lambda q, ckv, kv_norm, store, cache_rows, context_rows, lens, kv_b, nope, v_dim, *rest: q.new_empty(
        q.shape[0], q.shape[1], v_dim, dtype=torch.float32
    ),
    moe_route=lambda x, weight, bias, top_k, *rest: (
        x.new_empty(x.shape[0], top_k, dtype=torch.long),
        x.new_empty(x.shape[0], top_k, dtype=torch.float32),
    ),
    moe_experts=lambda z, ids, weights, w1, w2, *rest: z.new_empty(z.shape[0], w2.shape[1], dtype=torch.float32),
    glu_mlp=lambda x, gate_w, up_w, down_w, *rest: x.new_empty(x.shape[0], down_w.shape[0]),
    attnres_mix=lambda bank, w, eps: torch.empty_like(bank[0]),
)
MUTATES = dict(kda_decode=("rec", "conv"), kda_verify=("rec", "conv"), mla_decode=("store",))


def register(prefix: str, bodies: SimpleNamespace) -> SimpleNamespace:
    """`k3serve::{prefix}{name}` custom ops over `bodies`, each with FAKES[name]."""
    ops = {}
    for name, fn in vars(bodies).items():
        o = custom_op(f"k3serve::{prefix}{name}", fn, mutates_args=MUTATES.get(name, ()))
        o.register_fake(getattr(FAKES, name))
        ops[name] = o
    return SimpleNamespace(**ops)
