"""The model with its compiled CPU kernels (use_kernels("cpp"): decode/verify blocks, MoE blocks,
norms, AttnRes mix) against the same model on the plain torch path (use_kernels("torch")),
over prefill, batched decode, a verify pass beside a decode, and a step mixing decode rows with
a prefill chunk. Summation orders differ, so logits and states are compared with tolerances.

FP32: the whole run, logits and states within 1e-4. BF16: block by block along the torch path's
own run (each decoder block's kernel form gets the same input and a copy of the same cache as
its torch form), within one bf16 ulp of the block output's scale. A whole bf16 run cannot be
compared tightly: a 1-ulp difference flips a near-tie in some later token's expert choice, and
this random tiny model then moves by most of its logit scale (its torch bf16 run alone sits up
to 80% of the scale from its fp32 run); how far depends on the CPU's bf16 GEMM."""

from __future__ import annotations

import pytest
import torch

from k3serve import kernels
from k3serve.models.registry import load_model
from k3serve.backends import TORCH
from k3serve.backends.cpu import CpuKernels
from k3serve.forward import CacheTensors, ForwardBatch

BS = 16


@pytest.fixture(
    scope="module",
    params=[("k3", torch.float32), ("k3", torch.bfloat16), ("kl", torch.float32), ("kl", torch.bfloat16)],
    ids=["k3-fp32", "k3-bf16", "kl-fp32", "kl-bf16"],
)
def model(request, tiny_k3_dir, tiny_kl_dir):
    kind, dtype = request.param
    return load_model(tiny_k3_dir if kind == "k3" else tiny_kl_dir, dtype=dtype, progress=False)


def script(model, mode):
    """The same sequence of steps with kernels `mode`; returns every step's logits and the cache.

    Both sides compute packed MXFP4 experts in the model dtype: torch's path decodes them into
    it and the compiled MoE rounds at the same steps (each matmul's output, the GLU)."""
    model.use_kernels(mode)
    g = torch.Generator().manual_seed(0)
    cache = CacheTensors.allocate(model.cfg, 4, 32, BS, kv_dtype=model.dtype)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(3)]
    a, b, c = (torch.randint(0, 500, (n,), generator=g) for n in (20, 37, 9))
    steps = [  # (ids per sequence, context lengths, sequences, verify)
        ([a, b], [0, 0], [0, 1], []),
        *[([a[:1], b[:1]], [20 + t, 37 + t], [0, 1], []) for t in range(5)],
        ([a[:4], b[:1]], [25, 42], [0, 1], [0]),  # a verify pass of 1 + 3 rows beside a decode
        ([b[:1], a[:1]], [43, 29], [1, 0], []),  # decode rows out of slot order
        ([a[:1], c], [30, 0], [0, 2], []),  # a decode row and a prefill chunk in one step
    ]
    out = []
    with torch.inference_mode():
        for ids, ctx, seqs, verify in steps:
            fb = ForwardBatch(
                torch.cat(ids), [len(i) for i in ids], ctx, seqs, [tables[s] for s in seqs], BS, verify=verify
            )
            out.append(model.compute_logits(model(fb, cache).hidden))
    model.use_kernels("torch")
    return out, cache


def _clone(cache: CacheTensors) -> CacheTensors:
    copy = lambda xs: [None if x is None else x.clone() for x in xs]  # noqa: E731
    return CacheTensors(copy(cache.recurrent), copy(cache.conv), copy(cache.latent), cache.block_size)


def _set_kernels(block, module) -> None:
    backend = CpuKernels(module) if module is not None else TORCH  # fresh: no weight packs kept
    for m in block.modules():
        if hasattr(m, "backend"):
            m.backend = backend
        if hasattr(m, "kernels"):
            m.kernels = module
        if hasattr(m, "_kernel_weights"):
            m._kernel_weights = None


