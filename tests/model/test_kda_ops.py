"""KDA core: chunked == recurrent == fla's reference functions; conv state carry-over."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3serve.layers.kda_ops import kda_chunked, kda_recurrent, kda_step
from k3serve.layers.norm import l2_normalize
from k3serve.layers.short_conv import short_conv, short_conv_step


def _load_fla_naive():
    import importlib.machinery

    finder = importlib.machinery.PathFinder.find_spec("fla")
    assert finder is not None, "fla-core is a test dependency"
    path = Path(finder.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(T, H=3, D=16, seed=0, form="bounded", scale=3.0):
    g_ = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(T, H, D, generator=g_)) * D**-0.5
    k = l2_normalize(torch.randn(T, H, D, generator=g_))
    v = torch.randn(T, H, D, generator=g_)
    z = torch.randn(T, H, D, generator=g_) * scale
    a = torch.rand(H, 1, generator=g_) * 15 + 1
    g = -5.0 * torch.sigmoid(a * z) if form == "bounded" else -a * F.softplus(z)
    beta = torch.sigmoid(torch.randn(T, H, generator=g_))
    s0 = torch.randn(H, D, D, generator=g_)
    return q, k, v, g, beta, s0


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("form", ["bounded", "softplus"])
@pytest.mark.parametrize("T", [1, 37, 64, 65, 130, 200])
def test_chunked_equals_recurrent(T, form):
    q, k, v, g, beta, s0 = inputs(T, form=form, seed=T)
    o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2 = kda_chunked(q, k, v, g, beta, s0)
    assert rel(o2, o1) <= 1e-5 and rel(s2, s1) <= 1e-5


def test_extreme_decay_uses_safe_path():
    """Unbounded decay of ~-60 per step: sub-block spans far exceed FP32 exp range."""
    q, k, v, g, beta, s0 = inputs(128, form="softplus", scale=40.0, seed=9)
    assert g.min() < -50
    o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2 = kda_chunked(q, k, v, g, beta, s0)
    assert torch.isfinite(o2).all() and rel(o2, o1) <= 1e-5 and rel(s2, s1) <= 1e-5


@pytest.mark.parametrize("form", ["bounded", "softplus"])
def test_matches_fla_reference_functions(form):
    fla = _load_fla_naive()
    q, k, v, g, beta, s0 = inputs(128, form=form, seed=5)
    o_ref, s_ref = fla.naive_recurrent_kda(
        q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=s0[None], output_final_state=True
    )
    o_chunk_ref, s_chunk_ref = fla.naive_chunk_kda(
        q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=s0[None], output_final_state=True
    )
    o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2 = kda_chunked(q, k, v, g, beta, s0)
    for o, s in ((o1, s1), (o2, s2)):
        assert rel(o, o_ref[0]) <= 1e-5 and rel(s, s_ref[0]) <= 1e-5
        assert rel(o, o_chunk_ref[0]) <= 1e-5 and rel(s, s_chunk_ref[0]) <= 1e-5


def test_batched_step_equals_single_steps():
    q, k, v, g, beta, s0 = inputs(4, seed=2)  # treat the 4 tokens as a batch of 4 sequences
    states = torch.stack([s0, 2 * s0, -s0, 0 * s0])
    o, s = kda_step(q, k, v, g, beta, states)
    for b in range(4):
        o1, s1 = kda_recurrent(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], states[b])
        assert torch.allclose(o[b], o1[0], atol=1e-6) and torch.allclose(s[b], s1, atol=1e-6)


def test_conv_prefill_then_decode_equals_longer_prefill():
    g_ = torch.Generator().manual_seed(0)
    u, w = torch.randn(20, 12, generator=g_), torch.randn(12, 4, generator=g_)
    full, state_full = short_conv(u, w, torch.zeros(3, 12))
    part, state = short_conv(u[:13], w, torch.zeros(3, 12))
    outs = [part]
    for t in range(13, 20):
        o, state = short_conv_step(u[t : t + 1], w, state[None])
        state = state[0]
        outs.append(o)
    assert torch.allclose(torch.cat(outs), full, atol=1e-6) and torch.equal(state, state_full)
    # direct transcription of spec §3.2: c_t = SiLU(sum_j w[:, j] u_{t-3+j}), u_{<0} = 0
    padded = torch.cat((torch.zeros(3, 12), u))
    ref = torch.stack([F.silu(sum(w[:, j] * padded[t + j] for j in range(4))) for t in range(20)])
    assert torch.allclose(full, ref, atol=1e-6)


def test_flush_denormals_is_scoped():
    from k3serve.layers.kda_ops import flush_denormals

    tiny = torch.tensor([1e-39])
    with flush_denormals():
        assert (tiny * 1.0).item() == 0.0
    assert (tiny * 1.0).item() > 0.0  # MXFP4 scales down to 2^-127 need denormals
