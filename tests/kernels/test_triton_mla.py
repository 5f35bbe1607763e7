"""Paged MLA decode through the Triton kernel == the absorbed-attention reference (the graph
backend's body: `attend_absorbed_batched` over the rows gathered through the block table), in
fp32 and with a bf16 latent cache: decode rows, verify rows (causal within the block), ragged
context lengths across split boundaries, padding rows on the scratch block. Tolerance 1e-5 on
outputs of magnitude ~1 (fp32 arithmetic in both, another summation order); the cache rows
the step writes equal the reference's bit for bit, and every other row is unchanged."""

from __future__ import annotations

import pytest
import torch

from k3serve.backends.graph_ops import BODIES
from k3serve.kernels.triton import mla

H, NOPE, R, C, V, BS = 3, 16, 8, 32, 16, 16


def case(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = 4
    table = torch.tensor([[3, 1, 7, 0], [2, 5, 8, 9], [10, 10, 10, 10]])  # last: padding on scratch block 10
    seq_lens = [37, 5, 1]  # positions after the step; 37 crosses split and block boundaries
    B = len(seq_lens)
    N = B * T
    lens = torch.tensor([max(1, seq_lens[n // T] - (T - 1) + n % T) for n in range(N)])
    pos = lens - 1
    cache_rows = torch.stack([table[n // T, pos[n] // BS] * BS + pos[n] % BS for n in range(N)])
    context = torch.stack([table[n // T].repeat_interleave(BS) * BS + torch.arange(BS).repeat(W) for n in range(N)])
    store = torch.randn(11 * BS, C + R, generator=g).to(dtype)
    q, ckv = torch.randn(N, H, NOPE + R, generator=g), torch.randn(N, C + R, generator=g)
    kv_norm, kv_b = torch.rand(C, generator=g) + 0.5, torch.randn(H, NOPE + V, C, generator=g) * 0.2
    return q, ckv, kv_norm, store, cache_rows, table, context, lens, kv_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "verify"])
def test_paged_mla_kernel_equals_the_absorbed_reference(T, dtype):
    q, ckv, kv_norm, store, cache_rows, table, context, lens, kv_b = case(T, dtype)
    want_store, got_store = store.clone(), store.clone()
    want = BODIES.mla_decode(q, ckv, kv_norm, want_store, cache_rows, context, lens, kv_b, NOPE, V, 0.3, 1e-6)
    got = mla.mla_decode(q, ckv, kv_norm, got_store, cache_rows, table, lens, kv_b, NOPE, V, 0.3, 1e-6, BS)
    live = torch.arange(2 * T)  # the padding sequence's rows attend the scratch block: unchecked
    assert (got[live] - want[live]).abs().max() < 1e-5
    assert torch.equal(got_store, want_store)
    untouched = torch.ones(store.shape[0], dtype=torch.bool)
    untouched[cache_rows] = False
    assert torch.equal(got_store[untouched], store[untouched])


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_kv_merge_is_independent_of_the_split_count(splits):
    """More splits than context tiles leave empty splits (weight 0 in the merge)."""
    q, ckv, kv_norm, store, cache_rows, table, context, lens, kv_b = case(1, torch.float32, seed=1)
    q_lat, q_pe = torch.randn(3, H, C), torch.randn(3, H, R)
    one = mla.paged_attention(q_lat, q_pe, store, table, lens, BS, 0.3, splits=1)
    assert torch.allclose(
        mla.paged_attention(q_lat, q_pe, store, table, lens, BS, 0.3, splits=splits), one, atol=1e-5, rtol=0
    )
