"""Draft lengths that change every step keep speculation lossless: greedy outputs equal
speculation off for every drafter and backend at 1 and 16 streams (random lengths per request
and step, and the real policy), and sampled sequences keep the target distribution."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.engine.stats import snapshot
from k3serve.spec_decode.adaptive import DraftPolicy
from k3serve.spec_decode.rejection import verify_block, verify_standard
from tests.spec.test_rejection import chisquare_pvalue

KW = dict(cache_memory="32MiB", max_model_len=512)
LOOPY = dict(logit_bias={11: 6.0, 22: 6.0, 33: 6.0, 44: 6.0})


class RandomLengths(DraftPolicy):
    """Each request verifies a random 0..proposed of its drafts, every step."""

    def __init__(self, k: int, seed: int = 0):
        super().__init__(k)
        self.rng = random.Random(seed)

    def should_draft(self, request_ids, free=False, context=0):
        return True

    def choose(self, request_ids, proposed, token_counts, drafts=None, context=0):
        ks = [self.rng.randint(0, n) for n in proposed]
        for k in ks:
            self.chosen[k] += 1
        return ks


def prompts(n: int, seed: int = 0, length: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1, 500, (length,), generator=g).tolist()} for _ in range(n)]


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def drafter(method, random_dspark, tiny_kl_dir) -> dict:
    if method == "ngram":
        return {"method": "ngram", "prompt_lookup_min": 2}
    return {"method": method, "model": random_dspark if method == "dspark" else str(tiny_kl_dir)}


@pytest.mark.parametrize(
    "method, kernels",
    [("ngram", "torch"), ("ngram", "cpp"), ("dspark", "torch"), ("dspark", "cpp"), ("draft_model", "cpp")],
)
def test_lengths_changing_every_step_keep_greedy_outputs(tiny_k3_dir, tiny_kl_dir, random_dspark, method, kernels):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **LOOPY)
    one, many = prompts(1, seed=1), prompts(16, seed=2)
    base = LLM(str(tiny_k3_dir), kernels=kernels, **KW)
    want = ids(base.generate(one, sp)) + ids(base.generate(many, sp))
    spec = {"num_speculative_tokens": 4, **drafter(method, random_dspark, tiny_kl_dir)}
    llm = LLM(str(tiny_k3_dir), kernels=kernels, speculative_config=spec, **KW)
    llm.engine.spec.policy = policy = RandomLengths(4, seed=3)
    assert ids(llm.generate(one, sp)) + ids(llm.generate(many, sp)) == want
    assert policy.chosen[0] > 0 and sum(policy.chosen[2:]) > 0  # lengths did vary, 0 among them
    assert llm.engine.spec.stats.accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_the_policy_keeps_greedy_outputs_and_reports_its_choices(tiny_k3_dir, tiny_kl_dir, random_dspark, method):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **LOOPY)
    many = prompts(16, seed=4)
    want = ids(LLM(str(tiny_k3_dir), **KW).generate(many, sp))
    llm = LLM(
        str(tiny_k3_dir),
        speculative_config={"num_speculative_tokens": 4, **drafter(method, random_dspark, tiny_kl_dir)},
        **KW,
    )
    policy = llm.engine.spec.policy
    assert policy.costs.measured  # profiled at start-up
    assert any("adaptive draft lengths 0..4, step costs profiled" in line for line in llm.engine.startup_log)
    assert ids(llm.generate(many, sp)) == want
    assert sum(policy.chosen) + policy.skipped_steps > 0
    stats = snapshot(llm.engine)  # what /metrics reads
    assert stats.spec_draft_lengths == tuple(policy.chosen) and stats.spec_skipped_steps == policy.skipped_steps


def test_pinned_k_verifies_every_proposal(tiny_k3_dir):
    llm = LLM(
        str(tiny_k3_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False},
        **KW,
    )
    assert llm.engine.spec.policy is None
    assert not any("adaptive" in line for line in llm.engine.startup_log)


# ---- the distribution, with a length drawn anew every step --------------------------------
V, L, N = 3, 3, 6000


def markov(seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1).double()  # p[prev] -> next
    q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1).double()
    return p, q


def speculate(p, q, verify, rng: random.Random, gen: torch.Generator) -> tuple[int, ...]:
    """L tokens after token 0, each step drafting a random 0..3 tokens from q and verifying them."""
    out = [0]
    while len(out) <= L:
        k = rng.randint(0, 3)
        drafts, prev = [], out[-1]
        for _ in range(k):
            prev = int(torch.multinomial(q[prev], 1, generator=gen))
            drafts.append(prev)
        ctx = [out[-1], *drafts]
        emitted, _ = verify(p[ctx], q[ctx[:k]], drafts, gen)
        out += emitted
    return tuple(out[1 : L + 1])


@pytest.mark.parametrize("verify", [verify_standard, verify_block], ids=["standard", "block"])
def test_sampled_sequences_follow_the_target_when_lengths_change(verify):
    p, q = markov(5)
    rng, gen = random.Random(0), torch.Generator().manual_seed(1)
    seqs = list(itertools.product(range(V), repeat=L))
    counts = torch.zeros(len(seqs))
    where = {s: i for i, s in enumerate(seqs)}
    for _ in range(N):
        counts[where[speculate(p, q, verify, rng, gen)]] += 1
    exact = torch.tensor([float(p[0, a] * p[a, b] * p[b, c]) for a, b, c in seqs])
    assert chisquare_pvalue(counts, exact * N) > 1e-3


def test_a_verify_step_where_some_requests_drafted_nothing_is_one_stack_call(tiny_k3_dir, monkeypatch):
    """The scheduler puts verifying sequences first: the decode stack (cpp) runs the step whole
    instead of the model falling back to its layer-by-layer path."""
    from k3serve.backends.cpu import CpuKernels

    mixed = []
    stack = CpuKernels.decode_stack

    def spy(self, model, batch, h):
        out = stack(self, model, batch, h)
        if batch.verify and len(batch.verify) < len(batch.seq_lens):
            mixed.append(out is not None)
        return out

    monkeypatch.setattr(CpuKernels, "decode_stack", spy)
    llm = LLM(
        str(tiny_k3_dir), kernels="cpp", speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **KW
    )
    llm.engine.spec.policy = RandomLengths(3, seed=5)
    llm.generate(prompts(8, seed=6), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **LOOPY))
    assert len(mixed) > 3 and all(mixed)


def test_a_seeded_sampled_request_gives_the_same_text_whatever_the_policy_does(tiny_k3_dir, random_dspark):
    """Its verification draws depend on its draft lengths: it verifies every proposed draft, so
    its text is the pinned-K engine's, alone or beside others, whatever lengths the rest get."""
    spec = {"method": "dspark", "model": random_dspark, "num_speculative_tokens": 4}
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **LOOPY)
    p = prompts(1, seed=8)
    pinned = LLM(str(tiny_k3_dir), speculative_config={**spec, "adaptive": False}, **KW)
    want = ids(pinned.generate(p, seeded))
    llm = LLM(str(tiny_k3_dir), speculative_config=spec, **KW)
    assert ids(llm.generate(p, seeded)) == want
    llm.engine.spec.policy = policy = RandomLengths(4, seed=9)
    out = llm.generate(p + prompts(6, seed=10), [seeded] + [greedy] * 6)
    assert ids(out)[:1] == want and policy.chosen[0] > 0  # the others' lengths did vary


