"""Structured outputs enforced by xgrammar in the sampler: for random JSON schemas on a
random-weight tiny K3 at temperature 1, every output validates (jsonschema, an independent
validator), with and without speculative decoding; unconstrained requests batched with them
get exactly the tokens they get alone; drafts the grammar refuses are cut before verification;
regex / choice / grammar constraints and the grammar state's rollback."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3serve import LLM, SamplingParams
from k3serve.sampling.grammar import GrammarBackend
from k3serve.sampling_params import ParamError
from k3serve.sampling_params import StructuredOutputs

KW = dict(cache_memory="32MiB", max_model_len=1024, max_num_batched_tokens=256, seed=0)
NAMES = st.text("abcdefghij_", min_size=1, max_size=6)
LEAF = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 5000),
    ),
    st.just({"type": "number", "minimum": -100, "maximum": 100}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.lists(
        st.one_of(st.text("xyz ", min_size=1, max_size=4), st.integers(-5, 5)), min_size=1, max_size=4, unique=True
    ).map(lambda v: {"enum": v}),
)


def _object(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(
            lambda req: {"type": "object", "properties": props, "required": sorted(req), "additionalProperties": False},
            st.sets(st.sampled_from(sorted(props))),
        )
    )


SCHEMA = st.recursive(
    LEAF,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def plain(tiny_k3_dir):
    return LLM(str(tiny_k3_dir), **KW)


@pytest.fixture(scope="module")
def speculative(tiny_k3_dir):
    return LLM(
        str(tiny_k3_dir),
        **KW,
        # K pinned: every proposed draft meets the grammar (cut, masked) before verification
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False},
    )


def _constrained(llm, so: StructuredOutputs, seeds, free_prompt):
    eos = llm.engine.model.cfg.eos_token_id
    so = StructuredOutputs(so.kind, so.spec, stop_ids=(eos,), any_whitespace=False)
    prompts = [{"prompt_token_ids": [5 + s % 500, 9, 13]} for s in seeds] + [{"prompt_token_ids": free_prompt}]
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=s, structured=so) for s in seeds]
    params.append(SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return llm.generate(prompts, params)


@pytest.mark.parametrize("engine", ["plain", "speculative"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMA, seeds=st.lists(st.integers(0, 2**31), min_size=2, max_size=3, unique=True))
def test_every_output_validates_against_a_random_schema(engine, request, schema, seeds):
    llm = request.getfixturevalue(engine)
    free = [7, 8, 9, 10, 7, 8, 9, 10]  # repetitive: ngram drafts get proposed for it too
    outs = _constrained(llm, StructuredOutputs.json_schema(schema), seeds, free)
    for o in outs[:-1]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    alone = llm.generate([{"prompt_token_ids": free}], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert outs[-1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_grammar_refused_drafts_are_cut_before_verification(speculative):
    runner = speculative.engine.runner
    before = runner.constraint_stats.drafts_cut
    # the prompt repeats "ab ": after the output's first "a", ngram drafts "b", " a", "b", and the
    # grammar refuses " a" (it wants " cd" after "ab"): two of the three drafts are cut
    prompt = speculative.engine.tokenizer.encode("ab ab ab ab ab ab ab ab ")
    so = StructuredOutputs("regex", "ab cd", stop_ids=(speculative.engine.model.cfg.eos_token_id,))
    out = speculative.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20, temperature=0, structured=so)
    )
    assert out[0].outputs[0].text == "ab cd"
    assert runner.constraint_stats.drafts_cut >= before + 2  # those two, and any later refused ones


def test_regex_choice_and_grammar_constraints(plain):
    eos = plain.engine.model.cfg.eos_token_id
    cases = [
        (StructuredOutputs("regex", r"[0-9]{3}-[a-z]{2}", stop_ids=(eos,)), r"[0-9]{3}-[a-z]{2}"),
        (StructuredOutputs.choice(["alpha", "beta", "gamma"], stop_ids=(eos,)), "alpha|beta|gamma"),
        (StructuredOutputs("grammar", 'root ::= "(" [a-c]+ ")"', stop_ids=(eos,)), r"\([a-c]+\)"),
    ]
    for so, pattern in cases:
        outs = plain.generate(
            [{"prompt_token_ids": [5, 6]}] * 3,
            [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=so) for s in range(3)],
        )
        for o in outs:
            assert re.fullmatch(pattern, o.outputs[0].text), (so.kind, o.outputs[0].text)
    with pytest.raises(ParamError, match="does not compile"):
        plain.generate([{"prompt_token_ids": [5]}], SamplingParams(structured=StructuredOutputs("json", '{"type": 1}')))


def test_constraint_rollback_restores_the_state(plain):
    from k3serve.sampling.grammar import Constraint

    backend = plain.engine.runner.grammar
    tok = plain.engine.tokenizer
    close, tail = 1, (2, 3)
    so = StructuredOutputs("regex", "ab", start_after=tuple(tok.encode("go:")), stop_ids=(close,), tail=tail)
    c: Constraint = backend.constraint(so)
    seq = tok.encode("xx go:") + tok.encode("ab") + [close, 2, 3]
    masks = []
    for t in seq:
        bm = backend.allocate(1)
        c.fill(bm, 0)
        masks.append(bm.clone())
        assert c.accept(t)
    assert c.phase == "done"
    c.rollback(len(seq) - 2)
    bm = backend.allocate(1)
    c.fill(bm, 0)
    assert torch.equal(bm, masks[2]) and c.phase == "free"
    fresh = backend.constraint(StructuredOutputs("regex", "ab", stop_ids=(close,)))
    assert not fresh.accept(tok.encode("z")[0]) and fresh.phase == "grammar" and not fresh.history


def _allowed(bitmask: torch.Tensor, vocab: int) -> set[int]:
    bits = bitmask[0].view(torch.uint8).view(-1)  # little-endian int32 words: bit i of the vocabulary
    return {i for i in range(vocab) if bits[i // 8] >> (i % 8) & 1}


def test_a_closing_channel_refuses_ending_inside_it_and_obeys_its_budget(plain):
    """The free part as K3's think channel: refused ids are masked and refused, its first
    closing token forces the rest of the closing, the budget forces the closing, and drafts
    that cross from the channel into the grammar get the grammar's masks (the DSpark 400)."""
    tok, V = plain.engine.tokenizer, plain.engine.model.cfg.vocab_size
    backend = GrammarBackend(tok, V)
    eom, close, opening = 7, 9, (11, 12)
    so = StructuredOutputs(
        "regex",
        "ab",
        start_after=opening,
        free_close=(close, 10, *opening),
        free_refused=(eom,),
        free_budget=3,
        stop_ids=(close,),
    )

    def mask(c) -> set[int]:
        bm = backend.allocate(1)
        c.fill(bm, 0)
        return _allowed(bm, V)

    c = backend.constraint(so)
    allowed = mask(c)
    assert eom not in allowed and close in allowed and len(allowed) == V - 1
    assert not c.accept(eom) and c.phase == "free"
    free = tok.encode("xyz")[:3]
    for t in free:
        assert c.accept(t)
    assert mask(c) == {close} and not c.accept(free[0])  # the budget is spent: only the closing
    assert c.accept(close) and mask(c) == {10} and not c.accept(11)
    assert c.accept(10) and c.accept(11) and c.accept(12) and c.phase == "grammar"
    grammar_mask = mask(c)
    assert grammar_mask == set(tok.encode("a")[:1])
    c.rollback(4 + len(free))
    assert c.phase == "free" and c.free == 0 and not c.history
    # drafts from inside the channel into the grammar: the rows after the opening are masked
    drafts = [free[0], close, 10, 11, 12]
    assert c.valid_prefix(drafts + [eom]) == len(drafts)
    bm = backend.allocate(len(drafts) + 1)
    c.fill_drafts(bm, 0, drafts)
    assert _allowed(bm[5:6], V) == grammar_mask and _allowed(bm[2:3], V) == {10}
    assert c.phase == "free" and not c.history


@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "maxLength": 5}])
def test_json_strings_refuse_encoded_surrogates(plain, string):
    """xgrammar's string classes admit ED A0..BF xx (a UTF-16 surrogate encoded as UTF-8, which
    is not UTF-8 and decodes to three U+FFFD): the engine's JSON grammar refuses it; real
    multi-byte characters still pass. Found by the random-schema test above (a maxLength-5
    string came back 8 characters long)."""
    backend = GrammarBackend(plain.engine.tokenizer, plain.engine.model.cfg.vocab_size)
    so = StructuredOutputs.json_schema(string, stop_ids=(plain.engine.model.cfg.eos_token_id,))
    single = {bytes([b]): b for b in range(256)}  # the tiny vocabulary starts with the 256 bytes
    assert all(plain.engine.tokenizer.decode_bytes([i]) == b for b, i in single.items())

    def accepts(data: bytes) -> bool:
        c = backend.constraint(so)
        return all(c.accept(single[bytes([b])]) for b in data)

    assert accepts('"3ѰЦ'.encode()) and accepts('"中'.encode())
    assert not accepts(b'"3\xed\xaf\xb2')
