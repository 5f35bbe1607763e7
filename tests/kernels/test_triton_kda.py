"""KDA through the Triton kernels (fla-core's fused recurrent kernel and our short-conv update)
== the graph backend's torch body, itself the reference's decode arithmetic: run in float64
(`kda_step`, the step `kda_recurrent` loops), against the kernels in fp32. Decode rows, and
verify rows writing each position's state to its own slot (2-D state indices, a row per
sequence: cache/draft_slots.py), K3's lower-bound gate and Kimi-Linear's softplus gate, padding
rows on a shared scratch slot. Tolerances: 2e-5 absolute on outputs and states of magnitude ~1
(fp32 kernels against float64), and every slot the batch does not name bit-for-bit unchanged."""

from __future__ import annotations

import pytest
import torch

from k3serve.backends.graph_ops import BODIES
from k3serve.kernels.triton import kda

S, H, D, K = 17, 2, 16, 4
P = H * D
SCRATCH = S - 1


def case(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    N = B * T
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    x = dict(
        u=r(N, 3 * P),
        z=r(N, P),
        b=r(N, H),
        gate=r(N, P),
        conv_w=r(3 * P, K, scale=0.5),
        a_log=r(H, scale=0.3),
        dt_bias=r(P, scale=0.1),
        o_norm=torch.rand(D, generator=g) + 0.5,
    )
    return x, r(S, H, D, D, scale=0.1), r(S, K - 1, 3 * P)


def reference(x, rec, conv, slots, T, lower_bound):
    """The graph body in float64 on copies: (o, rec, conv)."""
    rec, conv = rec.double(), conv.double()
    d = {k: v.double() for k, v in x.items()}
    decay = d.pop("a_log").exp().repeat_interleave(D)
    args = (d["u"], d["z"], d["b"], d["gate"], d["conv_w"], decay, d["dt_bias"], d["o_norm"], rec, conv, slots)
    op = BODIES.kda_decode if T == 1 else BODIES.kda_verify
    return op(*args, D, lower_bound, 1e-5), rec, conv


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3_gate", "kimi_linear_gate"])
@pytest.mark.parametrize("T", [1, 4], ids=["decode", "verify"])
def test_kda_kernels_equal_the_float64_reference(T, lower_bound):
    """Decode: slots [B]; verify: slots [B, T], each live sequence's row permuted as rollbacks
    leave them (the state it starts from is not always the lowest id)."""
    live = torch.tensor([[5, 1, 9, 12], [3, 11, 4, 13], [6, 14, 2, 10]])[:, :T]
    slots = torch.cat((live, torch.full((2, T), SCRATCH)))  # two padding rows share the scratch slot
    slots = slots[:, 0] if T == 1 else slots
    x, rec, conv = case(len(slots), T, seed=T)
    want_o, want_rec, want_conv = reference(x, rec, conv, slots, T, lower_bound)
    args = (x["u"], x["z"], x["b"], x["gate"], x["conv_w"], x["a_log"], x["dt_bias"], x["o_norm"])
    rec0, conv0 = rec.clone(), conv.clone()
    op = kda.kda_decode if T == 1 else kda.kda_verify
    o = op(*args, rec, conv, slots, D, lower_bound, 1e-5)
    rows = torch.arange(len(live) * T)  # the live sequences' rows
    written = live.flatten()  # every position's state, in the slot its row names
    assert (o[rows].double() - want_o[rows]).abs().max() < 2e-5
    assert (rec[written].double() - want_rec[written]).abs().max() < 2e-5
    assert (conv[written].double() - want_conv[written]).abs().max() < 2e-5
    others = torch.tensor([s for s in range(S) if s not in slots.flatten().tolist()])
    assert torch.equal(rec[others], rec0[others]) and torch.equal(conv[others], conv0[others])


def test_the_short_conv_update_writes_each_window_to_its_slot():
    """The conv window after position t == short_conv_step applied t + 1 times, in slots[b, t]:
    position 0's over the slot the sequence started from, read before it is overwritten."""
    from k3serve.layers.short_conv import short_conv_step
    from k3serve.kernels.triton.short_conv import short_conv_update

    g = torch.Generator().manual_seed(3)
    B, T, C = 2, 3, 3 * P
    u, w = torch.randn(B * T, C, generator=g), torch.randn(C, K, generator=g)
    pool = torch.randn(8, K - 1, C, generator=g)
    slots = torch.tensor([[2, 5, 7], [0, 1, 6]])
    start = pool[slots[:, 0]].clone()
    untouched = pool[[3, 4]].clone()
    out = short_conv_update(u, w, pool, slots)
    state, outs = start, []
    for t in range(T):
        y, state = short_conv_step(u.view(B, T, C)[:, t], w, state)
        outs.append(y)
        assert torch.allclose(pool[slots[:, t]], state, atol=1e-6, rtol=0)
    want = torch.stack(outs, 1).reshape(B * T, 3, C // 3).transpose(0, 1)
    assert torch.allclose(out, want, atol=1e-6, rtol=0)
    assert torch.equal(pool[[3, 4]], untouched)


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_the_triton_backends_prefill_equals_the_reference(kind, tiny_k3_dir, tiny_kl_dir, monkeypatch):
    """An eager step of two prefill chunks (one a new sequence, one resuming from its slot) and a
    decode row through the triton backend's varlen chunk_kda == the layer's reference: outputs
    and every state within fp32 summation-order noise, other slots untouched."""
    from k3serve.forward import CacheTensors, ForwardBatch
    from k3serve.layers.kda import KimiDeltaAttention
    from k3serve.models.registry import load_model

    prefill = kda.kda_prefill
    model = load_model(tiny_k3_dir if kind == "k3" else tiny_kl_dir, progress=False)
    layer = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    g = torch.Generator().manual_seed(5)
    cache = CacheTensors.allocate(model.cfg, 6, 16, 16, scratch=True)
    i = layer.layer_idx
    cache.recurrent[i].copy_(torch.randn(cache.recurrent[i].shape, generator=g) * 0.1)
    cache.conv[i].copy_(torch.randn(cache.conv[i].shape, generator=g))
    cache.recurrent[i][2], cache.conv[i][2] = 0.0, 0.0  # the new sequence's slot, as the model zeroes it
    lens, ctx, slots = [21, 1, 9], [0, 7, 30], [2, 4, 0]
    x = torch.randn(sum(lens), model.cfg.hidden_size, generator=g)
    tables = [[0, 1], [2], [3, 4, 5]]

    def run(mode):
        model.use_kernels(mode)
        c = CacheTensors(
            [t.clone() if t is not None else None for t in cache.recurrent],
            [t.clone() if t is not None else None for t in cache.conv],
            cache.latent,
            16,
            cache.scratch_slot,
            cache.scratch_block,
        )
        with torch.inference_mode():
            return layer(x, ForwardBatch(torch.zeros(sum(lens), dtype=torch.long), lens, ctx, slots, tables, 16), c), c

    calls = []
    monkeypatch.setattr(kda, "kda_prefill", lambda *a: calls.append(a[-1]) or prefill(*a))
    want, ref = run("torch")
    got, mine = run("triton")
    assert calls == [lens]  # one varlen chunk_kda call took every sequence
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()
    for name in ("recurrent", "conv"):
        a, b, before = getattr(mine, name)[i], getattr(ref, name)[i], getattr(cache, name)[i]
        assert (a - b).abs().max() <= 2e-5 * max(b.abs().max(), 1.0)
        assert torch.equal(a[[1, 3, 5]], before[[1, 3, 5]])  # slots the step does not name


def test_the_varlen_short_conv_equals_the_reference_per_sequence():
    """Prefill chunks of 7, 1 and 12 rows, each from its slot's window: the outputs and the window
    each slot keeps == layers/short_conv.py short_conv per sequence; other slots untouched."""
    from k3serve.kernels.triton.short_conv import short_conv_varlen
    from k3serve.layers.short_conv import short_conv

    g = torch.Generator().manual_seed(8)
    C, lens, slots = 3 * P, [7, 1, 12], torch.tensor([4, 0, 2])
    u, w = torch.randn(sum(lens), C, generator=g), torch.randn(C, K, generator=g)
    pool = torch.randn(6, K - 1, C, generator=g)
    before = pool.clone()
    out = short_conv_varlen(u, w, pool, slots, lens)
    start = 0
    for n, s in zip(lens, slots.tolist()):
        want, window = short_conv(u[start : start + n], w, before[s])
        assert torch.allclose(out[start : start + n], want, atol=1e-6, rtol=0)
        assert torch.allclose(pool[s], window, atol=1e-6, rtol=0)
        start += n
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])
