"""Speculative decoding end to end on tiny checkpoints: greedy spec == non-spec for ngram,
dspark and draft_model; mixed batches with prefix caching and preemption; seeded sampling;
stop strings; config errors; the DSpark distillation entry point."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.spec_decode.dspark import load_dspark

KW = dict(cache_memory="32MiB", max_model_len=512)
# a bias toward four tokens makes greedy text loop, so n-gram drafts get accepted
LOOPY = dict(logit_bias={11: 6.0, 22: 6.0, 33: 6.0, 44: 6.0})


def prompts(n: int, length: int = 8, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1, 500, (length,), generator=g).tolist()} for _ in range(n)]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def base(tiny_k3_dir):
    return LLM(str(tiny_k3_dir), **KW)


def spec_llm(model_dir, **spec):
    """K pinned (`adaptive` off): these tests are about verification, so every proposed draft is
    verified; tests/spec/test_adaptive.py runs the chosen lengths."""
    return LLM(str(model_dir), speculative_config={"num_speculative_tokens": 4, "adaptive": False, **spec}, **KW)


def test_ngram_greedy_equals_plain_and_accepts(tiny_k3_dir, base):
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **LOOPY)
    llm = spec_llm(tiny_k3_dir, method="ngram", prompt_lookup_min=2)
    assert ids(llm.generate(prompts(5), sp)) == ids(base.generate(prompts(5), sp))
    st = llm.engine.spec.stats
    assert st.accepted_tokens > 10 and st.mean_acceptance_length > 1.1
    assert st.accepted_per_position[0] >= st.accepted_per_position[-1]


def test_a_verifying_request_that_fails_leaves_the_others_rollback_aligned(tiny_k3_dir, base):
    """The pass's KDA records are one row per verifying sequence, in batch order; when the first
    of several verifying requests fails its verification (alone), the others still take their
    own rows back (the rollback once skipped the failed one and shifted every later request
    onto its neighbour's recorded states: wrong text)."""
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **LOOPY)
    llm = spec_llm(tiny_k3_dir, method="ngram", prompt_lookup_min=2)
    runner, spec = llm.engine.core.runner, llm.engine.spec
    finish, verify, step, failed = runner.finish, spec.verify, [], []

    def watched_finish(prepared, res):  # the step's verifying requests, in batch order
        step[:] = [s.request_id for s in prepared.batch.seqs if s.drafts]
        return finish(prepared, res)

    def first_of_several_fails_once(req, logits, drafts, gen):
        if not failed and len(step) >= 2 and req.request_id == step[0]:
            failed.append(req.request_id)
            raise ValueError("this request's own fault")
        return verify(req, logits, drafts, gen)

    runner.finish, spec.verify = watched_finish, first_of_several_fails_once
    for i, p in enumerate(prompts(4)):
        llm.engine.add_request(f"r{i}", p, sp)
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in llm.engine.step() if o.finished})
    assert len(failed) == 1 and done[failed[0]].finish_reason == "error"
    want = dict(zip((f"r{i}" for i in range(4)), ids(base.generate(prompts(4), sp))))
    assert {r: o.token_ids for r, o in done.items() if r != failed[0]} == {r: want[r] for r in done if r != failed[0]}


@pytest.mark.parametrize("method", ["dspark", "draft_model"])
def test_model_drafters_greedy_equal_plain(tiny_k3_dir, tiny_kl_dir, base, random_dspark, method):
    draft = random_dspark if method == "dspark" else str(tiny_kl_dir)
    llm = spec_llm(tiny_k3_dir, method=method, model=draft)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **LOOPY)
    assert ids(llm.generate(prompts(4, seed=3), sp)) == ids(base.generate(prompts(4, seed=3), sp))
    assert llm.engine.spec.stats.drafts > 0


def test_mixed_batch_with_prefix_cache_and_preemption(tiny_k3_dir, base):
    shared = prompts(1, length=40, seed=9)[0]["prompt_token_ids"]
    ps = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in prompts(6, seed=10)]
    sps = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **(LOOPY if i % 2 else {})) for i in range(6)
    ]  # half loop (and speculate), half do not
    want = ids(base.generate(ps, sps))
    tight = LLM(
        str(tiny_k3_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},  # all verified
        cache_memory=5 * 32_000 + 14 * 16 * 480,
        num_state_slots=4,
        max_model_len=200,
    )
    run_twice = ids(tight.generate(ps[:1], sps[:1])) + ids(tight.generate(ps[1:], sps[1:]))
    assert run_twice == want
    eng = tight.engine
    assert eng.scheduler.num_preemptions > 0 and eng.cache.checkpoints.stats.hit_tokens > 0
    assert eng.spec.stats.accepted_tokens > 0
    assert eng.cache.num_free_slots == eng.plan.num_slots