def blockwise(model) -> list[tuple[str, int, float, float]]:
    """Run script()'s steps on the torch path; at every decoder block also run its kernel form on
    the same input and a copy of the cache. (what, layer, max |kernel - torch|, max |torch|) per
    block call and per updated state."""
    module, rows = kernels.get("cpp"), []

    def diff(what, i, f, r):
        rows.append((what, i, (f.float() - r.float()).abs().max().item(), r.float().abs().max().item()))

    for i, layer in enumerate(model.model.layers):
        attn, ffn = layer.attn, layer.ffn

        def teach_attn(x, batch, cache, attn=attn, layer=layer, i=i):
            copy = _clone(cache)
            _set_kernels(layer, module)
            f = attn(x, batch, copy)
            _set_kernels(layer, None)
            r = attn(x, batch, cache)
            diff("attn", i, f, r)
            for name in ("recurrent", "conv", "latent"):
                if getattr(cache, name)[i] is not None:
                    diff(name, i, getattr(copy, name)[i], getattr(cache, name)[i])
            return r

        def teach_ffn(x, batch=None, ffn=ffn, layer=layer, i=i):
            _set_kernels(layer, module)
            f = ffn(x, batch)
            _set_kernels(layer, None)
            r = ffn(x, batch)
            diff("ffn", i, f, r)
            return r

        layer.attn, layer.ffn = teach_attn, teach_ffn
    try:
        script(model, "torch")
    finally:
        for layer in model.model.layers:
            del layer.attn, layer.ffn
    return rows


def test_kernels_match_the_torch_path(model):
    if model.dtype == torch.bfloat16:
        rows = blockwise(model)
        assert {what for what, *_ in rows} >= {"attn", "ffn", "recurrent", "conv", "latent"}
        for what, i, err, scale in rows:  # one bf16 ulp of the scale (measured: <= 0.3%)
            assert err <= scale / 128, f"{what} of layer {i}: {err} > {scale / 128}"
        return
    fast, fast_cache = script(model, "cpp")
    ref, ref_cache = script(model, "torch")
    for i, (f, r) in enumerate(zip(fast, ref)):
        assert (f - r).abs().max().item() <= 1e-4, f"step {i}"
        assert torch.equal(f.argmax(-1), r.argmax(-1)), f"step {i}"
    for x, y in zip(
        fast_cache.recurrent + fast_cache.conv + fast_cache.latent,
        ref_cache.recurrent + ref_cache.conv + ref_cache.latent,
    ):
        if x is not None:
            assert (x.float() - y.float()).abs().max().item() <= 1e-4


def test_the_decode_stack_equals_the_layers_bit_for_bit(model):
    """Decode and verify steps through the compiled decode stack (kernels/cpu/fused/decode_stack.cpp:
    the whole decoder stack in one call) and through the layers one call each (the stack
    switched off) give identical logits, cache states, verify records and tap-layer outputs:
    the same kernels in the same order. K3 covers Block AttnRes and MXFP4 experts, Kimi-Linear
    the dense first layer."""
    taps = {1: None, model.cfg.num_layers - 2: None}

    def run(stack: bool):
        model.use_kernels("cpp")
        if not stack:
            model.model.backend.stack_enabled = False
        g = torch.Generator().manual_seed(1)
        cache = CacheTensors.allocate(model.cfg, 4, 32, BS, kv_dtype=model.dtype)
        tables = [list(range(8 * s, 8 * s + 8)) for s in range(3)]
        a, b, c = (torch.randint(0, 500, (n,), generator=g) for n in (20, 37, 9))
        steps = [([a, b, c], [0, 0, 0], [], None)]
        steps += [([a[t : t + 1], b[t : t + 1], c[t : t + 1]], [20 + t, 37 + t, 9 + t], [], None) for t in range(3)]
        steps += [
            ([a[:4], b[:1], c[:3]], [23, 40, 12], [0, 2], dict(taps)),  # verify passes beside a decode
            ([a[:1], b[:1], c[:1]], [27, 41, 15], [], dict(taps)),
        ]
        out, records = [], []
        with torch.inference_mode():
            for ids, ctx, verify, capture in steps:
                fb = ForwardBatch(torch.cat(ids), [len(i) for i in ids], ctx, [0, 1, 2], tables, BS, verify=verify)
                res = model(fb, cache, tuple(capture or ()))
                out.append(model.compute_logits(res.hidden))
                out += [res.taps[i] for i in capture] if capture else []
                # per verify sequence its rows' records (a buffer's tail past them is scratch)
                records += [
                    t[j, : len(ids[s])]
                    for i in sorted(res.kda_records)
                    for t in res.kda_records[i]
                    for j, s in enumerate(verify)
                ]
        ran = model.model.backend.stack_of(model.model)
        model.use_kernels("torch")
        return out, records, cache, ran

    fast, fast_records, fast_cache, ran = run(True)
    slow, slow_records, slow_cache, _ = run(False)
    assert type(ran).__name__ == "DecodeStack"  # the decode steps did take it
    assert len(fast) == len(slow) == 6 + 2 * len(taps) and len(fast_records) == len(slow_records) > 0
    for f, r in zip(fast + fast_records, slow + slow_records):
        assert torch.equal(f, r)
    for name in ("recurrent", "conv", "latent"):
        for f, r in zip(getattr(fast_cache, name), getattr(slow_cache, name)):
            assert (f is None and r is None) or torch.equal(f, r)


