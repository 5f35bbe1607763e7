"""Hybrid prefix caching: greedy outputs identical on vs off for every kind of shared prefix,
restored KDA state bitwise equal to a fresh prefill, eviction + refill, copy-on-write sharing,
same-step registration, accounting back to zero."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.cache.prefix_cache import block_hashes

KW = dict(cache_memory="32MiB", max_model_len=1024, max_num_batched_tokens=512, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, prompts: list[list[int]], sp=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0].token_ids for o in outs]


def one_by_one(llm: LLM, prompts):
    return [run(llm, [p])[0] for p in prompts]


@pytest.fixture(scope="module")
def off(tiny_k3_dir):
    return LLM(str(tiny_k3_dir), enable_prefix_caching=False, **KW)


@pytest.fixture()
def on(tiny_k3_dir):
    return LLM(str(tiny_k3_dir), **KW)


def hits(llm: LLM) -> int:
    return llm.engine.cache.checkpoints.stats.hit_tokens


@pytest.mark.parametrize(
    "case, prefix_len, expect_hit",
    [
        ("a: block boundary", 64, 64),
        ("b: inside a block", 70, 64),
        ("c: exactly k x block", 64, 64),
        ("d: shorter than a block", 10, 0),
    ],
)
def test_shared_prefix_outputs_identical(on, off, case, prefix_len, expect_hit):
    base = toks(prefix_len, seed=prefix_len)
    tails = [toks(n, seed=100 + n) for n in (10, 7, 12)]
    if case.startswith("c"):
        tails[0] = []  # the first prompt *is* the k x block prefix
    prompts = [base + t for t in tails]
    got = one_by_one(on, prompts)
    assert got == one_by_one(off, prompts)
    # (b): the 2nd request leaves a checkpoint at the junction (64); the 3rd resumes from it
    assert hits(on) >= expect_hit and (expect_hit == 0) == (hits(on) == 0)


def test_three_turn_conversation(on, off):
    user = [toks(40, 1), toks(9, 2), toks(13, 3)]
    convo_on, convo_off = [], []
    for convo, llm in ((convo_on, on), (convo_off, off)):
        history: list[int] = []
        for u in user:
            prompt = history + u
            answer = run(llm, [prompt])[0]
            convo.append(answer)
            history = prompt + answer
    assert convo_on == convo_off
    assert hits(on) >= 32 + 48  # turn 2 resumes at 32 (turn 1's prompt end), turn 3 at 48 or later


def test_restored_state_bitwise_equals_fresh_prefill(on, off, tiny_k3_dir):
    prompt = toks(74, seed=7)
    run(on, [prompt])
    key = block_hashes(prompt, 16)[3]  # the checkpoint at 64 = end of the prompt's last full block
    slot = on.engine.cache.checkpoints.get(key)
    assert slot is not None
    fresh = LLM(str(tiny_k3_dir), enable_prefix_caching=False, **KW)
    run(fresh, [prompt[:64]], SamplingParams(temperature=0, max_tokens=1))  # leaves slot 0 at position 64
    a, b = on.engine.executor.cache, fresh.engine.executor.cache
    for got, want in zip(a.recurrent + a.conv, b.recurrent + b.conv):
        if got is not None:
            assert torch.equal(got[slot], want[0])


def test_eviction_then_refill(tiny_k3_dir, off):
    small = LLM(str(tiny_k3_dir), **{**KW, "cache_memory": "4MiB"}, prefix_cache_state_fraction=0.001)
    assert small.engine.plan.num_checkpoints == 1
    pa, pb = toks(48, 11), toks(48, 12)
    prompts = [pa + toks(5, 13), pb + toks(5, 14), pa + toks(6, 15), pa + toks(7, 16)]
    assert one_by_one(small, prompts) == one_by_one(off, prompts)
    st = small.engine.cache.checkpoints.stats
    assert st.checkpoints_evicted >= 2 and st.hit_tokens >= 48  # the last request re-uses the refilled one


def test_concurrent_sharers_do_not_mutate_the_checkpoint(on, off):
    prefix = toks(64, 21)
    run(on, [prefix + toks(3, 22)])
    slot = on.engine.cache.checkpoints.get(block_hashes(prefix, 16)[3])
    c = on.engine.executor.cache
    before = [t[slot].clone() for t in c.recurrent + c.conv if t is not None]
    prompts = [prefix + toks(9, 23), prefix + toks(4, 24), prefix + toks(17, 25)]
    assert run(on, prompts) == run(off, prompts)
    assert hits(on) >= 3 * 64
    after = [t[slot] for t in c.recurrent + c.conv if t is not None]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_same_step_registration_is_not_reused(on, off):
    prefix = toks(64, 31)
    prompts = [prefix + toks(5, 32), prefix + toks(6, 33)]
    assert run(on, prompts) == run(off, prompts)  # both admitted in one step
    assert hits(on) == 0  # the checkpoint written in that step was not valid yet
    assert run(on, [prefix + toks(7, 34)]) == run(off, [prefix + toks(7, 34)])
    assert hits(on) == 64


def test_accounting_back_to_zero_after_flush(on):
    run(on, [toks(100, 41), toks(70, 42)])
    eng = on.engine
    assert eng.cache.blocks.num_cached_free > 0 and eng.cache.checkpoints.num_stored > 0
    eng.reset_prefix_cache()
    assert eng.cache.blocks.num_free == eng.plan.num_blocks and not eng.cache.blocks.cached
    assert eng.cache.checkpoints.num_stored == 0 and eng.cache.num_free_slots == eng.plan.num_slots
