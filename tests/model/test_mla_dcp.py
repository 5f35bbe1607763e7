"""Decode context parallelism's pieces in one process (issue 62 item 2): the token layout
(parallel/dcp.py) gives every rank each of its local rows exactly once, and attention split by
keys over the ranks' shards, merged by log-sum-exp (layers/mla_dcp.py), equals the whole
absorbed attention (layers/mla.py `attend_absorbed`) within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from k3serve.layers.mla import attend_absorbed
from k3serve.layers.mla_dcp import merge, partial_attention
from k3serve.parallel.dcp import DCPLayout


@pytest.mark.parametrize("n,interleave,block", [(2, 1, 16), (4, 1, 16), (2, 2, 16), (2, 4, 8)])
def test_the_layout_gives_each_rank_every_local_row_once(n, interleave, block):
    layout = DCPLayout(n, interleave, block)
    blocks = 5
    rows = torch.arange(blocks * block)
    owner = layout.owner(rows)
    for r in range(n):
        mine, local = layout.split(rows, r)
        assert sorted(local.tolist()) == list(range(blocks * block // n))  # a bijection onto its pool
        assert torch.equal(mine, owner == r)
    # positions of a sequence through a block table: in order, each on its owner, rows as split says
    table, length = [3, 0, 4], 2 * block + 5  # into the third block
    for r in range(n):
        pos, local = layout.sequence_rows(table, length, r, "cpu")
        assert torch.equal(pos, torch.tensor([p for p in range(length) if (p // interleave) % n == r]))
        glob = torch.tensor(table)[pos // block] * block + pos % block
        assert torch.equal(local, layout.split(glob, r)[1])


@pytest.mark.parametrize("n,interleave", [(2, 1), (4, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("ctx,t", [(0, 9), (11, 5), (23, 1)])  # a first chunk, a later chunk, a decode
def test_attention_split_by_keys_and_merged_equals_the_whole(n, interleave, ctx, t):
    g = torch.Generator().manual_seed(n * 100 + ctx)
    H, nope, rope, c, v = 4, 8, 4, 16, 8
    L = ctx + t
    q_nope, q_pe = torch.randn(t, H, nope, generator=g), torch.randn(t, H, rope, generator=g)
    latent, k_pe = torch.randn(L, c, generator=g), torch.randn(L, rope, generator=g)
    w_kv_b = torch.randn(H, nope + v, c, generator=g) / c**0.5
    scale = (nope + rope) ** -0.5
    want = attend_absorbed(q_nope, q_pe, latent, k_pe, w_kv_b, v, ctx, scale)  # [t, H, v]

    q_abs = torch.einsum("thn,hnc->thc", q_nope, w_kv_b[:, :nope])
    pos = torch.arange(L)
    owner = (pos // interleave) % n
    parts = [
        partial_attention(
            q_abs, q_pe, latent[owner == r], k_pe[owner == r], pos[owner == r], torch.arange(ctx, L), scale
        )
        for r in range(n)
    ]
    mixed = merge(torch.stack([m for m, _ in parts]), torch.stack([lse for _, lse in parts]))
    got = torch.einsum("thc,hvc->thv", mixed, w_kv_b[:, nope:])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    if ctx == 0:  # query 0 sees position 0 alone: every other rank has nothing visible, and says so
        assert all(torch.isinf(lse[0]).all() for _, lse in parts[1:]) and all(
            m[0].abs().max() == 0 for m, _ in parts[1:]
        )
