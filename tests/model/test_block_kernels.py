"""The model with its compiled CPU kernels (use_kernels("cpp"): decode/verify blocks, MoE blocks,
norms, AttnRes mix) against the same model on the plain torch path (use_kernels("torch")),
over prefill, batched decode, a verify pass beside a decode, and a step mixing decode rows with
a prefill chunk. Summation orders differ, so logits and states are compared with tolerances:
FP32 1e-4, BF16 a few bf16 ulps of the logits' scale."""

from __future__ import annotations

import pytest
import torch

from k3serve.models.registry import load_model
from k3serve.runner.forward_batch import CacheTensors, ForwardBatch

BS = 16


@pytest.fixture(scope="module", params=[("k3", torch.float32), ("k3", torch.bfloat16), ("kl", torch.float32),
                                        ("kl", torch.bfloat16)], ids=["k3-fp32", "k3-bf16", "kl-fp32", "kl-bf16"])
def model(request, tiny_k3_dir, tiny_kl_dir):
    kind, dtype = request.param
    return load_model(tiny_k3_dir if kind == "k3" else tiny_kl_dir, dtype=dtype, progress=False)


def script(model, mode):
    """The same sequence of steps with kernels `mode`; returns every step's logits and the cache.

    The compiled MoE computes packed MXFP4 experts in FP32 whatever the model dtype (as the
    grouped kernel always has), while torch's fast path decodes them into the model dtype; so
    for packed experts the torch side runs `experts_reference`, FP32 dequantize-then-matmul."""
    model.use_kernels(mode)
    for moe in model.moe_layers():
        moe.use_reference = mode == "torch" and moe.w1.is_packed
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
            fb = ForwardBatch(torch.cat(ids), [len(i) for i in ids], ctx, seqs, [tables[s] for s in seqs], BS,
                              verify=verify)
            out.append(model.compute_logits(model(fb, cache)))
            cache.spec_states.clear()
    model.use_kernels("torch")
    for moe in model.moe_layers():
        moe.use_reference = False
    return out, cache


def test_kernels_match_the_torch_path(model):
    fast, fast_cache = script(model, "cpp")
    ref, ref_cache = script(model, "torch")
    bf16 = model.dtype == torch.bfloat16
    for i, (f, r) in enumerate(zip(fast, ref)):
        tol = 0.05 * r.abs().max().item() if bf16 else 1e-4  # bf16: ulp flips of 1/128 propagate
        assert (f - r).abs().max().item() <= tol, f"step {i}"
        if not bf16:
            assert torch.equal(f.argmax(-1), r.argmax(-1)), f"step {i}"
    for x, y in zip(fast_cache.recurrent + fast_cache.conv + fast_cache.latent,
                    ref_cache.recurrent + ref_cache.conv + ref_cache.latent):
        if x is not None:
            scale = y.float().abs().max().item()
            assert (x.float() - y.float()).abs().max().item() <= (0.05 * scale if bf16 else 1e-4)