class RestsEveryOther(RandomLengths):
    """Drafts on one step, rests the next (a rest of one step after each drafting step)."""

    def should_draft(self, request_ids, free=False, context=0):
        self._rest = 1
        return True


def test_a_step_before_a_rest_returns_no_taps_and_the_drafter_forgets_stale_ones(tiny_k3_dir, random_dspark):
    """While the policy rests the drafter through the next step, the step captures no tap states
    (DSpark's ~5% of a 16-stream step) and the drafter drops the ones it holds of those requests
    (stale now); the step before a drafting one captures them. Greedy text stays speculation off's."""
    spec = {"method": "dspark", "model": random_dspark, "num_speculative_tokens": 4}
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **LOOPY)
    want = ids(LLM(str(tiny_k3_dir), **KW).generate(prompts(4, seed=11), greedy))
    llm = LLM(str(tiny_k3_dir), speculative_config=spec, **KW)
    llm.engine.spec.policy = RestsEveryOther(4, seed=3)
    core, held, taps = llm.engine.core, llm.engine.spec.proposer._taps, []
    launch = core.executor.launch

    def spy(inputs, step_taps):
        taps.append(step_taps)
        return launch(inputs, step_taps)

    core.executor.launch = spy
    finish = core.runner.finish

    def watched(step, res):
        out = finish(step, res)
        if not step.taps:
            assert not any(s.request_id in held for s in step.batch.seqs)
        return out

    core.runner.finish = watched
    assert ids(llm.generate(prompts(4, seed=11), greedy)) == want
    assert () in taps and core.runner.taps in taps and llm.engine.spec.stats.drafts > 0
