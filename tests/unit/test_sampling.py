"""Sampler: batched logits processing vs the loop reference; seeded draws; logprobs;
incremental detokenizer (UTF-8 split across tokens, stop strings across tokens)."""

from __future__ import annotations

import math

import pytest
import torch

from k3serve.tokenizer.detokenizer import IncrementalDetokenizer
from k3serve.sampling.logits_process import apply_bias_and_penalties, row_params, truncate
from k3serve.sampling_params import SamplingParams
from k3serve.sampling.reference import process_row
from k3serve.sampling.sampler import Sampler
from k3serve.scheduler.request import Request

V = 50

CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.0, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0.5, logit_bias={3: 5.0, 7: -100.0}, min_tokens=5, stop_token_ids=[11]),
    dict(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.4),
]


def make_req(i: int, **kw) -> Request:
    g = torch.Generator().manual_seed(i)
    prompt = torch.randint(0, V, (6,), generator=g).tolist()
    out = torch.randint(0, V, (4,), generator=g).tolist()
    r = Request(f"r{i}", prompt, SamplingParams(**kw), eos_token_id=1, max_model_len=100)
    r.output_token_ids = out
    return r


def test_batched_processing_matches_reference_rowwise():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), V, dtype=torch.float64) * 3
    reqs = [make_req(i, **c) for i, c in enumerate(CASES)]
    got = apply_bias_and_penalties(logits, reqs)
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    rows = torch.tensor(sampled)
    p = row_params([reqs[i] for i in sampled], torch.float64)
    got[rows] = truncate(got[rows], *p)
    for i, r in enumerate(reqs):
        want = torch.tensor(process_row(logits[i].tolist(), r), dtype=torch.float64)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got[i])), f"case {CASES[i]}: different tokens masked"
        torch.testing.assert_close(got[i][finite], want[finite], rtol=1e-12, atol=1e-12)
    # the cases really exercise masking
    assert not torch.isfinite(got[1]).all() and (torch.isfinite(got[1]).sum() == 5)


def test_min_tokens_masks_eos_and_stop_ids():
    r = make_req(0, temperature=0, min_tokens=9, stop_token_ids=[4])
    logits = torch.zeros(1, V)
    logits[0, 1] = logits[0, 4] = 10.0
    assert Sampler()(logits, [r], [torch.Generator()])[0].token_id not in (1, 4)
    r.params.min_tokens = 0
    assert Sampler()(logits, [r], [torch.Generator()])[0].token_id in (1, 4)


def test_seeded_sampling_is_independent_of_batch_mates():
    logits = torch.randn(3, V)
    reqs = [make_req(i, temperature=1.0, seed=42) for i in range(3)]
    g = torch.Generator().manual_seed(42)
    alone = [Sampler()(logits[1:2], [reqs[1]], [g])[0].token_id for _ in range(20)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 42, 7)]
    together = [Sampler()(logits, reqs, gens)[1].token_id for _ in range(20)]
    assert together == alone and len(set(alone)) > 1


def test_sampling_distribution_follows_top_k():
    """Empirical frequencies under temperature + top-k match the renormalised softmax."""
    logits = torch.randn(1, V)
    r = make_req(0, temperature=0.8, top_k=4)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(4000):
        counts[Sampler()(logits, [r], [gen])[0].token_id] += 1
    top = logits[0].topk(4).indices
    want = torch.softmax(logits[0, top] / 0.8, -1)
    assert counts.sum() == counts[top].sum()
    assert (counts[top] / 4000 - want).abs().max() < 0.03


def test_logprobs_are_raw_and_top_n_sorted():
    logits = torch.randn(1, V)
    r = make_req(0, temperature=0, logprobs=3, repetition_penalty=2.0)
    out = Sampler()(logits, [r], [torch.Generator()])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert math.isclose(out.logprob, raw[out.token_id].item(), rel_tol=1e-6)
    ids = [t for t, _ in out.top_logprobs]
    assert ids == raw.topk(3).indices.tolist()


def test_params_validation_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    # the upper bound is the engine's max_logprobs (20 by default, --max-logprobs), then the vocabulary
    with pytest.raises(ValueError, match="exceeds the vocabulary size 100"):
        SamplingParams(logprobs=101).check_vocab(100)
    SamplingParams(logprobs=99).check_vocab(100)


class ByteTok:
    """Token i < 256 is byte i; 300 is a special token."""

    def decode_bytes(self, ids):
        return bytes(i for i in ids if i < 256) + b"".join(b"<|special|>" for i in ids if i >= 256)

    def is_special(self, i):
        return i >= 256


def test_detokenizer_never_splits_utf8():
    d = IncrementalDetokenizer(ByteTok(), SamplingParams())
    seen = []
    for b in "héllo 🙂".encode():
        d.add(b)
        seen.append(d.visible_text(False))
        assert "\ufffd" not in seen[-1]
    assert seen[-1] == "héllo 🙂"
    assert seen[-2] == "héllo "  # the emoji's first three bytes showed nothing


def test_stop_string_spanning_tokens_is_cut_and_held_back():
    d = IncrementalDetokenizer(ByteTok(), SamplingParams(stop=["END"]))
    for ch in "abcE":
        assert d.add(ord(ch)) is None
    assert d.visible_text(False) == "ab"  # "cE"? no: 2 chars held back ("E" may start "END")
    assert d.add(ord("N")) is None
    assert d.add(ord("D")) == "END"
    assert d.text == "abc"
    inc = IncrementalDetokenizer(ByteTok(), SamplingParams(stop=["EN"], include_stop_str_in_output=True))
    for ch in "xEN":
        hit = inc.add(ord(ch))
    assert hit == "EN" and inc.text == "xEN"


def test_special_tokens_skipped_unless_asked():
    d = IncrementalDetokenizer(ByteTok(), SamplingParams())
    d.add(ord("a"))
    d.add(300)
    assert d.text == "a"
    keep = IncrementalDetokenizer(ByteTok(), SamplingParams(skip_special_tokens=False))
    keep.add(300)
    assert keep.text == "<|special|>"


def test_bias_and_penalties_copy_only_when_a_row_asks_for_them():
    """Plain rows get the logits back uncopied; a row with penalties gets a copy (the input
    untouched) equal to the loop reference on that row, the plain rows unchanged."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    plain = [make_req(i, temperature=0.0) for i in range(3)]
    assert apply_bias_and_penalties(logits, plain) is logits
    mixed = [plain[0], make_req(1, temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.3), plain[2]]
    before = logits.clone()
    got = apply_bias_and_penalties(logits, mixed)
    assert got is not logits and torch.equal(logits, before)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2]) and not torch.equal(got[1], logits[1])
