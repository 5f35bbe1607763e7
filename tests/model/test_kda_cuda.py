"""KDA on a CUDA device: k3serve's torch path there == fla's Triton kernels (`chunk_kda`, the
prefill kernel vLLM and SGLang serve Kimi-Linear with, and `fused_recurrent_kda`, their decode
kernel), both against a float64 CPU run of the plain recurrence. Skipped without CUDA and
fla-core; `bench/gpu_check.sh` runs it.

Tolerances (relative to the largest |value|): k3serve's fp32 torch path 1e-4 (cuBLAS fp32, no
TF32); fla in fp32 5e-3 (its `tl.dot` may take TF32 inputs, ~1e-3 each); fla with bf16 q, k, v,
beta 4e-2 (~4e-3 each, through a 256-step recurrence). k3serve's KDA layer hands its core fp32
whatever the model dtype (layers/kda.py), so only fp32 is asked of it."""

from __future__ import annotations

import pytest
import torch

from k3serve.layers.kda_ops import kda_chunked, kda_recurrent
from tests.model.test_kda_ops import inputs, rel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
fla_kda = pytest.importorskip("fla.ops.kda", reason="fla-core's Triton kernels") if torch.cuda.is_available() else None


def case(T, D, seed, form="bounded"):
    """[T, H, D] q, k, v, g (log decay), [T, H] beta, [H, D, D] initial state, and the float64
    CPU recurrence's output and final state."""
    x = inputs(T, H=4, D=D, seed=seed, form=form)
    ref = kda_recurrent(*(t.double() for t in x))
    return x, ref


def fla_run(fn, x, dtype, **kw):
    q, k, v, g, beta, s0 = (t.to("cuda", dtype) for t in x)
    o, s = fn(
        q[None],
        k[None],
        v[None],
        g[None].float(),
        beta[None],
        scale=1.0,
        initial_state=s0[None].float(),
        output_final_state=True,
        **kw,
    )
    return o[0].double().cpu(), s[0].double().cpu()


@cuda
@pytest.mark.parametrize("form", ["bounded", "softplus"])
@pytest.mark.parametrize("T", [1, 63, 64, 256])
def test_torch_path_on_cuda_equals_fla_chunk_and_recurrent(T, form):
    x, (o_ref, s_ref) = case(T, 64, seed=T, form=form)
    q, k, v, g, beta, s0 = (t.cuda() for t in x)
    o, s = kda_chunked(q, k, v, g, beta, s0)
    assert o.is_cuda and s.is_cuda
    errs = {"k3serve fp32": (rel(o.double().cpu(), o_ref), rel(s.double().cpu(), s_ref))}
    for name, fn in (("chunk_kda", fla_kda.chunk_kda), ("fused_recurrent_kda", fla_kda.fused_recurrent_kda)):
        errs[f"{name} fp32"] = tuple(rel(a, b) for a, b in zip(fla_run(fn, x, torch.float32), (o_ref, s_ref)))
        errs[f"{name} bf16"] = tuple(rel(a, b) for a, b in zip(fla_run(fn, x, torch.bfloat16), (o_ref, s_ref)))
    print(f"T={T} {form}: " + ", ".join(f"{k} out {a:.1e} state {b:.1e}" for k, (a, b) in errs.items()))
    assert max(errs["k3serve fp32"]) <= 1e-4, errs
    assert max(errs["chunk_kda fp32"]) <= 5e-3 and max(errs["fused_recurrent_kda fp32"]) <= 5e-3, errs
    assert max(errs["chunk_kda bf16"]) <= 4e-2 and max(errs["fused_recurrent_kda bf16"]) <= 4e-2, errs


@cuda
def test_varlen_prefill_equals_fla_chunk_kda_with_cu_seqlens():
    """Three sequences of ragged lengths in one flat batch, each from its own state: fla's varlen
    form (what a serving engine's mixed prefill calls) against k3serve's per-sequence chunks."""
    cases = [case(T, 64, seed=100 + T) for T in (5, 70, 129)]
    cat = [torch.cat([c[0][i] for c in cases]) for i in range(5)]  # q, k, v, g, beta: [sum T, ...]
    s0 = torch.stack([c[0][5] for c in cases])  # [N, H, D, D]
    cu = torch.tensor([0, 5, 75, 204], device="cuda")
    q, k, v, g, beta = (t.cuda() for t in cat)
    o, s = fla_kda.chunk_kda(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        scale=1.0,
        initial_state=s0.cuda(),
        output_final_state=True,
        cu_seqlens=cu,
    )
    for n, ((xs, (o_ref, s_ref)), b, e) in enumerate(zip(cases, cu[:-1].tolist(), cu[1:].tolist())):
        mine_o, mine_s = kda_chunked(*(t.cuda() for t in xs))
        assert rel(mine_o.double().cpu(), o_ref) <= 1e-4 and rel(mine_s.double().cpu(), s_ref) <= 1e-4
        assert rel(o[0, b:e].double().cpu(), o_ref) <= 5e-3 and rel(s[n].double().cpu(), s_ref) <= 5e-3