def test_a_row_split_decode_stack_equals_the_layers_bit_for_bit(model):
    """A pure decode step of 11 sequences on 2 threads: the stack runs each thread's share of
    the rows through every layer on its own (DecodeStack.row_parts > 1; the tiny models' weights
    fit in cache), and its logits, caches and tap outputs equal the per-layer path's, which
    splits each block instead. Shares of 5 and 6 rows, sequences at different lengths."""
    S, taps = 11, {0: None, model.cfg.num_layers - 1: None}
    threads = torch.get_num_threads()

    def run(stack: bool):
        model.use_kernels("cpp")
        if not stack:
            model.model.backend.stack_enabled = False
        g = torch.Generator().manual_seed(2)
        cache = CacheTensors.allocate(model.cfg, S, 8 * S, BS, kv_dtype=model.dtype)
        tables = [list(range(8 * s, 8 * s + 8)) for s in range(S)]
        prompts = [torch.randint(0, 500, (3 + 2 * s,), generator=g) for s in range(S)]
        out = []
        with torch.inference_mode():
            fb = ForwardBatch(torch.cat(prompts), [len(p) for p in prompts], [0] * S, list(range(S)), tables, BS)
            model(fb, cache)
            for t in range(3):
                ids = torch.randint(0, 500, (S,), generator=g)
                fb = ForwardBatch(ids, [1] * S, [len(p) + t for p in prompts], list(range(S)), tables, BS)
                res = model(fb, cache, tuple(taps))
                out.append(model.compute_logits(res.hidden))
                out += [res.taps[i] for i in taps]
        stack_obj = model.model.backend.stack_of(model.model)
        model.use_kernels("torch")
        return out, cache, stack_obj

    torch.set_num_threads(2)
    try:
        fast, fast_cache, stack_obj = run(True)
        slow, slow_cache, _ = run(False)
    finally:
        torch.set_num_threads(threads)
    assert type(stack_obj).__name__ == "DecodeStack"
    torch.set_num_threads(2)
    try:
        # 4 rows a share at least; past 16 rows the blocks' GEMMs are torch's (not batch invariant)
        assert stack_obj.row_parts(S) == 2 and stack_obj.row_parts(7) == 1 and stack_obj.row_parts(17) == 1
    finally:
        torch.set_num_threads(threads)
    assert len(fast) == len(slow) == 3 * (1 + len(taps))
    for f, r in zip(fast, slow):
        assert torch.equal(f, r)
    for name in ("recurrent", "conv", "latent"):
        for f, r in zip(getattr(fast_cache, name), getattr(slow_cache, name)):
            assert (f is None and r is None) or torch.equal(f, r)
