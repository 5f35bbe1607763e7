"""The decode-path CPU kernels (kda_decode, mla_decode, moe_route, moe_experts, rms_norm,
attnres_mix; k3serve/kernels/cpu) against the plain torch functions they replace, on random
shapes with ragged edges. Summation orders differ, so FP32 results are compared with stated
tolerances; batch invariance is bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve import kernels
from k3serve.config.model_config import MoEConfig
from k3serve.layers.activation import silu_and_mul, situ_and_mul
from k3serve.layers.attnres import attnres_mix
from k3serve.layers.experts import experts_forward
from k3serve.layers.kda_ops import flush_denormals, kda_step
from k3serve.layers.mla import attend_absorbed
from k3serve.layers.norm import l2_normalize, rms_norm
from k3serve.layers.router import route
from k3serve.layers.short_conv import short_conv_step
from k3serve.weights.mxfp4 import PackedMXFP4, decode_mxfp4

K = kernels.get("cpp")


def kda_inputs(g, S, lens, H, D, Kc, slots_total):
    N, P = sum(lens), H * D
    return dict(
        u=torch.randn(N, 3 * P, generator=g),
        conv_w=torch.randn(3 * P, Kc, generator=g) / 2,
        z=torch.randn(N, P, generator=g),
        b=torch.randn(N, H, generator=g),
        gate=torch.randn(N, P, generator=g),
        dt_bias=torch.randn(P, generator=g) / 4,
        a_log=torch.randn(H, generator=g) / 2,
        o_norm_w=torch.rand(D, generator=g) + 0.5,
        conv_state=torch.randn(slots_total, Kc - 1, 3 * P, generator=g),
        rec_state=torch.randn(slots_total, H, D, D, generator=g) / D,
    )


def kda_reference(a, slots, lens, lower_bound, eps, H, D):
    """Row by row with the torch decode functions (short_conv_step, kda_step, gated RMSNorm)."""
    conv, rec = a["conv_state"].clone(), a["rec_state"].clone()
    P = H * D
    y, recs, convs, r = torch.empty(a["u"].shape[0], P), [], [], 0
    A = a["a_log"].exp().repeat_interleave(D)
    for slot, n in zip(slots, lens):
        rs, cs = [], []
        for _ in range(n):
            c, conv[slot : slot + 1] = short_conv_step(a["u"][r : r + 1], a["conv_w"], conv[slot : slot + 1])
            q, k, v = c.view(1, 3, H, D).unbind(1)
            q, k = l2_normalize(q) * D**-0.5, l2_normalize(k)
            zz = a["z"][r : r + 1] + a["dt_bias"]
            gl = lower_bound * torch.sigmoid(A * zz) if lower_bound is not None else -A * F.softplus(zz)
            with flush_denormals():
                o, rec[slot : slot + 1] = kda_step(
                    q, k, v, gl.view(1, H, D), torch.sigmoid(a["b"][r : r + 1]), rec[slot : slot + 1]
                )
            y[r] = (rms_norm(o, a["o_norm_w"], eps) * torch.sigmoid(a["gate"][r].view(1, H, D))).reshape(-1)
            rs.append(rec[slot].clone())
            cs.append(conv[slot].clone())
            r += 1
        recs.append(rs)
        convs.append(cs)
    return y, conv, rec, recs, convs


@pytest.mark.parametrize("seed,lower_bound", [(0, -5.0), (1, None), (2, -5.0), (3, None)])
def test_kda_decode_equals_the_torch_steps(seed, lower_bound):
    g = torch.Generator().manual_seed(seed)
    H, D, Kc = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(3, 20, (1,), generator=g)), 4
    S = int(torch.randint(1, 5, (1,), generator=g))
    lens = torch.randint(1, 5, (S,), generator=g).tolist()  # verify-like runs of several rows
    check_kda_decode(g, H, D, Kc, lens, lower_bound)


@pytest.mark.parametrize(
    "D,Kc,lower_bound", [(16, 4, -5.0), (32, 4, None), (64, 4, -5.0), (128, 4, None), (32, 3, -5.0), (48, 4, None)]
)
def test_kda_decode_vector_paths_equal_the_torch_steps(D, Kc, lower_bound):
    """Head sizes of 16 n take the register forms (the 4-tap conv 16 channels at a time, the
    delta rule's sums in registers; 48 only the conv), a 3-tap conv the scalar loop beside them."""
    g = torch.Generator().manual_seed(D + Kc)
    check_kda_decode(g, 2, D, Kc, [5, 1, 3], lower_bound)


def check_kda_decode(g, H, D, Kc, lens, lower_bound):
    S = len(lens)
    slots = torch.randperm(8, generator=g)[:S].tolist()
    a = kda_inputs(g, S, lens, H, D, Kc, 8)
    y_ref, conv_ref, rec_ref, recs, convs = kda_reference(a, slots, lens, lower_bound, 1e-5, H, D)
    T = max(lens)
    rec_buf, conv_buf = torch.zeros(S, T, H, D, D), torch.zeros(S, T, Kc - 1, 3 * H * D)
    starts = torch.tensor([0] + lens).cumsum(0)
    lb = float("nan") if lower_bound is None else lower_bound
    y = K.kda_decode(
        **a, slots=torch.tensor(slots), starts=starts, lower_bound=lb, eps=1e-5, rec_buf=rec_buf, conv_buf=conv_buf
    )  # updates a's states in place
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a["rec_state"], rec_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a["conv_state"], conv_ref, rtol=0, atol=0)  # a shift: exact
    for j, n in enumerate(lens):
        for t in range(n):
            torch.testing.assert_close(rec_buf[j, t], recs[j][t], rtol=1e-5, atol=1e-6)
            assert torch.equal(conv_buf[j, t], convs[j][t])


