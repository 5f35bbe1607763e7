"""The multi-rank engine is one code path (issue 60): the TP2 engine (TP2 + EP2 for tiny K3,
whose MXFP4 experts cannot split by channel) and the DP2 + EP2 engine of worker processes, with
the torch and the C++ backends, ngram speculation and prefix-cache hits, give the single-process
engine's greedy tokens on both tiny architectures. The graph backend under the same layouts is
tests/distributed/test_tp_graph.py and test_dp_graph.py; DSpark under DP-attention workers
test_dp_ep_model.py (and under TP2, slow, test_tp_engine.py)."""

from __future__ import annotations

import pytest

from k3serve import LLM, SamplingParams

KW = dict(cache_memory="32MiB", max_model_len=512, seed=0, dtype="float32")
# K pinned (every proposal verified): the drafts and their rollback across ranks are what is checked
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}
SHARED = [(7 * i) % 400 + 3 for i in range(40)]  # 40 tokens: two whole latent blocks of 16, then a tail
PROMPTS = [SHARED + [11, 12], SHARED + [13], [5, 6, 7, 5, 6, 7, 5, 6]]
# greedy, biased toward three ids so that the tiny model loops and ngram drafts are accepted
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={11: 6.0, 22: 6.0, 33: 6.0})


def tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def replicas(llm) -> list:
    return list(getattr(llm.engine, "replicas", [llm.engine]))


@pytest.mark.parametrize("kernels", ["torch", "cpp"])
@pytest.mark.parametrize("layout", ["tp2", "dp2-ep2"])
@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_multi_rank_engines_equal_one_process(kind, layout, kernels, tiny_k3_dir, tiny_kl_dir):
    path = str(tiny_k3_dir if kind == "k3" else tiny_kl_dir)
    ref = LLM(path, kernels="torch", **KW)
    want = tokens(ref, PROMPTS[:1]) + tokens(ref, PROMPTS[1:])
    if layout == "tp2":
        extra = dict(tensor_parallel_size=2, enable_expert_parallel=kind == "k3")
    else:
        extra = dict(data_parallel_size=2, enable_expert_parallel=True)
    llm = LLM(path, kernels=kernels, speculative_config=SPEC, **extra, **KW)
    try:
        got = tokens(llm, PROMPTS[:1]) + tokens(llm, PROMPTS[1:])  # the second batch hits the shared prefix
        engines = replicas(llm)
        assert got == want
        assert sum(e.cache.checkpoints.stats.hit_tokens for e in engines) >= 32  # two whole blocks
        assert sum(e.spec.stats.accepted_tokens for e in engines) > 0
        assert [e.executor.size for e in engines] == [2] if layout == "tp2" else [1, 1]
    finally:
        for e in replicas(llm):
            e.shutdown()
