"""Prefill/decode hand-off between two engines (issue 17, engine side): greedy output through a
prefill engine + a decode engine equals one colocated engine, for a prompt shorter than a block,
one across block boundaries, and a second prompt sharing a prefix the decode engine already
caches (then only the new rows move, plus the whole KDA state); the bytes moved equal the
planner's prediction; both engines' pools return to zero; an unpulled hand-off expires."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.cache.sizing import kda_state_bytes_per_request
from k3serve.planner.disagg import handoff as predicted

NEW = 10


def engines(path):
    kw = dict(cache_memory="32MiB", max_model_len=512, block_size=16)
    return LLM(str(path), **kw), LLM(str(path), **kw), LLM(str(path), **kw)


def run_until_done(engine, rid):
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = out.outputs[0].token_ids
    return tokens


def disaggregated(prefill, decode, rid, prompt):
    """Prefill on one engine (first token), hand the state over, decode on the other."""
    prefill.add_request(
        rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), keep_cache=True
    )
    first = run_until_done(prefill, rid)
    held = decode.held_tokens(prompt)
    h = prefill.pull_handoff(rid, held)
    decode.add_prefilled(h, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    out = run_until_done(decode, rid)
    assert out[0] == first[0]  # the decode engine's output starts with the prefill's first token
    return out, h, held


def both_ways(colocated, one, other, tag: str) -> list:
    """Hand a 37-token prompt (two block boundaries) from `other` to `one` and another back:
    each decodes the colocated engine's greedy tokens. Returns the two hand-offs."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    handoffs = []
    for i, (prefill, decode) in enumerate([(other, one), (one, other)]):
        prompt = torch.randint(1, 500, (37,), generator=g).tolist()
        want = colocated.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
        got, h, _ = disaggregated(prefill.engine, decode.engine, f"{tag}{i}", prompt)
        assert got == want, (i, got, want)
        handoffs.append(h)
    return handoffs


def per_token_latent_bytes(engine) -> int:
    return sum(t.shape[1] * t.element_size() for t in engine.executor.cache.latent if t is not None)


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_handoff_decodes_as_a_colocated_engine_would(kind, tiny_k3_dir, tiny_kl_dir):
    path = tiny_k3_dir if kind == "k3" else tiny_kl_dir
    colocated, p_llm, d_llm = engines(path)
    prefill, decode = p_llm.engine, d_llm.engine
    g = torch.Generator().manual_seed(1)
    short = torch.randint(1, 500, (5,), generator=g).tolist()  # shorter than a block
    long = torch.randint(1, 500, (37,), generator=g).tolist()  # crosses two block boundaries
    shared = long[:32] + torch.randint(1, 500, (9,), generator=g).tolist()  # shares 2 blocks with `long`
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    cfg = prefill.model.cfg
    kv = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[
        decode.executor.cache.latent[next(i for i, t in enumerate(decode.executor.cache.latent) if t is not None)].dtype
    ]
    for i, prompt in enumerate([short, long, shared]):
        want = colocated.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
        got, h, held = disaggregated(prefill, decode, f"r{i}", prompt)
        assert got == want, (i, got, want)
        assert held == (32 if prompt is shared else 0)  # the second request finds `long`'s blocks cached
        assert h.start == held and h.latent_bytes == (len(prompt) - held) * per_token_latent_bytes(decode)
        assert h.state_bytes == kda_state_bytes_per_request(cfg)
        assert h.nbytes == predicted(cfg, len(prompt), kv, cached_tokens=held).total_bytes
    for engine in (prefill, decode):  # every block and slot back (cached-free blocks count as free)
        assert engine.cache.num_requests == 0 and engine.cache.num_free_slots == engine.cache.slots.num_slots
        assert engine.cache.num_free_blocks == engine.cache.blocks.num_blocks
    assert not prefill.handoffs.held


def test_an_unpulled_handoff_expires_and_a_missing_prefix_is_refused(tiny_kl_dir):
    _, p_llm, d_llm = engines(tiny_kl_dir)
    prefill, decode = p_llm.engine, d_llm.engine
    prefill.handoffs.ttl_s = 0.0
    prefill.add_request(
        "x", {"prompt_token_ids": list(range(1, 30))}, SamplingParams(temperature=0, max_tokens=1), keep_cache=True
    )
    run_until_done(prefill, "x")
    with pytest.raises(KeyError, match="no prefilled request 'x'"):
        prefill.pull_handoff("x")
    prefill.handoffs.ttl_s = 60.0
    prefill.add_request(
        "y", {"prompt_token_ids": list(range(1, 40))}, SamplingParams(temperature=0, max_tokens=1), keep_cache=True
    )
    run_until_done(prefill, "y")
    h = prefill.pull_handoff("y", held_tokens=32)  # claims 32 tokens the decode engine does not hold
    with pytest.raises(ValueError, match="no longer holds the 32 prompt tokens"):
        decode.add_prefilled(h)
    assert decode.cache.num_requests == 0 and prefill.cache.num_requests == 0


