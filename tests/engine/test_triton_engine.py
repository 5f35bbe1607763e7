"""kernels="triton" inside the engine (issue 52): the graph backend's static step with the
Triton KDA, paged MLA and MoE kernels in it gives the torch backend's greedy tokens, on tiny K3
(packed MXFP4 experts) and tiny Kimi-Linear (dense experts), prefill through fla's varlen
chunk_kda, with a DSpark verify pass on K3.
On a CPU the kernels run under Triton's interpreter (tests/conftest.py), the step uncompiled
(dynamo's `eager` backend still demands one graph); each engine takes ~10-25 s here, and the
DSpark verify test is slow-marked (`make test-slow`)."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams

pytest.importorskip("triton", reason="kernels='triton' needs triton")
pytest.importorskip("fla", reason="kernels='triton' needs fla-core")


TRITON = dict(
    kernels="triton",
    compilation_config={"backend": "eager", "cudagraph_capture_sizes": [1, 4], "compile_in_background": False},
)


def prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1, 500, (9 + 4 * i,), generator=g).tolist()} for i in range(n)]


def tokens(llm, ps, sp):
    return [o.outputs[0].token_ids for o in llm.generate(ps, sp)]


def count_kernel_calls(llm) -> dict:
    """Wrap the backend's Triton ops with call counters (one backend object serves every layer)."""
    backend = llm.engine.model.model.backend
    calls = {}

    def counted(name, op):
        def call(*a):
            calls[name] = calls.get(name, 0) + 1
            return op(*a)

        return call

    ops = backend.kernels_ops
    backend.kernels_ops = type(ops)(**{k: counted(k, v) for k, v in vars(ops).items()})
    return calls


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_triton_backend_greedy_equals_torch(kind, tiny_k3_dir, tiny_kl_dir, monkeypatch):
    path = str(tiny_k3_dir if kind == "k3" else tiny_kl_dir)
    kw = dict(cache_memory="16MiB", max_model_len=128, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ps = prompts(3)
    want = tokens(LLM(path, kernels="torch", **kw), ps, sp)
    llm = LLM(path, **TRITON, **kw)
    assert type(llm.engine.model.model.backend).__name__ == "TritonBackend"
    if kind == "k3":
        assert llm.engine.model.moe_layers()[0].w1.is_packed  # the MoE kernel reads MXFP4 bytes
    calls = count_kernel_calls(llm)
    from k3serve.kernels.triton import kda

    prefill = kda.kda_prefill
    monkeypatch.setattr(
        kda, "kda_prefill", lambda *a: calls.update(kda_prefill=calls.get("kda_prefill", 0) + 1) or prefill(*a)
    )
    assert tokens(llm, ps, sp) == want
    assert llm.engine.executor.graphs.steps >= 7  # the decode steps ran in the static step
    assert calls["kda_decode"] and calls["mla_decode"] and calls["moe_experts"], calls
    assert calls["kda_prefill"] == len(llm.engine.model.cfg.kda_layers)  # the prompts' one prefill step: chunk_kda


@pytest.mark.slow  # ~50 s here: a verify pass's KDA, MLA and MoE kernels in the engine (tests/kernels has each alone)
def test_triton_verify_pass_with_dspark_equals_torch(tiny_k3_dir, random_dspark):
    kw = dict(
        cache_memory="32MiB",
        max_model_len=128,
        max_num_seqs=4,
        speculative_config={"method": "dspark", "model": random_dspark, "num_speculative_tokens": 3},
    )
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ps = prompts(2, seed=4)
    want = tokens(LLM(str(tiny_k3_dir), kernels="torch", **kw), ps, sp)
    llm = LLM(str(tiny_k3_dir), **TRITON, **kw)
    calls = count_kernel_calls(llm)
    assert tokens(llm, ps, sp) == want
    assert calls.get("kda_verify", 0) > 0, calls


def test_triton_is_refused_by_name_where_it_cannot_run(monkeypatch, tiny_kl_dir):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from k3serve.executor.placement import resolve_mode

    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_mode("triton", torch.device("cpu"))
    assert resolve_mode("triton", torch.device("cuda")) == "triton"
