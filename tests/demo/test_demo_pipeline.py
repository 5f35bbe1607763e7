"""Demo-model pipeline: training samples are exactly what the server renders and parses,
QAT export reproduces the trained network in the served checkpoint, training is reproducible."""

from __future__ import annotations

import json

import pytest
import torch

from k3serve.chat.render import ChatOptions, ChatRenderer
from k3serve.demo.data import TOOLS, add_thought, arithmetic, conversations
from k3serve.server.parsers.output import OutputParser
from k3serve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_k3_dir):
    return Tokenizer.from_dir(tiny_k3_dir)


def test_add_thought_is_right_about_carries():
    assert add_thought(27, 45) == "7 + 5 = 12; 2 + 4 + 1 = 7. So 72."
    assert add_thought(99, 5).endswith("So 104.") and add_thought(0, 0) == "0 + 0 = 0. So 0."


def test_held_out_pairs_never_appear_in_training():
    import random

    rng = random.Random(0)
    train = {arithmetic(rng)[0] for _ in range(3000)}
    held = {arithmetic(random.Random(1), held_out=True)[0] for _ in range(50)}
    assert train.isdisjoint(held)


def test_samples_are_server_prompts_and_parse_back(tok, tiny_k3_dir):
    renderer = ChatRenderer("kimi_k3", tok, tiny_k3_dir)
    seen = set()
    for s in conversations(tok, 40, seed=3):
        seen.add(s.kind)
        assert s.completion[-1] == tok.token_to_id("<|end_of_msg|>")
        text = tok.decode(s.completion[:-1])
        start = "response" if s.kind in ("no-think",) else "think"
        p = OutputParser("kimi_k3", start, tools_enabled=True).parse(text)
        if s.kind == "tool-call":
            call = p.tool_calls[0]
            assert call.name in {t["function"]["name"] for t in TOOLS} and json.loads(call.arguments)
        else:
            assert p.content and not p.tool_calls
        if s.kind == "arithmetic":
            assert p.reasoning.endswith(p.content.split("= ")[-1].rstrip(".") + ".")
    assert {"arithmetic", "tool-call", "tool-answer"} <= seen
    # the prompt of a first-turn tool sample is exactly what /v1/chat/completions renders
    s = next(x for x in conversations(tok, 40, seed=3) if x.kind == "tool-call")
    user = tok.decode(s.prompt).split('role="user"<|sep|>')[1].split("<|close|>")[0]
    served = renderer.render([{"role": "user", "content": user}], ChatOptions(tools=TOOLS)).token_ids
    assert served == s.prompt


def test_qat_export_serves_the_trained_network(tmp_path):
    """Trainable model (MXFP4 STE experts) vs the exported checkpoint loaded by the engine:
    same logits once dense weights are rounded to their BF16 release dtype."""
    from k3serve.config.bundled import load_model_config
    from k3serve.demo.train import _init_, demo_config, export_tensors, make_trainable
    from k3serve.models.registry import build_model, load_model
    from k3serve.forward import CacheTensors, ForwardBatch
    from k3serve.testing.builder import _write_shards

    (tmp_path / "config.json").write_text(json.dumps(demo_config(base_vocab=512)))
    cfg = load_model_config(tmp_path)
    model = build_model(cfg)
    _init_(model, seed=1)
    make_trainable(model)
    with torch.no_grad():
        for p in model.parameters():  # train a little: move every weight off its init
            p.add_(0.01 * torch.randn_like(p))
        fp32 = ("_train", "A_log", "dt_bias", "conv1d", "o_norm", "e_score")  # kept in FP32 by the release
        for name, p in model.named_parameters():
            if not any(k in name for k in fp32):
                p.copy_(p.to(torch.bfloat16).float())  # the release stores these in BF16
    _write_shards(tmp_path, cfg, export_tensors(model, cfg), num_shards=1)
    served = load_model(tmp_path, progress=False)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))

    def logits(m):
        cache = CacheTensors.allocate(cfg, 1, 3, 16)
        with torch.no_grad():
            return m.compute_logits(m(ForwardBatch(ids, [40], [0], [0], [[0, 1, 2]], 16), cache).hidden).float()

    torch.testing.assert_close(logits(served), logits(model.eval()), rtol=1e-4, atol=1e-4)


