"""The graph backend inside the engine (issue 46): greedy tokens equal the torch backend's over
32 decode steps on both architectures, with prefix caching, chunked prefill, preemption and
speculation (ngram, DSpark) on; decode steps run in the static step, the rest eagerly.

The engines here compile with dynamo's `eager` backend: fullgraph=True still fails on any graph
break, at a second a bucket (tests/model/test_graph.py compiles through aot_eager)."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.cache.sizing import spec_records_bytes

GRAPH = dict(kernels="graph", compilation_config={"backend": "eager", "cudagraph_capture_sizes": [1, 4]})
LOOPY = dict(logit_bias={11: 6.0, 22: 6.0, 33: 6.0, 44: 6.0})  # greedy text loops: n-gram drafts accepted


def prompts(n: int, shared: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 500, (shared,), generator=g).tolist()
    return [{"prompt_token_ids": prefix + torch.randint(1, 500, (5 + 3 * i,), generator=g).tolist()} for i in range(n)]


def tokens(llm, ps, sp):
    return [o.outputs[0].token_ids for o in llm.generate(ps, sp)]


def graphs(llm):
    return llm.engine.runner.rank.graphs


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_greedy_equals_torch_with_prefix_cache_and_chunked_prefill(kind, tiny_k3_dir, tiny_kl_dir):
    path = str(tiny_k3_dir if kind == "k3" else tiny_kl_dir)
    kw = dict(cache_memory="16MiB", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ps = prompts(6)
    want = tokens(LLM(path, kernels="torch", **kw), ps, sp)
    llm = LLM(path, **GRAPH, **kw)
    assert tokens(llm, ps, sp) == want
    assert tokens(llm, ps[:2], sp) == want[:2]  # again, from the prefix cache
    g = graphs(llm)
    assert llm.engine.cache.checkpoints.stats.hit_tokens > 0
    assert g.steps >= 32 and g.compiles <= 2 * 3  # buckets 1 and 4, widths 2..8 blocks


def test_greedy_equals_torch_under_preemption(tiny_k3_dir):
    ps = prompts(6, shared=40, seed=9)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = tokens(LLM(str(tiny_k3_dir), kernels="torch", cache_memory="32MiB", max_model_len=200), ps, sp)
    tight = LLM(
        str(tiny_k3_dir), cache_memory=5 * 32_000 + 14 * 16 * 480, num_state_slots=4, max_model_len=200, **GRAPH
    )
    assert tokens(tight, ps, sp) == want
    assert tight.engine.scheduler.num_preemptions > 0 and graphs(tight).steps > 0


@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_speculative_greedy_equals_torch(tiny_k3_dir, random_dspark, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "dspark":
        spec["model"] = random_dspark
    else:
        spec["prompt_lookup_min"] = 2
    kw = dict(cache_memory="32MiB", max_model_len=256, speculative_config=spec)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **LOOPY)
    ps = prompts(4, seed=3)
    want = tokens(LLM(str(tiny_k3_dir), kernels="torch", **kw), ps, sp)
    llm = LLM(str(tiny_k3_dir), **GRAPH, **kw)
    assert tokens(llm, ps, sp) == want
    assert llm.engine.spec.stats.drafts > 0
    if method == "dspark":  # every sequence drafts every step: the verify passes run in the static step
        assert any(b.T > 1 for b in graphs(llm).entries) and graphs(llm).steps >= 8
    else:  # a static verify pass accepted a draft: its slot became the live one, nothing was copied
        drafts = llm.engine.cache.drafts
        assert any(b.T > 1 for b in graphs(llm).entries)
        assert any(drafts.live(g) != g for g in range(llm.engine.plan.num_slots))
        # the spare slots take no more than the verify records the budget reserves for them
        cache, cfg = llm.engine.runner.cache, llm.engine.model.cfg
        spare = sum(t[cache.first_spare :].nbytes for t in cache.recurrent + cache.conv if t is not None)
        assert 0 < spare <= spec_records_bytes(cfg, 3, llm.engine.config.max_num_seqs)


def test_device_sampling_is_fused_reproducible_and_equal_to_the_host_draws(tiny_kl_dir):
    """Sampling rows come back as ids from the static step; asking logprobs makes the same step
    return logits, and the host draws the same counter-based uniforms from them: equal tokens.
    A seeded request draws the same tokens alone as in a batch."""
    llm = LLM(str(tiny_kl_dir), **GRAPH, cache_memory="16MiB", max_model_len=256, max_num_seqs=4)
    sp = dict(temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=24, ignore_eos=True)
    ps = prompts(3, seed=4)
    fused = tokens(llm, ps, SamplingParams(**sp))
    assert any(b.sampled for b in graphs(llm).entries)
    host = tokens(llm, ps, SamplingParams(**sp, logprobs=0))
    assert fused == host
    assert tokens(llm, ps[1:2], SamplingParams(**sp)) == fused[1:2]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert tokens(llm, ps, greedy) == tokens(
        LLM(str(tiny_kl_dir), kernels="torch", cache_memory="16MiB", max_model_len=256), ps, greedy
    )
