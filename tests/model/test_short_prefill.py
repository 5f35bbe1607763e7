"""Prefill chunks of at most SHORT_PREFILL tokens run one position at a time (runner/forward_batch.py
StepRows): through the compiled decode stack when they are the whole step, through the layers'
row-wise kernels beside longer prefills. Reference: the plain torch path, which runs them as
chunked prefill (layers/kda_ops.py kda_chunked, unabsorbed MLA). FP32 models, within 1e-4.

The cases a server meets: the tail of a prompt after a prefix-cache hit, and a short new prompt
in a KDA state slot that held a finished request's state (it must start from zero)."""

from __future__ import annotations

import pytest
import torch

from k3serve.models.registry import load_model
from k3serve.forward import SHORT_PREFILL, CacheTensors, ForwardBatch

BS = 16


@pytest.fixture(scope="module", params=["k3", "kl"])
def model(request, tiny_k3_dir, tiny_kl_dir):
    return load_model(tiny_k3_dir if request.param == "k3" else tiny_kl_dir, dtype=torch.float32, progress=False)


def run(model, mode: str, steps):
    """steps: (ids per sequence, context lengths, slots) -> each step's logits, the cache, and
    how many steps went through the decode stack."""
    model.use_kernels(mode)
    stacked, backend = [], model.model.backend
    original = getattr(backend, "run_stack", None)
    backend.run_stack = lambda *a, **k: stacked.append(1) or original(*a, **k)
    cache = CacheTensors.allocate(model.cfg, 3, 24, BS)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(3)]
    out = []
    try:
        with torch.inference_mode():
            for ids, ctx, slots in steps:
                fb = ForwardBatch(torch.cat(ids), [len(i) for i in ids], ctx, slots, [tables[s] for s in slots], BS)
                out.append(model.compute_logits(model(fb, cache).hidden))
    finally:
        del backend.run_stack
        model.use_kernels("torch")
    return out, cache, len(stacked)


def test_short_prefills_run_rowwise_and_match_the_chunked_torch_path(model):
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(0, 500, (n,), generator=g) for n in (40, 12, 7))
    assert len(b) <= SHORT_PREFILL < len(a)
    steps = [
        ([a[:32]], [0], [0]),  # a long prefill: the per-layer path
        ([a[32:]], [32], [0]),  # its 8-token tail, alone (a prefix hit's shape): the stack
        ([a[:1]], [40], [0]),  # a decode
        ([b], [0], [0]),  # a new 12-token prompt in slot 0, which holds `a`'s state: from zero
        ([b[:1], c, a[:20]], [12, 0, 0], [0, 1, 2]),  # a decode, a short and a long prefill together
    ]
    fast, fast_cache, stacked = run(model, "cpp", steps)
    ref, ref_cache, _ = run(model, "torch", steps)
    assert stacked == 3  # the tail, the decode and the new short prompt
    for i, (f, r) in enumerate(zip(fast, ref)):
        assert f.shape == r.shape
        assert (f - r).abs().max().item() <= 1e-4, f"step {i}"
    for x, y in zip(
        fast_cache.recurrent + fast_cache.conv + fast_cache.latent,
        ref_cache.recurrent + ref_cache.conv + ref_cache.latent,
    ):
        if x is not None:
            assert (x - y).abs().max().item() <= 1e-4


def test_a_short_new_prompt_ignores_the_slots_old_state(model):
    """The same 12-token prompt in a clean slot and in one left dirty by another request give
    the same logits (a kept state would shift every KDA output)."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(0, 500, (30,), generator=g), torch.randint(0, 500, (12,), generator=g)
    clean, _, _ = run(model, "cpp", [([b], [0], [0])])
    dirty, _, stacked = run(model, "cpp", [([a], [0], [0]), ([b], [0], [0])])
    assert stacked == 1
    assert torch.equal(clean[0], dirty[1])
