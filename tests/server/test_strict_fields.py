"""Client mistakes are 400s that name the field, never silently reinterpreted; vLLM's
`--tokenizer PATH` is the tokenizer, not an abbreviation of another flag."""

from __future__ import annotations

import shutil

import torch

import httpx
import pytest

from k3serve import LLM, SamplingParams
from k3serve.cli import build_parser
from k3serve.server.launch import engine_kwargs

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_thinking_must_be_a_boolean(live_server, value):
    base, _ = live_server
    for key in ("thinking", "enable_thinking"):
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"messages": MSGS, "max_tokens": 2, "chat_template_kwargs": {key: value}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{key}", r.text
    ok = httpx.post(
        base + "/v1/chat/completions",
        timeout=60,
        json={"messages": MSGS, "max_tokens": 2, "chat_template_kwargs": {"thinking": False}},
    )
    assert ok.status_code == 200, ok.text


def test_min_tokens_past_max_tokens_is_a_400(live_server):
    base, _ = live_server
    for path, body in (
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "min_tokens": 5}),
        ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 3, "min_tokens": 4}),
        ("/v1/completions", {"prompt": "a b", "max_tokens": 2, "min_tokens": 3}),
    ):
        r = httpx.post(base + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    r = httpx.post(
        base + "/v1/completions", json={"prompt": "a b", "max_tokens": 4, "min_tokens": 4, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


@pytest.mark.parametrize("tokens", [["5"], [True], [5, "6"], [5.0]])
def test_detokenize_takes_only_integer_ids(live_server, tokens):
    base, _ = live_server
    r = httpx.post(base + "/detokenize", json={"tokens": tokens}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert httpx.post(base + "/detokenize", json={"tokens": [5, 6]}, timeout=60).status_code == 200


def test_tokenizer_flag_is_the_tokenizer_and_abbreviations_are_refused(tiny_k3_dir, tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--tokenizer", str(tmp_path)])
    assert args.tokenizer == str(tmp_path) and args.vllm_tokenizer_mode is None
    assert engine_kwargs(args)["tokenizer"] == str(tmp_path)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tokenizer-m", "auto"])  # a prefix of --tokenizer-mode
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model", "64"])  # a prefix of --max-model-len
    capsys.readouterr()
    # it acts: a checkpoint without tokenizer files serves with the tokenizer from elsewhere
    model, tok = tmp_path / "model", tmp_path / "tok"
    shutil.copytree(tiny_k3_dir, model)
    tok.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.move(model / name, tok / name)
    with pytest.raises(Exception, match="tiktoken.model"):
        LLM(str(model), cache_memory="8MiB", max_model_len=128)
    llm = LLM(str(model), tokenizer=str(tok), cache_memory="8MiB", max_model_len=128)
    want = LLM(str(tiny_k3_dir), cache_memory="8MiB", max_model_len=128)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    assert (
        llm.generate(["a b c"], greedy)[0].outputs[0].token_ids
        == want.generate(["a b c"], greedy)[0].outputs[0].token_ids
    )


def test_without_xgrammar_constraints_are_a_501_saying_what_to_install(live_server, monkeypatch):
    """`pip install k3serve` without the extra: a constrained request is refused with what to
    install (was a 500 "internal server error (ModuleNotFoundError)"), the rest is served."""
    base, _ = live_server
    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for path, body in (
        ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {"messages": MSGS, "tools": tools, "tool_choice": "required"}),
        ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "[ab]+"}}),
    ):
        r = httpx.post(base + path, json={**body, "max_tokens": 4}, timeout=60)
        assert r.status_code == 501, r.text
        assert "pip install" in r.json()["error"]["message"] and "xgrammar" in r.json()["error"]["message"]
    assert (
        httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=60).status_code
        == 200
    )


def test_overflowing_weights_are_the_models_fault_not_the_clients(tiny_k3_dir, tmp_path, caplog, monkeypatch):
    """A checkpoint whose finite weights overflow at run time (lm_head rows at 3e38): every
    request used to get 400 "check temperature, penalties..."; now a 500 that names the model,
    logged once, and a client's own bad setting is still its 400."""
    import json as _json

    from safetensors.torch import load_file, save_file

    from k3serve.sampling import sampler
    from tests.live import serving
    from tests.server.conftest import make_app

    monkeypatch.setattr(sampler, "_fault_logged", False)  # logged once a process: this test's first
    model = tmp_path / "overflow"
    shutil.copytree(tiny_k3_dir, model)
    index = _json.loads((model / "model.safetensors.index.json").read_text())
    name = "language_model.lm_head.weight"
    shard = model / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = torch.full_like(tensors[name], 3e38)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    app, _ = make_app(model)
    with serving(app) as base, caplog.at_level("ERROR"):
        for body in (
            {"prompt": "a b", "max_tokens": 3, "temperature": 0},
            {"prompt": "a b", "max_tokens": 3, "temperature": 1.0, "seed": 1},
        ):
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 500, r.text
            assert "model" in r.json()["error"]["message"] and "temperature" not in r.json()["error"]["message"]
        assert sum("non-finite logits" in rec.getMessage() for rec in caplog.records) == 1
        r = httpx.post(base + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": -3}, timeout=60)
        assert r.status_code == 400, r.text
