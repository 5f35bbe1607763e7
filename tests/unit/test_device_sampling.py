"""Device sampling (sampling/device.py) against the CPU sampler's reference pieces.

- the law: many seeded draws of one row match softmax(truncate(...)) of logits_process.py (the
  CPU sampler's own code) by a chi-square test, across seeds and across positions of one seed;
- reproducible per (seed, position), whatever else is in the batch; greedy rows take the argmax;
- penalties equal logits_process's on the same request;
- no host sync: the whole call runs on fake CUDA tensors (FakeTensorMode on this CPU build)
  with no `_local_scalar_dense`, no dynamic-shape op and no copy across devices, and compiles
  whole (`fullgraph=True`).
"""

from __future__ import annotations

import pytest
import torch

from k3serve.sampling import logits_process
from k3serve.sampling.device import DeviceSamplingParams, logprobs_of, penalize, sample, uniforms, unit
from k3serve.sampling_params import SamplingParams
from k3serve.testing.sync_audit import SyncAudit
from tests.spec.test_rejection import chisquare_pvalue

V = 12
CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.05, top_k=8, top_p=0.95),
]


def _reference_probs(row: torch.Tensor, case: dict) -> torch.Tensor:
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    x = logits_process.truncate(
        row[None],
        t(case.get("temperature", 1.0)),
        t(case.get("top_k", 0), torch.long),
        t(case.get("top_p", 1.0)),
        t(case.get("min_p", 0.0)),
    )
    return torch.softmax(x, -1)[0].double()


@pytest.mark.parametrize("case", CASES)
def test_draws_follow_the_cpu_samplers_distribution(case):
    g = torch.Generator().manual_seed(1)
    row = torch.randn(V, generator=g) * 2
    want = _reference_probs(row, case)
    N = 24000
    across_seeds = sample(row.expand(N, V), DeviceSamplingParams.build([{**case, "seed": s} for s in range(N)]))
    across_positions = sample(
        row.expand(N, V), DeviceSamplingParams.build([{**case, "seed": 7, "position": t} for t in range(N)])
    )
    for ids in (across_seeds, across_positions):
        counts = torch.bincount(ids, minlength=V).double()
        assert counts[want == 0].sum() == 0  # nothing truncated away is ever drawn
        keep = want > 0
        assert chisquare_pvalue(counts[keep], want[keep] * N) > 1e-3, (case, counts, want * N)


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 50, generator=g)
    rows = [
        dict(temperature=1.0, seed=11, position=3),
        dict(temperature=0.0),
        dict(temperature=0.8, seed=5),
        dict(temperature=1.2, top_k=10, seed=11, position=4),
        dict(temperature=1.0, seed=99, position=3),
    ]
    ids = sample(logits, DeviceSamplingParams.build(rows))
    for perm in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        again = sample(logits[perm], DeviceSamplingParams.build([rows[i] for i in perm]))
        assert again.tolist() == ids[perm].tolist()
    assert ids[1] == logits[1].argmax()  # greedy: the first maximum
    alone = sample(logits[:1], DeviceSamplingParams.build(rows[:1]))
    assert alone.tolist() == ids[:1].tolist()
    u = uniforms(torch.tensor([11, 11, 12]), torch.tensor([3, 4, 3]), 50)
    assert (u > 0).all() and (u < 1).all() and not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    ends = unit(torch.tensor([0, (1 << 23) - 1]))  # -log(u) must stay finite and positive at both ends
    assert 0 < ends[0] and ends[1] < 1 and torch.isfinite(-torch.log(ends)).all()


def test_penalties_equal_the_cpu_samplers():
    g = torch.Generator().manual_seed(3)
    V2 = 40
    logits = torch.randn(2, V2, generator=g)
    reqs, rows = [], []
    for i, (pres, freq, rep) in enumerate(((0.5, 0.3, 1.3), (0.0, 1.1, 0.8))):
        params = SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)
        prompt, out = [1, 2, 3 + i], [5, 5, 7, 1 + i, 30]

        class View:  # what apply_bias_and_penalties reads of a request
            pass

        v = View()
        v.params, v.prompt_token_ids, v.output_token_ids, v.eos_token_id = params, prompt, out, None
        reqs.append(v)
        rows.append(dict(presence=pres, frequency=freq, repetition=rep))
    want = logits_process.apply_bias_and_penalties(logits.clone(), reqs)
    counts = torch.zeros(2, V2)
    prompt_mask = torch.zeros(2, V2, dtype=torch.bool)
    for i, r in enumerate(reqs):
        counts[i].index_add_(0, torch.tensor(r.output_token_ids), torch.ones(len(r.output_token_ids)))
        prompt_mask[i, torch.tensor(r.prompt_token_ids)] = True
    got = penalize(logits, DeviceSamplingParams.build(rows), counts, prompt_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_logprobs_are_the_raw_models():
    logits = torch.randn(3, 20)
    ids = torch.tensor([4, 0, 19])
    own, (vals, top) = logprobs_of(logits, ids, 2)
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(own, raw[torch.arange(3), ids]) and torch.equal(top, raw.topk(2, -1).indices)


def _fake_cuda_call(B: int, Vv: int):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        f = lambda dt=torch.float32: torch.zeros(B, dtype=dt, device="cuda")  # noqa: E731
        p = DeviceSamplingParams(f(), f(torch.long), f(), f(), f(torch.long), f(torch.long), f(), f(), f())
        logits = torch.empty(B, Vv, device="cuda")
        with SyncAudit() as audit:
            ids = sample(
                logits,
                p,
                bias=torch.zeros(B, Vv, device="cuda"),
                counts=torch.zeros(B, Vv, device="cuda"),
                prompt_mask=torch.zeros(B, Vv, dtype=torch.bool, device="cuda"),
            )
        assert ids.device.type == "cuda" and tuple(ids.shape) == (B,)
    return audit


def test_device_sampling_makes_no_host_sync():
    audit = _fake_cuda_call(4, 1000)
    assert not audit.syncs and not audit.cross, (audit.syncs, audit.cross)


def test_device_sampling_compiles_whole_without_recompiles():
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(sample, fullgraph=True, dynamic=False, backend="aot_eager")
    g = torch.Generator().manual_seed(4)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            logits = torch.randn(4, 64, generator=g)
            p = DeviceSamplingParams.build(
                [dict(temperature=0.0 if b == step else 1.0, top_k=b * 3, seed=b, position=step) for b in range(4)]
            )
            assert torch.equal(fn(logits, p), sample(logits, p))


def test_grammar_bits_unpack_as_xgrammar_applies_them():
    """forward/static.py mask_words + allowed_tokens (the static step's grammar masks) allow
    exactly the tokens xgrammar's own apply_token_bitmask_inplace leaves finite: random words
    (sign bits included), a vocabulary not a multiple of 64, padding rows all allowed."""
    xgr = pytest.importorskip("xgrammar")
    from k3serve.forward.static import mask_words
    from k3serve.sampling.device import allowed_tokens

    V, n, B = 1000, 3, 4
    bitmask = torch.randint(
        -(2**31), 2**31, (n, -(-V // 32)), dtype=torch.int64, generator=torch.Generator().manual_seed(0)
    )
    bitmask = bitmask.to(torch.int32)
    logits = torch.zeros(n, V)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V)
    words = mask_words(bitmask, B, -(-V // 64)).view(B, -1)
    got = allowed_tokens(words, V)
    assert torch.equal(got[:n], torch.isfinite(logits))
    assert got[n:].all() and 0.3 < got[:n].float().mean() < 0.7