def test_kda_decode_rows_do_not_depend_on_batch_mates():
    g = torch.Generator().manual_seed(5)
    a = kda_inputs(g, 3, [1, 1, 1], 2, 16, 4, 4)
    alone = {k: v[1:2].clone() if k in ("u", "z", "b", "gate") else v.clone() for k, v in a.items()}
    full = K.kda_decode(
        **a, slots=torch.tensor([0, 2, 3]), starts=torch.tensor([0, 1, 2, 3]), lower_bound=-5.0, eps=1e-5
    )
    one = K.kda_decode(**alone, slots=torch.tensor([2]), starts=torch.tensor([0, 1]), lower_bound=-5.0, eps=1e-5)
    assert torch.equal(full[1], one[0]) and torch.equal(a["rec_state"][2], alone["rec_state"][2])


def test_kda_decode_refuses_bad_arguments_by_name():
    g = torch.Generator().manual_seed(0)
    a = kda_inputs(g, 1, [2], 2, 8, 4, 2)
    with pytest.raises(RuntimeError, match="state slot 5 out of range"):
        K.kda_decode(**a, slots=torch.tensor([5]), starts=torch.tensor([0, 2]), lower_bound=-5.0, eps=1e-5)
    with pytest.raises(RuntimeError, match="starts must run from 0 to N"):
        K.kda_decode(**a, slots=torch.tensor([0]), starts=torch.tensor([0, 1]), lower_bound=-5.0, eps=1e-5)
    a["u"] = a["u"].double()
    with pytest.raises(RuntimeError, match="u must be float32"):
        K.kda_decode(**a, slots=torch.tensor([0]), starts=torch.tensor([0, 2]), lower_bound=-5.0, eps=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("seed", range(3))
def test_mla_decode_equals_absorbed_attention(seed, cache_dtype):
    g = torch.Generator().manual_seed(seed)
    H, n, r, c, v, block = 3, 8, 4, 16, 8, 4
    blocks = 12
    cache = (torch.randn(blocks * block, c + r, generator=g) / 2).to(cache_dtype)
    w_kv_b = torch.randn(H, n + v, c, generator=g) / 4
    tables = [torch.randperm(blocks, generator=g)[:3].tolist(), torch.randperm(blocks, generator=g)[:2].tolist()]
    positions = [[9], [2, 3, 4, 5]]  # one decode, one verify run of four rows crossing a block edge
    q = torch.randn(5, H, n + r, generator=g)
    seq = torch.tensor([0, 1, 1, 1, 1])
    pos = torch.tensor([p for ps in positions for p in ps])
    table = torch.tensor([tables[0], tables[1] + [-1]])
    got = K.mla_decode(q, n, cache, w_kv_b, table, seq, pos, block, 0.3)
    for i in range(5):
        t, p = tables[int(seq[i])], int(pos[i])
        rows = torch.tensor([t[j // block] * block + j % block for j in range(p + 1)])
        lat = cache[rows].float()
        ref = attend_absorbed(q[i : i + 1, :, :n], q[i : i + 1, :, n:], lat[:, :c], lat[:, c:], w_kv_b, v, p, 0.3)
        torch.testing.assert_close(got[i], ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_over_long_contexts_equals_absorbed_attention(cache_dtype):
    """Contexts of many 16-position steps and a ragged last one (the online softmax rescales its
    running sums as the peak moves), latent rows of a width off the 16-lane step (c + r = 40),
    queries whose scores rise late in the context; and a row's output has the same bits alone."""
    g = torch.Generator().manual_seed(5)
    H, n, r, c, v, block = 4, 8, 8, 32, 16, 16
    blocks = 24
    cache = (torch.randn(blocks * block, c + r, generator=g) / 2).to(cache_dtype)
    cache[-5:] *= 6  # the last rows of the table dominate: the peak moves late
    w_kv_b = torch.randn(H, n + v, c, generator=g) / 4
    table = torch.randperm(blocks, generator=g)[None]
    pos = torch.tensor([17, 100, 255, 383])  # 18, 101, 256 and 384 positions
    q = torch.randn(4, H, n + r, generator=g)
    seq = torch.zeros(4, dtype=torch.long)
    got = K.mla_decode(q, n, cache, w_kv_b, table, seq, pos, block, 0.25)
    t = table[0].tolist()
    for i in range(4):
        p = int(pos[i])
        rows = torch.tensor([t[j // block] * block + j % block for j in range(p + 1)])
        lat = cache[rows].float()
        ref = attend_absorbed(q[i : i + 1, :, :n], q[i : i + 1, :, n:], lat[:, :c], lat[:, c:], w_kv_b, v, p, 0.25)
        torch.testing.assert_close(got[i], ref[0], rtol=1e-5, atol=1e-5)
        alone = K.mla_decode(q[i : i + 1].clone(), n, cache, w_kv_b, table, seq[:1], pos[i : i + 1], block, 0.25)
        assert torch.equal(alone[0], got[i])


def test_mla_decode_refuses_rows_outside_their_table():
    cache, w = torch.zeros(16, 20), torch.zeros(2, 16, 16)
    q = torch.zeros(1, 2, 12)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        K.mla_decode(q, 8, cache, w, torch.tensor([[0]]), torch.tensor([0]), torch.tensor([4]), 4, 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        K.mla_decode(q, 8, cache, w, torch.tensor([[9]]), torch.tensor([0]), torch.tensor([1]), 4, 1.0)


def route_cfg(groups: int, keep: int, act: str) -> MoEConfig:
    """16 experts, top 4, scaling 2.5: the route ops' test router."""
    return MoEConfig(
        num_experts=16,
        top_k=4,
        num_shared_experts=0,
        expert_intermediate_size=8,
        latent_size=None,
        latent_use_norm=False,
        router_activation=act,
        renormalize=True,
        routed_scaling_factor=2.5,
        num_expert_group=groups,
        topk_group=keep,
        first_k_dense_replace=0,
        layer_freq=1,
    )


@pytest.mark.parametrize("groups,keep,act", [(1, 1, "sigmoid"), (4, 2, "sigmoid"), (1, 1, "softmax")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route_equals_the_router(groups, keep, act, dtype):
    g = torch.Generator().manual_seed(groups + keep)
    cfg = route_cfg(groups, keep, act)
    x, w, bias = (
        torch.randn(11, 24, generator=g).to(dtype),
        torch.randn(16, 24, generator=g).to(dtype),
        torch.randn(16, generator=g) / 10,
    )
    ids_ref, w_ref = route(x, w, bias, cfg)
    ids, wts = K.moe_route(x, w, bias, 4, act == "sigmoid", True, 2.5, groups, keep)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(wts, w_ref, rtol=1e-5, atol=1e-6)


def panels(w: PackedMXFP4) -> torch.Tensor:
    """an fp32 model's cache-resident packed experts as the model hands them over (layers/common.py
    kernel_experts): decoded, in panel form where this build reads it (else dense fp32)"""
    return K.expert_panel_form(w.dequantize(torch.float32).contiguous())


@pytest.mark.parametrize("kind", ["mxfp4", "mxfp4-bf16", "mxfp4-panels", "fp32", "bf16"])
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_moe_experts_equals_the_torch_experts(kind, act):
    """mxfp4: FP32 activations (FP32 dots); mxfp4-bf16: a bf16 model's (bf16 dots on rows decoded
    to bf16, rounding where torch's bf16 path rounds); mxfp4-panels: w1 and w3 as fp32 panels
    (inter = 96: six), w2 (40 rows, no whole panel) dense; h = 96 leaves a lone 32-group after the
    64-column steps, inter = 96 too; expert 1's six tokens fill 3 x 4 tiles raggedly, the others'
    one or two take the 1-row tiles (and, packed, the in-register decode)."""
    g = torch.Generator().manual_seed(len(kind) + len(act))
    E, h, inter, out, T, k = 6, 96, 96, 40, 9, 2
    dense = [
        torch.randn(E, inter, h, generator=g) / 8,
        torch.randn(E, inter, h, generator=g) / 8,
        torch.randn(E, out, inter, generator=g) / 6,
    ]
    fn = (lambda a, b: situ_and_mul(a, b, 4.0, 25.0)) if act == "situ" else silu_and_mul
    x = torch.randn(T, h, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[1] = ids[2]  # two tokens share experts
    for t in range(3, 9):  # and one expert serves six (3-row tiles from 6 tokens up)
        ids[t] = torch.tensor([1, 2 + t % 4])
    weights = torch.rand(T, k, generator=g)
    bf16 = kind in ("bf16", "mxfp4-bf16")
    if kind == "mxfp4-panels":
        w1, w3, w2 = (PackedMXFP4.quantize(d) for d in dense)
        args, ref_x = [panels(w1), None, panels(w3), None, panels(w2), None], x
        assert args[4].dim() == 3 and (args[0].dim() == 4) == ("avx512" in K.simd())
    elif kind.startswith("mxfp4"):
        w1, w3, w2 = (PackedMXFP4.quantize(d) for d in dense)
        args, ref_x = (
            [w1.packed, w1.scale, w3.packed, w3.scale, w2.packed, w2.scale],
            x.to(torch.bfloat16 if bf16 else torch.float32),
        )
    else:
        dt = torch.float32 if kind == "fp32" else torch.bfloat16
        w1, w3, w2 = (d.to(dt) for d in dense)
        args, ref_x = [w1, None, w3, None, w2, None], x.to(dt)
    ref = experts_forward(ref_x, ids, weights, w1, w2, w3, fn)  # the torch path (no kernels)
    got = K.moe_experts(ref_x.float(), ids, weights, *args, int(act == "situ"), 4.0, 25.0, bf16)
    tol = 2e-2 if bf16 else 1e-5  # bf16: both round at the same steps; an ulp flip moves 1/128
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["mxfp4", "mxfp4-bf16", "mxfp4-panels", "bf16"])
def test_moe_experts_rows_do_not_depend_on_batch_mates(kind):
    """Alone, a token's expert rows meet it in 1-token tiles (FP32 MXFP4: decoded inside the
    dot); shared, in 4-token tiles of a staged row. Both must give the same bits (K = 96 leaves
    a lone 32-group after the 64-column steps, I = 32 only that group). mxfp4-bf16 also has one
    w1 row whose scale does not fold into bf16 (its FP32 fallback) in the shared expert."""
    g = torch.Generator().manual_seed(9)
    dense = [
        torch.randn(4, 32, 96, generator=g),
        torch.randn(4, 32, 96, generator=g),
        torch.randn(4, 96, 32, generator=g),
    ]
    x, ids, wt = torch.randn(9, 96, generator=g), torch.randint(0, 4, (9, 1), generator=g), torch.rand(9, 1)
    ids[0] = ids[2] = ids[5] = ids[7] = ids[8]  # token 2's expert is shared by five in the full batch
    if kind == "mxfp4-panels":  # fp32 panels: each output one FMA chain, whatever its tile
        args = [t for d in dense for t in (panels(PackedMXFP4.quantize(d)), None)]
    elif kind.startswith("mxfp4"):
        packed = [PackedMXFP4.quantize(d) for d in dense]
        if kind == "mxfp4-bf16":
            packed[0].scale[ids[2, 0], 7, 1] = 1  # 2^-126: folding would make bf16 denormals
            x = x.bfloat16().float()
        args = [t for p in packed for t in (p.packed, p.scale)]
    else:
        args = [t for d in dense for t in (d.bfloat16(), None)]
    args += [1, 4.0, 25.0, kind != "mxfp4"]
    full = K.moe_experts(x, ids, wt, *args)
    one = K.moe_experts(x[2:3].clone(), ids[2:3].clone(), wt[2:3].clone(), *args)
    assert torch.equal(full[2], one[0])


@pytest.mark.parametrize("kind", ["mxfp4", "mxfp4-bf16", "mxfp4-panels", "bf16"])
def test_experts_split_over_threads_by_cost_give_one_threads_bits(kind):
    """moe_fused.cpp for_expert_items: a layer large enough for two chunks splits its (expert,
    row) items where the estimated cost halves, here inside expert 0, which meets 14 of the 16
    tokens (skewed routing). Every item runs exactly once and no bit moves: two threads equal
    one, and the result matches the torch experts."""
    g = torch.Generator().manual_seed(21)
    E, h, inter, out, T = 8, 256, 96, 72, 16  # 8 x 96 gate/up items, 8 x 72 down items: two chunks each
    dense = [
        torch.randn(E, inter, h, generator=g) / 16,
        torch.randn(E, inter, h, generator=g) / 16,
        torch.randn(E, out, inter, generator=g) / 9,
    ]
    ids = torch.stack([torch.tensor([0 if t < 14 else 1 + t % 7, 1 + t % 7 if t < 14 else 0]) for t in range(T)])
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 1] + 1) % E, ids[:, 1])
    wt, x = torch.rand(T, 2, generator=g), torch.randn(T, h, generator=g).bfloat16().float()
    bf16 = kind != "mxfp4"
    if kind == "bf16":
        w = [d.bfloat16() for d in dense]
        args = [t for d in w for t in (d, None)]
    else:
        w = [PackedMXFP4.quantize(d) for d in dense]
        args = (
            [t for p in w for t in (panels(p), None)]
            if kind == "mxfp4-panels"
            else [t for p in w for t in (p.packed, p.scale)]
        )
    args += [0, 0.0, 0.0, bf16]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = K.moe_experts(x, ids, wt, *args)
        torch.set_num_threads(2)
        two = K.moe_experts(x, ids, wt, *args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    ref_x = x.bfloat16() if bf16 else x
    ref = experts_forward(ref_x, ids, wt, w[0], w[2], w[1], silu_and_mul)
    tol = 2e-2 if bf16 else 1e-5
    torch.testing.assert_close(two, ref.float(), rtol=tol, atol=tol)


@pytest.mark.skipif("avx512" not in K.simd(), reason="fp32 panels are read with AVX-512 only")
def test_an_fp32_models_small_experts_become_panels_and_others_stay_packed():
    """kernels/packs.py kernel_experts: an fp32 model's experts whose fp32 form fits in 1 MB a
    matrix as fp32 panels holding the MXFP4 values exactly; a bf16 model's, or larger ones (a
    4-bit checkpoint's traffic is its packed bytes), stay packed."""
    from k3serve.kernels.packs import kernel_experts
    from k3serve.layers.expert_weights import ExpertWeights

    def experts(E, O, I):
        w = ExpertWeights(E, O, I)
        w.load(PackedMXFP4.quantize(torch.randn(E, O, I, generator=torch.Generator().manual_seed(E))))
        return w

    small, big = experts(8, 64, 64), experts(32, 128, 128)  # 128 KB and 2 MB as fp32
    p, none = kernel_experts(small, K, fp32_model=True)
    assert none is None and p.shape == (8, 4, 64, 16)
    assert torch.equal(p.transpose(2, 3).reshape(8, 64, 64), small.value.dequantize(torch.float32))
    assert kernel_experts(small, K, fp32_model=False) == [small.packed, small.scale]
    assert kernel_experts(big, K, fp32_model=True) == [big.packed, big.scale]
    assert kernel_experts(small, None, fp32_model=True) == [small.packed, small.scale]


needs_bf16_dot = pytest.mark.skipif(not K.has_bf16_dot(), reason="this CPU build has no AVX512-BF16 route")


@needs_bf16_dot
def test_mxfp4_tiles_of_every_width_give_the_same_bits():
    """Tokens sharing an expert 1 to 4 at a time meet its packed rows in in-register tiles (4 rows
    side by side for 1-2 tokens, 2 for 3-4, the rows left over in smaller tiles), 8 at a time in
    staged 3-row tiles: every token's output has the same bits each way. K = 160 leaves a lone
    32-group after two 64-column blocks; w2's 38 rows are a multiple of no tile."""
    g = torch.Generator().manual_seed(11)
    dense = [
        torch.randn(2, 64, 160, generator=g),
        torch.randn(2, 64, 160, generator=g),
        torch.randn(2, 38, 64, generator=g),
    ]
    args = [t for d in dense for t in (lambda p: (p.packed, p.scale))(PackedMXFP4.quantize(d))] + [1, 4.0, 25.0, True]
    x = torch.randn(8, 160, generator=g).bfloat16().float()
    ids, wt = torch.zeros(8, 1, dtype=torch.long), torch.rand(8, 1, generator=g)
    full = K.moe_experts(x, ids, wt, *args)  # 8 tokens on expert 0: staged tiles
    for n in (1, 2, 3, 4):
        part = K.moe_experts(x[:n].clone(), ids[:n].clone(), wt[:n].clone(), *args)
        assert torch.equal(part, full[:n]), n


def nib64(cols: int) -> torch.Tensor:
    """The column order of the bf16 MXFP4 route (simd.h mxfp4_order_bf16), written out again: per
    64 columns two halves of 32, half h taking from each 128-bit lane k = 0..3 its columns
    8h .. 8h + 7 of: the first 32-group's evens (lane 0), the second's evens (1), the first's
    odds (2), the second's odds (3); a lone last group its evens 0-14, odds 1-15, evens 16-30,
    odds 17-31."""
    order = []
    for b in range(0, cols - cols % 64, 64):
        lanes = [
            [b + 2 * i for i in range(16)],
            [b + 32 + 2 * i for i in range(16)],
            [b + 2 * i + 1 for i in range(16)],
            [b + 33 + 2 * i for i in range(16)],
        ]
        for h in range(2):
            for lane in lanes:
                order += lane[8 * h : 8 * h + 8]
    if cols % 64:
        b = cols - 32
        order += [b + 2 * i for i in range(8)] + [b + 2 * i + 1 for i in range(8)]
        order += [b + 16 + 2 * i for i in range(8)] + [b + 17 + 2 * i for i in range(8)]
    return torch.tensor(order)


@needs_bf16_dot
@pytest.mark.parametrize("cols", [32, 64, 96, 1088, 2080])
def test_mxfp4_rows_decode_to_bf16_exactly(cols):
    """Scales folded into bf16 exponents over the whole foldable range [2, 252] give decode_mxfp4's
    bf16 values bit for bit (signed zeros included); rows with a scale outside it (bf16 denormals,
    overflow, NaN) are refused, to be computed in FP32. 1088 and 2080 columns span more than one
    register of scales (32 groups) and end on a lone group or a partial register."""
    g = torch.Generator().manual_seed(cols)
    rows = 40
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(2, 253, (rows, cols // 32), dtype=torch.uint8, generator=g)
    scale[0] = 2
    scale[1] = 252
    bad = {3: 0, 4: 1, 5: 253, 6: 255}
    for r, v in bad.items():
        scale[r, -1] = v
    got, folded = K.mxfp4_rows_bf16(packed, scale)
    assert folded.tolist() == [r not in bad for r in range(rows)]
    want = decode_mxfp4(packed, scale, torch.bfloat16)[:, nib64(cols)]
    ok = folded.nonzero().squeeze(1)
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_a_float64_matmul_on_ragged_shapes(dtype):
    """The small-M linear (GEMV / 3 x 4 bf16 tiles): every M up to the GEMV limit, widths off the
    64-column step and row counts off the 3-row tile, against float64; bf16 outputs within one
    bf16 rounding of the exact sum (the products are exact, FP32 sums), FP32 within 1e-5. A row's
    result does not depend on the other rows (bitwise)."""
    g = torch.Generator().manual_seed(3)
    for K_, N in [(1, 1), (31, 2), (64, 7), (95, 50), (130, 3), (1024, 8)]:
        w = torch.randn(N, K_, generator=g).to(dtype)
        x = torch.randn(16, K_, generator=g).to(dtype)
        exact = x.double() @ w.double().t()
        for M in range(1, 17):
            got = K.linear(x[:M].contiguous(), w)
            assert got.dtype == dtype and got.shape == (M, N)
            bound = exact[:M].abs() * (2**-8 if dtype == torch.bfloat16 else 1e-5) + 1e-5 * (K_**0.5)
            assert ((got.double() - exact[:M]).abs() <= bound).all(), (K_, N, M)
            assert torch.equal(got[M - 1], K.linear(x[M - 1 : M].contiguous(), w)[0])


def test_fp32_panels_equal_a_float64_matmul_on_ragged_shapes():
    """The fp32 panel form (kernels/cpu/core/panels.h) through the linear: panel counts leaving 4-,
    2- and 1-panel tails after the 8- and 4-panel tiles, every M up to the GEMV limit (6-token
    tiles and each remainder), K off any step, against float64 within 1e-5 relative (one FMA
    chain per output). A row's result does not depend on the other rows (bitwise); past the
    GEMV sizes the linear is torch's on the unpacked matrix, equal to the matrix's own."""
    g = torch.Generator().manual_seed(4)
    for K_, N in [(1, 16), (37, 48), (64, 112), (130, 208), (256, 16 * 15)]:
        w = torch.randn(N, K_, generator=g)
        panels = w.reshape(N // 16, 16, K_).transpose(1, 2).contiguous()
        form = K.panel_form(w)
        if K.simd().startswith("avx512"):  # the builds that take the form
            assert torch.equal(form, panels)
        else:
            assert form is w
        x = torch.randn(17, K_, generator=g)
        exact = x.double() @ w.double().t()
        for M in range(1, 17):
            got = K.linear(x[:M].contiguous(), panels)
            assert got.shape == (M, N)
            bound = exact[:M].abs() * 1e-5 + 1e-5 * (K_**0.5)
            assert ((got.double() - exact[:M]).abs() <= bound).all(), (K_, N, M)
            assert torch.equal(got[M - 1], K.linear(x[M - 1 : M].contiguous(), panels)[0])
        assert torch.equal(K.linear(x, panels), K.linear(x, w))  # 17 rows: torch's GEMM
    with pytest.raises(RuntimeError, match="panels"):
        K.linear(torch.randn(2, 8), torch.randn(1, 8, 8))
    with pytest.raises(RuntimeError, match="panels"):
        K.linear(torch.randn(2, 8).bfloat16(), torch.randn(1, 8, 16).bfloat16())


@pytest.mark.skipif(not K.has_bf16_dot(), reason="bf16 panels are the vdpbf16ps builds' form")
def test_bf16_panels_equal_a_float64_matmul_on_ragged_shapes():
    """The bf16 panel form (column pairs for vdpbf16ps): every M up to the GEMV limit (8-token
    tiles and each remainder, their 8/6/4/3-panel tiles and 4/2/1 tails), against float64 within
    one bf16 rounding of the output (exact products, FP32 sums); bitwise batch invariance; past
    the GEMV sizes, torch's GEMM on the unpacked matrix. Odd K, or past 64 MB, stays a matrix;
    a 2 MB one (a 400 M model's projection, which gains at a batch's rows) takes the form."""
    g = torch.Generator().manual_seed(5)
    for K_, N in [(2, 16), (38, 48), (64, 112), (130, 208), (512, 16 * 15)]:
        w = torch.randn(N, K_, generator=g).bfloat16()
        panels = K.panel_form(w)
        assert panels.shape == (N // 16, K_ // 2, 16, 2)
        assert torch.equal(panels.permute(0, 2, 1, 3).reshape(N, K_), w)
        x = torch.randn(17, K_, generator=g).bfloat16()
        exact = x.double() @ w.double().t()
        for M in range(1, 17):
            got = K.linear(x[:M].contiguous(), panels)
            assert got.dtype == torch.bfloat16 and got.shape == (M, N)
            bound = exact[:M].abs() * 2**-8 + 1e-5 * (K_**0.5)
            assert ((got.double() - exact[:M]).abs() <= bound).all(), (K_, N, M)
            assert torch.equal(got[M - 1], K.linear(x[M - 1 : M].contiguous(), panels)[0])
        assert torch.equal(K.linear(x, panels), K.linear(x, w))
    odd, huge = torch.randn(32, 7).bfloat16(), torch.empty(16400, 2048, dtype=torch.bfloat16)  # huge: past 64 MB
    assert K.panel_form(odd) is odd and K.panel_form(huge) is huge
    mid = torch.randn(1024, 1024, generator=g).bfloat16()  # 2 MB
    assert torch.equal(K.panel_form(mid).permute(0, 2, 1, 3).reshape(1024, 1024), mid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_attnres_mix_equal_their_torch_forms(dtype):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 48, generator=g).to(dtype) * 3, (torch.rand(48, generator=g) + 0.5).to(dtype)
    ulp = 0 if dtype == torch.float32 else 2**-7  # bf16: an ulp where the fp32 sums round differently
    torch.testing.assert_close(
        K.rms_norm(x, w, 1e-5).float(), rms_norm(x, w, 1e-5).float(), rtol=max(ulp, 1e-6), atol=1e-6
    )
    cands = [torch.randn(7, 48, generator=g).to(dtype) for _ in range(4)]
    v = torch.randn(48, generator=g)
    torch.testing.assert_close(
        K.attnres_mix(cands, v, 1e-5).float(), attnres_mix(cands, v, 1e-5).float(), rtol=max(ulp, 1e-5), atol=1e-5
    )


@pytest.mark.parametrize("act", ["silu", "situ", "situ_plain_up"])
def test_vector_glu_matches_torch_across_the_whole_range(act):
    """The GLU kernel's vector exp / tanh / sigmoid (kernels/cpu/core/simd.h) against torch's, fp32,
    on values from 1e-30 to 1e4 of both signs (the small-|x| tanh series, its switch to e^x - 1,
    the +-1 clamp past 9, exp's clamps), a NaN, and a length that leaves a masked tail."""
    g = torch.Generator().manual_seed(3)
    mags = torch.logspace(-30, 4, 997)
    grid = torch.cat([mags, -mags, torch.tensor([0.0, 0.25, -0.25, 0.2499, 8.99, 9.01, -9.01, 88.5, -88.5])])
    gate = grid[torch.randperm(grid.numel(), generator=g)].reshape(1, -1)
    up = grid[torch.randperm(grid.numel(), generator=g)].reshape(1, -1)
    gate[0, 5], up[0, 7] = float("nan"), float("nan")
    if act == "silu":
        want, code, beta, lb = silu_and_mul(gate, up), 0, 0.0, 0.0
    else:
        lb = 25.0 if act == "situ" else 0.0
        want, code, beta = situ_and_mul(gate, up, 4.0, lb or None), 1, 4.0
    got = K.glu(gate, up, code, beta, lb)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=2e-6, atol=1e-37)
    half = K.glu(gate.bfloat16(), up.bfloat16(), code, beta, lb)  # rounds like c10::BFloat16, NaN kept
    ref = (silu_and_mul if act == "silu" else (lambda a, b: situ_and_mul(a, b, 4.0, lb or None)))(
        gate.bfloat16(), up.bfloat16()
    )
    assert torch.equal(torch.isnan(half), torch.isnan(ref))
    torch.testing.assert_close(half.float()[~torch.isnan(ref)], ref.float()[~torch.isnan(ref)], rtol=8e-3, atol=1e-37)


@pytest.mark.parametrize("groups,keep", [(1, 1), (4, 2)])
def test_both_compiled_route_ops_take_route_scalars_order(groups, keep):
    """The C++ op and the graph op read the router's settings in one order (layers/router.py
    route_scalars; they once put scaling on either side of the groups): each, given those
    settings, equals the router. A scaling of 2.5 and groups 4 / keep 2 would not survive a swap."""
    from k3serve.backends.graph_ops import OPS
    from k3serve.layers.router import route_scalars

    g = torch.Generator().manual_seed(7 + groups)
    cfg = route_cfg(groups, keep, "sigmoid")
    x, w, bias = torch.randn(9, 24, generator=g), torch.randn(16, 24, generator=g), torch.randn(16, generator=g) / 10
    ids_ref, w_ref = route(x, w, bias, cfg)
    for op in (K.moe_route, OPS.moe_route):
        ids, wts = op(x, w, bias, *route_scalars(cfg))
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(wts, w_ref, rtol=1e-5, atol=1e-6)
