"""The graph backend's custom ops (backends/graph_ops.py): each passes torch.library.opcheck
(schema and declared mutations, the fake implementation's shapes, dtypes and strides against
the body's, compiled use), and the MoE experts, in both of their shape-chosen forms and on both
weight formats, equal the plain per-token loop (layers/experts.py experts_reference)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from k3serve.backends.graph_ops import OPS
from k3serve.layers.activation import situ_and_mul
from k3serve.layers.experts import experts_reference
from k3serve.weights.mxfp4 import PackedMXFP4, decode_tables

G = torch.Generator().manual_seed(5)


def randn(*shape):
    return torch.randn(*shape, generator=G)


def experts(E=8, h=64, inter=32, packed=True):
    ws = [randn(E, inter, h) / 8, randn(E, h, inter) / 6, randn(E, inter, h) / 8]
    return [PackedMXFP4.quantize(w) for w in ws] if packed else ws


def expert_args(N, k, ws, packed):
    ids = torch.stack([torch.randperm(ws[0].shape[0], generator=G)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=G)
    z = randn(N, ws[0].shape[2])
    if packed:
        tensors = [w.packed for w in ws] + [w.scale for w in ws] + list(decode_tables(torch.device("cpu"), z.dtype))
    else:
        tensors = ws + [None] * 5
    return (z, ids, weights, *tensors, True, 4.0, 25.0)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("N", [2, 7])  # 2 x 3 assignments <= 8 experts: gathered; 7 x 3 > 8: every expert
def test_moe_experts_equal_the_reference_loop(packed, N):
    ws = experts(packed=packed)
    args = expert_args(N, 3, ws, packed)
    z, ids, weights = args[:3]
    got = OPS.moe_experts(*args)
    want = experts_reference(z, ids, weights, *ws, partial(situ_and_mul, beta=4.0, linear_beta=25.0))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(OPS.moe_experts, args)


def test_kda_decode_opcheck():
    H, D, K, S, N = 2, 8, 4, 6, 3
    P = H * D
    args = (
        randn(N, 3 * P),
        randn(N, P),
        randn(N, H),
        randn(N, P),
        randn(3 * P, K),
        torch.rand(P, generator=G),
        randn(P),
        torch.rand(D, generator=G) + 0.5,
        randn(S, H, D, D),
        randn(S, K - 1, 3 * P),
        torch.tensor([4, 0, 4]),
        D,
        -5.0,
        1e-6,
    )
    torch.library.opcheck(OPS.kda_decode, args)


def test_kda_verify_opcheck():
    H, D, K, S, B, T = 2, 8, 4, 6, 2, 3
    P = H * D
    N = B * T
    args = (
        randn(N, 3 * P),
        randn(N, P),
        randn(N, H),
        randn(N, P),
        randn(3 * P, K),
        torch.rand(P, generator=G),
        randn(P),
        torch.rand(D, generator=G) + 0.5,
        randn(S, H, D, D),
        randn(S, K - 1, 3 * P),
        torch.tensor([[4, 1, 0], [2, 5, 3]]),  # each sequence's slot row (cache/draft_slots.py)
        D,
        None,
        1e-6,
    )
    torch.library.opcheck(OPS.kda_verify, args)


def test_mla_decode_opcheck():
    H, nope, r, c, v, N, L = 2, 8, 4, 16, 8, 3, 12
    store = randn(32, c + r)
    args = (
        randn(N, H, nope + r),
        randn(N, c + r),
        torch.rand(c, generator=G) + 0.5,
        store,
        torch.tensor([5, 9, 30]),
        torch.randint(0, 32, (N, L), generator=G),
        torch.tensor([6, 12, 1]),
        randn(H, nope + v, c),
        nope,
        v,
        (nope + r) ** -0.5,
        1e-6,
    )
    torch.library.opcheck(OPS.mla_decode, args)


def test_small_ops_opcheck():
    x = randn(5, 16)
    torch.library.opcheck(OPS.rms_norm, (x, torch.rand(16, generator=G), 1e-6))
    torch.library.opcheck(OPS.glu_mlp, (x, randn(24, 16), randn(24, 16), randn(16, 24), True, 4.0, 25.0))
    torch.library.opcheck(OPS.attnres_mix, ([x, randn(5, 16), randn(5, 16)], randn(16), 1e-6))
    torch.library.opcheck(OPS.moe_route, (x, randn(8, 16), randn(8), 3, True, True, 2.5, 2, 1))


@pytest.mark.parametrize("N", [2, 7])
def test_moe_experts_with_masked_repeats(N):
    """Expert parallelism hands the op other ranks' assignments as expert 0 with weight 0: a
    row's ids then repeat, and the masked ones must add nothing (a scatter, not a scatter-add,
    let a masked 0 overwrite a real weight on expert 0)."""
    ws = experts(packed=True)
    z, ids, weights, *rest = expert_args(N, 3, ws, True)
    keep = torch.rand(N, 3, generator=G) < 0.5
    keep[:, 0] = True
    ids[:, 0] = 0  # a real assignment to expert 0 in every row, beside masked ones
    masked_ids = torch.where(keep, ids, torch.zeros_like(ids))
    got = OPS.moe_experts(z, masked_ids, weights * keep, *rest)
    want = experts_reference(z, ids, weights * keep, *ws, partial(situ_and_mul, beta=4.0, linear_beta=25.0))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
