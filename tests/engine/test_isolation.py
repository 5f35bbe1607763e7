"""One bad request fails alone (issue 18): sampler rows, output processing and the model step.

The reference for every victim is the same request run alone: its tokens must be identical.
"""

from __future__ import annotations

import torch

from k3serve import SamplingParams
from k3serve.sampling import logits_process, sampler as sampler_mod
from k3serve.sampling_params import ParamError
from k3serve.sampling.sampler import Sampler
from k3serve.scheduler.request import Request

import pytest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
VICTIMS = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(3)]
POISON = 477  # a prompt holding this id makes the (patched) model step raise


def req(i: int, **kw) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(**kw), eos_token_id=None, max_model_len=64)


# ---- sampler ---------------------------------------------------------------------------------
def test_a_row_without_finite_logits_fails_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[1] = float("nan")  # e.g. overflowed penalties
    reqs = [req(0, temperature=0.8, seed=1), req(1, temperature=0.8, seed=2), req(2, temperature=0)]
    res = Sampler()(logits, reqs, [torch.Generator().manual_seed(r.params.seed or 0) for r in reqs])
    assert set(res.failed) == {1} and "no finite value" in res.failed[1]
    for i in (0, 2):  # the others get what they get alone
        alone = Sampler()(logits[i : i + 1], [reqs[i]], [torch.Generator().manual_seed(reqs[i].params.seed or 0)])
        assert res[i] == alone[0]
    with pytest.raises(ValueError, match="no finite value"):
        res[1]


def test_a_raising_batch_is_redone_row_by_row_from_the_same_generator_states(monkeypatch):
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    reqs = [req(i, temperature=1.0, top_k=5 + i, seed=10 + i) for i in range(4)]
    ref_gens = [torch.Generator().manual_seed(10 + i) for i in range(4)]
    want = Sampler()(logits, reqs, ref_gens)
    real = logits_process.truncate

    def flaky(x, temp, top_k, top_p, min_p):  # raises on any batch holding request 2 (top_k 7)
        if (top_k == 7).any():
            raise RuntimeError("boom")
        return real(x, temp, top_k, top_p, min_p)

    monkeypatch.setattr(sampler_mod, "truncate", flaky)
    gens = [torch.Generator().manual_seed(10 + i) for i in range(4)]
    got = Sampler()(logits, reqs, gens)
    assert set(got.failed) == {2} and "RuntimeError" in got.failed[2]
    assert all(got[i] == want[i] for i in (0, 1, 3))
    # each surviving generator advanced exactly as in the undisturbed batch
    for i in (0, 1, 3):
        assert torch.equal(gens[i].get_state(), ref_gens[i].get_state())


# ---- parameters --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(logit_bias={0: float("inf")}), "logit_bias"),
        (dict(top_k=1.5), "top_k"),
    ],
)
def test_out_of_range_values_name_their_field(kw, field):
    with pytest.raises(ParamError, match=field) as e:
        SamplingParams(**kw)
    assert e.value.param == field


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),
        (dict(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids"),
    ],
)
def test_token_ids_are_checked_against_the_vocabulary(k3_llm, kw, field):
    with pytest.raises(ParamError, match=f"{field} has token id") as e:
        k3_llm.engine.add_request("bad-vocab", "hi", SamplingParams(max_tokens=4, **kw))
    assert e.value.param == field and not k3_llm.engine.has_unfinished_requests()


def test_edge_values_that_are_valid_still_sample():
    assert SamplingParams(temperature=1e-45).temperature == 1e-2  # vLLM raises tiny temperatures too
    assert SamplingParams(seed=2**64 - 1, n=2).for_sample(1).seed == 0  # wraps inside 64 bits
    r = req(0, temperature=1.0, top_k=2**70, seed=3)
    assert not Sampler()(torch.randn(1, 40), [r], [torch.Generator().manual_seed(3)]).failed


# ---- the engine --------------------------------------------------------------------------------
def _alone(llm):
    return [o.outputs[0].token_ids for o in llm.generate(VICTIMS, GREEDY)]


def _free(eng) -> bool:
    return (
        not eng.has_unfinished_requests()
        and eng.cache.num_free_slots == eng.plan.num_slots
        and eng.cache.num_free_blocks == eng.plan.num_blocks
        and not eng.cache.checkpoints._pins
    )


def test_a_raising_model_step_fails_only_its_cause(k3_llm, monkeypatch):
    want = _alone(k3_llm)
    model = k3_llm.engine.executor.model
    real = model.forward

    def forward(fb, cache, taps=()):
        if (fb.input_ids == POISON).any():
            raise RuntimeError("kernel fault")
        return real(fb, cache, taps)

    monkeypatch.setattr(model, "forward", forward)
    bad = {"prompt_token_ids": [5, 6, POISON, 8]}
    outs = k3_llm.generate([VICTIMS[0], bad, VICTIMS[1], VICTIMS[2]], GREEDY)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == want
    assert all(outs[i].error is None for i in (0, 2, 3))
    assert "model step failed" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert _free(k3_llm.engine) and not k3_llm.engine.scheduler.quarantine


def test_output_processing_failure_fails_only_that_request(k3_llm, monkeypatch):
    want = _alone(k3_llm)
    tok = k3_llm.engine.tokenizer
    target = next(t for t in range(200, 500) if not any(t in w for w in want))
    real = tok.decode_bytes

    def decode_bytes(ids):
        if target in ids:
            raise KeyError(target)
        return real(ids)

    monkeypatch.setattr(tok, "decode_bytes", decode_bytes)
    bad = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={target: 100})
    outs = k3_llm.generate(
        [VICTIMS[0], {"prompt_token_ids": [9, 9, 9]}, VICTIMS[1], VICTIMS[2]], [GREEDY, bad, GREEDY, GREEDY]
    )
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == want
    assert "output processing failed" in outs[1].error
    assert _free(k3_llm.engine)