def test_a_decode_engine_with_speculative_decoding_continues_the_handoff(tiny_k3_dir):
    """ngram drafts on the decode engine (greedy verification is exact): the same tokens."""
    colocated, p_llm, _ = engines(tiny_k3_dir)
    spec = LLM(
        str(tiny_k3_dir),
        cache_memory="32MiB",
        max_model_len=512,
        block_size=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    prompt = [5, 6, 7, 8] * 9  # repetitive: the n-gram drafter proposes
    want = (
        colocated.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    got, _, _ = disaggregated(p_llm.engine, spec.engine, "s", prompt)
    assert got == want and spec.engine.cache.num_requests == 0


# ---- what a hand-off carries beside the cache: the random stream, logprobs, a grammar, media keys ----
def final_output(engine, rid, done=None):
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                done = out
    return done


def carried(prefill, decode, rid, prompt, params):
    """The request's own parameters on both sides (the prefill samples one token with them),
    the hand-off through its wire format, media prompts keyed as the prefix cache keys them."""
    from k3serve.engine.handoff import from_bytes, to_bytes

    prefill.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1), keep_cache=True)
    final_output(prefill, rid)
    held = decode.held_tokens(decode.cache_ids(prompt))
    h = from_bytes(to_bytes(prefill.pull_handoff(rid, held)))
    return final_output(decode, rid, decode.add_prefilled(h, params)), held


def test_a_seeded_sampled_request_continues_its_random_stream_and_logprobs(tiny_k3_dir):
    """temperature 1 with a seed: the decode side draws from the prefill's generator where its
    first draw left it (a fresh generator of the same seed would repeat the first draw), and the
    logprobs of every token and of the prompt are the colocated ones."""
    colocated, p_llm, d_llm = engines(tiny_k3_dir)
    prompt = {"prompt_token_ids": list(range(7, 44))}
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    want = colocated.generate([prompt], params)[0]
    got, _ = carried(p_llm.engine, d_llm.engine, "seeded", prompt, params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs == want.outputs[0].logprobs  # the same math on the same rows: bitwise
    assert got.outputs[0].cumulative_logprob == want.outputs[0].cumulative_logprob
    assert got.prompt_logprobs == want.prompt_logprobs
    first_draw = colocated.generate([prompt], dataclasses.replace(params, max_tokens=1))[0]
    assert first_draw.outputs[0].token_ids[0] == want.outputs[0].token_ids[0]  # the first draw is the seed's


def test_a_grammar_is_replayed_over_the_first_token(tiny_k3_dir):
    """The decode side's grammar starts after the prefill's first token: the output still
    matches the pattern, and is the colocated one."""
    import re

    from k3serve.sampling_params import StructuredOutputs

    colocated, p_llm, d_llm = engines(tiny_k3_dir)
    eos = colocated.engine.model.cfg.eos_token_id
    params = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=20,
        structured=StructuredOutputs("regex", r"[0-9]{3}-[a-z]{2}", stop_ids=(eos,)),
    )
    prompt = {"prompt_token_ids": list(range(20, 41))}
    want = colocated.generate([prompt], params)[0].outputs[0]
    got, _ = carried(p_llm.engine, d_llm.engine, "g", prompt, params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", got.outputs[0].text), got.outputs[0].text
    assert got.outputs[0].token_ids == want.token_ids


def test_an_image_prompt_hands_off_keyed_by_its_image(tiny_k3_dir):
    """The decode side encodes no image: the latent rows carry it. Its prefix cache keys the
    pads by image content, so a second request with the same image finds the image's blocks
    held, and one with another image behind the same text does not."""
    from k3serve.chat.k3_xtml import Seg, encode_segments, media_block, message
    from k3serve.multimodal.image import ImageSpec, load_image
    from tests.server.test_multimodal import png

    colocated, p_llm, d_llm = engines(tiny_k3_dir)
    tok, spec = colocated.engine.tokenizer, ImageSpec(patch_size=colocated.engine.model.cfg.vision.patch_size)

    def prompt(seed, text):
        img = load_image(png(seed), spec)
        ids = encode_segments(tok, message("user", media_block(img) + [Seg(text)]))
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": [img]}}

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = prompt(3, "What is in the picture?")
    want = colocated.generate([first], greedy)[0].outputs[0].token_ids
    got, held = carried(p_llm.engine, d_llm.engine, "img1", first, greedy)
    assert held == 0 and got.outputs[0].token_ids == want
    assert d_llm.engine.media.misses == 0  # nothing was encoded on the decode side
    same = prompt(3, "Describe its colours.")
    got, held = carried(p_llm.engine, d_llm.engine, "img2", same, greedy)
    pads = first["prompt_token_ids"].index(colocated.engine.model.cfg.media_placeholder_token_id)
    n_img = first["multi_modal_data"]["image"][0].num_tokens
    assert held >= (pads + n_img) // 16 * 16 > 0  # the image's whole blocks are held
    assert got.outputs[0].token_ids == colocated.generate([same], greedy)[0].outputs[0].token_ids
    other = prompt(4, "What is in the picture?")
    assert d_llm.engine.held_tokens(d_llm.engine.cache_ids(other)) <= pads // 16 * 16
