"""KDA through the Triton kernels (fla-core's fused recurrent kernel and our short-conv update)
== the graph backend's torch body, itself the reference's decode arithmetic: run in float64
(`kda_step`, the step `kda_recurrent` loops), against the kernels in fp32. Decode and verify
rows, ragged `last` positions, K3's lower-bound gate and Kimi-Linear's softplus gate, padding
rows on a shared scratch slot. Tolerances: 2e-5 absolute on outputs and states of magnitude ~1
(fp32 kernels against float64), and every slot the batch does not name bit-for-bit unchanged."""

from __future__ import annotations

import pytest
import torch

from k3serve.backends.graph_ops import BODIES
from k3serve.kernels.triton import kda

S, H, D, K = 9, 2, 16, 4
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


def reference(x, rec, conv, slots, last, T, lower_bound):
    """The graph body in float64 on copies: (o, rec records, conv records, rec, conv)."""
    rec, conv = rec.double(), conv.double()
    d = {k: v.double() for k, v in x.items()}
    decay = d.pop("a_log").exp().repeat_interleave(D)
    args = (d["u"], d["z"], d["b"], d["gate"], d["conv_w"], decay, d["dt_bias"], d["o_norm"], rec, conv, slots)
    if T == 1:
        return BODIES.kda_decode(*args, D, lower_bound, 1e-5), None, None, rec, conv
    o, rr, cr = BODIES.kda_verify(*args, last, D, lower_bound, 1e-5)
    return o, rr, cr, rec, conv


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3_gate", "kimi_linear_gate"])
@pytest.mark.parametrize("T", [1, 4], ids=["decode", "verify"])
def test_kda_kernels_equal_the_float64_reference(T, lower_bound):
    live = torch.tensor([5, 1, 6])
    slots = torch.cat((live, torch.tensor([SCRATCH, SCRATCH])))  # two padding rows share the scratch slot
    last = torch.tensor([T - 1, 0, min(2, T - 1), 0, 0])
    x, rec, conv = case(len(slots), T, seed=T)
    want_o, want_rr, want_cr, want_rec, want_conv = reference(x, rec, conv, slots, last, T, lower_bound)
    args = (x["u"], x["z"], x["b"], x["gate"], x["conv_w"], x["a_log"], x["dt_bias"], x["o_norm"])
    rec0, conv0 = rec.clone(), conv.clone()
    if T == 1:
        o = kda.kda_decode(*args, rec, conv, slots, D, lower_bound, 1e-5)
    else:
        o, rr, cr = kda.kda_verify(*args, rec, conv, slots, last, D, lower_bound, 1e-5)
        n = len(live)  # the padding rows' records share the scratch slot's racing state: unchecked
        assert (rr[:n].double() - want_rr[:n]).abs().max() < 2e-5
        assert (cr[:n].double() - want_cr[:n]).abs().max() < 2e-5
    rows = torch.arange(len(live) * T)  # the live sequences' rows
    assert (o[rows].double() - want_o[rows]).abs().max() < 2e-5
    assert (rec[live].double() - want_rec[live]).abs().max() < 2e-5
    assert (conv[live].double() - want_conv[live]).abs().max() < 2e-5
    others = torch.tensor([s for s in range(S) if s not in slots.tolist()])
    assert torch.equal(rec[others], rec0[others]) and torch.equal(conv[others], conv0[others])


def test_the_short_conv_update_records_every_window_and_keeps_the_last_live_one():
    """The conv windows after each position == short_conv_step applied position by position,
    and the pool slot keeps the window after `last` (a rolled-back verify's accepted prefix)."""
    from k3serve.layers.short_conv import short_conv_step
    from k3serve.kernels.triton.short_conv import short_conv_update

    g = torch.Generator().manual_seed(3)
    B, T, C = 2, 3, 3 * P
    u, w = torch.randn(B * T, C, generator=g), torch.randn(C, K, generator=g)
    pool = torch.randn(4, K - 1, C, generator=g)
    slots, last = torch.tensor([2, 0]), torch.tensor([1, 2])
    start = pool[slots].clone()
    out, rec = short_conv_update(u, w, pool, slots, last, record=True)
    state, outs = start, []
    for t in range(T):
        y, state = short_conv_step(u.view(B, T, C)[:, t], w, state)
        outs.append(y)
        assert torch.allclose(rec[:, t], state, atol=1e-6, rtol=0)
    want = torch.stack(outs, 1).reshape(B * T, 3, C // 3).transpose(0, 1)
    assert torch.allclose(out, want, atol=1e-6, rtol=0)
    assert torch.equal(pool[slots], rec[torch.arange(B), last])
