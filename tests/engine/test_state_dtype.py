"""The KDA recurrent state in bfloat16 (--mamba-ssm-cache-dtype, issue 50): the state pool,
checkpoints and plan follow it, and the engine's equality suite holds in its own mode: a
batch gives each request what it gets alone, a prefix hit what a recompute gives, n-gram
speculation what plain decoding gives; the graph backend what the torch backend gives. The
drift against float32 is bench/state_dtype_drift.py's (docs/features.md)."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams

KW = dict(kernels="torch", cache_memory="32MiB", max_model_len=256, seed=0, mamba_ssm_cache_dtype="bfloat16")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LOOPY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={11: 6.0, 22: 6.0, 33: 6.0})


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm, prompts, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_bf16_state_keeps_the_equality_suite(kind, tiny_k3_dir, tiny_kl_dir):
    path = str(tiny_k3_dir if kind == "k3" else tiny_kl_dir)
    llm = LLM(path, **KW)
    fp32 = LLM(path, **{**KW, "mamba_ssm_cache_dtype": "auto"})
    cache, cfg = llm.engine.executor.cache, llm.engine.model.cfg
    rec = [t for t in cache.recurrent if t is not None]
    assert rec and all(t.dtype == torch.bfloat16 for t in rec)
    assert all(t.dtype == torch.float32 for t in cache.conv if t is not None)  # conv state stays fp32
    halved = len(cfg.kda_layers) * cfg.kda.num_heads * cfg.kda.head_dim**2 * 2
    assert fp32.engine.plan.slot_bytes - llm.engine.plan.slot_bytes == halved
    prefix = toks(40, 1)
    prompts = [prefix + toks(5 + i, 10 + i) for i in range(4)]
    together = run(llm, prompts)
    assert together == [run(llm, [p])[0] for p in prompts]  # batched == alone (and hits == first run)
    assert llm.engine.cache.checkpoints.stats.hit_tokens >= 3 * 32
    cold = LLM(path, **KW, enable_prefix_caching=False)
    assert run(cold, prompts) == together  # prefix hit == recompute
    spec = LLM(
        path,
        **KW,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False},
    )
    assert run(spec, prompts, LOOPY) == run(cold, prompts, LOOPY)  # speculation lossless
    assert spec.engine.spec.stats.accepted_tokens > 0


def test_bf16_state_on_the_graph_backend_and_the_cpp_refusal(tiny_k3_dir):
    path = str(tiny_k3_dir)
    prompts = [toks(20 + 3 * i, 30 + i) for i in range(3)]
    want = run(LLM(path, **KW), prompts)
    graph = LLM(
        path, **{**KW, "kernels": "graph"}, compilation_config={"backend": "eager", "compile_in_background": False}
    )
    assert run(graph, prompts) == want and graph.engine.executor.graphs.steps > 0
    with pytest.raises(ValueError, match="float32"):
        LLM(path, **{**KW, "kernels": "cpp"})
    auto = LLM(path, **{**KW, "kernels": "auto"})  # the CPU kernels stand aside
    assert auto.engine.kernels is None and run(auto, prompts) == want