def test_training_is_reproducible(tmp_path):
    """Same seed -> byte-identical tokenizer and weights (deterministic algorithms, one process)."""
    from k3serve.demo.train import train_demo

    kw = dict(steps=2, num_conversations=40, batch=3, seed=5, tokenizer_conversations=40, text_chars=40_000)
    a = train_demo(tmp_path / "a", **kw)
    b = train_demo(tmp_path / "b", **kw)
    assert a["first_loss"] == b["first_loss"] and a["last_loss"] == b["last_loss"]
    for name in ("model.safetensors", "tiktoken.model", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_training_turns_are_independent_sequences(tmp_path):
    """A turn's loss does not depend on its batch mates: each is its own sequence from a fresh
    state, as the server sees a request (packing let attention read an earlier sample's words)."""
    from k3serve.config.bundled import load_model_config
    from k3serve.demo.train import _init_, _loss, demo_config, make_trainable
    from k3serve.models.registry import build_model

    (tmp_path / "config.json").write_text(json.dumps(demo_config(base_vocab=512)))
    cfg = load_model_config(tmp_path)
    model = build_model(cfg)
    _init_(model, seed=2)
    make_trainable(model)
    g = torch.Generator().manual_seed(0)
    a = (torch.randint(0, 512, (70,), generator=g).tolist(), [0] * 50 + [1] * 20)
    b = (torch.randint(0, 512, (33,), generator=g).tolist(), [0] * 10 + [1] * 23)
    with torch.no_grad():
        la, lb, both = _loss(model, cfg, [a]), _loss(model, cfg, [b]), _loss(model, cfg, [a, b])
        everywhere = _loss(model, cfg, [(a[0], [1] * 70)])
    wa, wb = sum(a[1][1:]), sum(b[1][1:])  # the first token is never a target
    torch.testing.assert_close(both, (la * wa + lb * wb) / (wa + wb), rtol=1e-5, atol=1e-6)
    # and the mask matters: the same ids with loss everywhere give a different value
    assert abs(float(everywhere) - float(la)) > 1e-3


def test_an_interrupted_run_resumed_equals_one_run(tmp_path):
    """Checkpoint / resume: a time limit stops the run after its first step, before any periodic
    checkpoint (every 5), and saves the state; resumed to the end, the exported weights are
    byte-identical to an uninterrupted run, drill phase included."""
    from k3serve.demo.train import train_demo

    kw = dict(
        steps=3,
        num_conversations=40,
        batch=2,
        seed=4,
        tokenizer_conversations=40,
        text_chars=40_000,
        drill_steps=2,
        num_drills=30,
    )
    whole = train_demo(tmp_path / "whole", **kw)
    part = train_demo(tmp_path / "split", checkpoint_every=5, time_limit_s=-1, **kw)
    assert part["steps"] == 1 and (tmp_path / "split" / "train_state.pt").is_file()
    rest = train_demo(tmp_path / "split", checkpoint_every=5, resume=True, **kw)
    assert rest["steps"] == 3 and rest["last_loss"] == whole["last_loss"]
    assert (tmp_path / "split" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors"
    ).read_bytes()


def test_drills_answer_from_the_prompt(tok):
    from k3serve.demo.data import drills

    samples = drills(tok, 60, seed=0)
    assert {s.kind for s in samples} >= {"copy", "lookup", "arithmetic", "tool-call"}
    for s in samples:
        prompt, answer = tok.decode(s.prompt), tok.decode(s.completion[:-1])
        if s.kind == "copy":
            said = prompt.split("Repeat after me: ")[1].split("<|close|>")[0]
            assert OutputParser("kimi_k3", "response").parse(answer).content == said
        if s.kind == "lookup":
            value = OutputParser("kimi_k3", "response").parse(answer).content.rstrip(".")
            assert f"is {value}" in prompt