def test_seeded_sampling_with_probabilistic_block_verification(tiny_k3_dir, random_dspark):
    llm = spec_llm(
        tiny_k3_dir,
        method="dspark",
        model=random_dspark,
        draft_sample_method="probabilistic",
        rejection_sample_method="block",
    )
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=4, max_tokens=20, ignore_eos=True)
    a = ids(llm.generate(prompts(3, seed=5), sp))
    b = ids(llm.generate(prompts(3, seed=5), sp))
    assert a == b and all(len(x) == 20 for x in a)


def test_stop_string_cuts_accepted_drafts(tiny_k3_dir, base):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **LOOPY)
    p = prompts(1, seed=21)
    text = base.generate(p, sp)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    spx = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], **LOOPY)
    want = base.generate(p, spx)[0].outputs[0]
    got = spec_llm(tiny_k3_dir, method="ngram", prompt_lookup_min=2).generate(p, spx)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "dspark", "num_speculative_tokens": 2}, "model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "magic"},
            "rejection_sample_method",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys"),
    ],
)
def test_config_errors_name_the_key(tiny_k3_dir, cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_k3_dir), speculative_config=cfg, **KW)


def test_dspark_more_tokens_than_its_block_is_an_error(tiny_k3_dir, random_dspark):
    with pytest.raises(ValueError, match="num_speculative_tokens 5 exceeds the dspark draft's block_size 4"):
        LLM(
            str(tiny_k3_dir),
            speculative_config={"method": "dspark", "model": random_dspark, "num_speculative_tokens": 5},
            **KW,
        )


def test_dspark_distillation_learns(tiny_k3_dir, tmp_path):
    from k3serve.spec_decode.train_dspark import distill_dspark

    r = distill_dspark(str(tiny_k3_dir), str(tmp_path / "d"), steps=40, num_seqs=8, seq_len=40, block_size=3)
    assert r["last_loss"] < 0.7 * r["first_loss"]
    m = load_dspark(tmp_path / "d")
    assert m.cfg.block_size == 3 and m.cfg.target_layer_ids == (1, 4, 6) and m.cfg.markov_rank == 16
    assert r["last_lr"] == 3e-3  # constant by default


def test_dspark_distillation_cosine_decays_to_zero(tiny_k3_dir, tmp_path):
    from k3serve.spec_decode.train_dspark import distill_dspark

    r = distill_dspark(
        str(tiny_k3_dir), str(tmp_path / "d"), steps=12, num_seqs=4, seq_len=24, block_size=3, cosine=True
    )
    assert r["last_lr"] < 1e-9 and r["last_loss"] < r["first_loss"]


def test_dspark_examples_gather_the_targets_distributions():
    """examples() keeps each used distribution once; its rows must pick, for every position and
    draft offset, the distribution a per-position copy would hold (probs of sequence j at idx - 1)."""
    from k3serve.spec_decode.train_dspark import examples

    g = torch.Generator().manual_seed(3)
    # sequence 1's completion (2 tokens) is shorter than k + 1: no positions (its arange raised before)
    k, V, lens, start = 3, 7, [9, 6, 12, 5], [2, 4, 5, 1]
    seqs = [torch.randint(0, V, (L,), generator=g) for L in lens]
    taps = [torch.randn(L, 2, 4, generator=g) for L in lens]
    probs = [torch.rand(L, V, generator=g) for L in lens]
    x, last, tgt, rows, table = examples(seqs, taps, probs, k, start)
    want_x, want_p = [], []
    for row, tp, pr, s in zip(seqs, taps, probs, start):
        for n in range(max(0, s - 1), row.shape[0] - k - 1):
            want_x.append(tp[n])
            want_p.append(pr[n + 1 : n + 1 + k])  # targets at n + 2 .. n + k + 1, their p one row before
    assert torch.equal(x, torch.stack(want_x)) and torch.equal(table[rows], torch.stack(want_p))
    assert table.shape[0] < sum(lens)  # prompt rows are not kept
