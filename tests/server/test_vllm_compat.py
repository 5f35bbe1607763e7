"""What a vLLM user's launch line and checkpoint bring: vLLM's flags (implemented, accepted as
no-ops, or refused with the reason), `--chat-template` and the checkpoint's own template for a
K3 checkpoint whose Hugging Face tokenizer lacks the XTML specials, generation_config.json
defaults, --max-logprobs, and the fp8 latent cache."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from k3serve.cli import build_parser, main
from k3serve.engine.llm_engine import LLMEngine
from k3serve.sampling_params import SamplingParams
from k3serve.server.launch import build_server
from tests.live import serving

TEMPLATE = (
    "{% for m in messages %}[BOS]{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[BOS]assistant: {% endif %}"
)


def _serve(model_dir, *flags: str):
    return build_server(
        build_parser().parse_args(["serve", *flags] if model_dir is None else ["serve", str(model_dir), *flags])
    )


def test_a_vllm_launch_line_starts_the_server(tiny_k3_dir, tmp_path):
    tpl = tmp_path / "tpl.jinja"
    tpl.write_text(TEMPLATE)
    line = [
        "--model",
        str(tiny_k3_dir),
        "--served-model-name",
        "k3",
        "--gpu-memory-utilization",
        "0.02",
        "--kv-cache-dtype",
        "fp8",
        "--quantization",
        "compressed-tensors",
        "--chat-template",
        str(tpl),
        "--generation-config",
        "auto",
        "--enable-chunked-prefill",
        "--max-logprobs",
        "5",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
        "--allowed-origins",
        '["*"]',
        "--disable-log-stats",
        "--max-model-len",
        "1024",
        "--tensor-parallel-size",
        "1",
        "--trust-remote-code",
        "--enforce-eager",
        "--swap-space",
        "4",
        "--distributed-executor-backend",
        "mp",
        "--tokenizer-mode",
        "auto",
    ]
    app, state = _serve(None, *line)
    assert (
        state.engine.engine.executor.cache.latent[
            next(i for i, t in enumerate(state.engine.engine.executor.cache.latent) if t is not None)
        ].dtype
        == torch.float8_e4m3fn
    )
    assert state.renderer.source == "--chat-template"
    with serving(app) as base:
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"model": "k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": "a", "max_tokens": 2, "logprobs": 6})
        assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": "a", "max_tokens": 2, "logprobs": 5})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 5


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--limit-mm-per-prompt", '{"audio": 1}'], "takes a JSON object like"),
        (["--tensor-parallel-size", "3"], "num_heads = 4 is not divisible by --tensor-parallel-size 3"),
        (["--distributed-executor-backend", "uni", "-tp", "2"], "needs --tensor-parallel-size 1"),
        (["--quantization", "awq"], "never requantizes"),
        (["--no-enable-chunked-prefill"], "always chunks prefill"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--chat-template", "no-such-file"], "not a file, and not a Jinja template"),
        (["--generation-config", "/nonexistent"], "generation_config.json"),
    ],
)
def test_unsupported_vllm_flags_say_why(tiny_k3_dir, capsys, flags, says):
    assert main(["serve", str(tiny_k3_dir), "--cache-memory", "16MiB", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "unrecognized arguments" not in err


def test_quantization_must_match_the_checkpoint(tiny_kl_dir, capsys):
    # (mxfp4 / nvfp4 on this unquantized checkpoint quantize its experts at load: issue 64,
    # tests/model/test_convert.py; a compressed-tensors checkpoint it is not)
    assert main(["serve", str(tiny_kl_dir), "--cache-memory", "16MiB", "--quantization", "compressed-tensors"]) == 2
    assert "not quantized" in capsys.readouterr().err


def _hf_k3(src, dst, template: str | None, jinja_file: bool = False):
    """A K3 checkpoint shipped with a Hugging Face tokenizer.json that lacks K3's XTML specials."""
    from k3serve.testing.builder import write_hf_tokenizer

    shutil.copytree(src, dst)
    (dst / "tiktoken.model").unlink()
    write_hf_tokenizer(dst, ["user: hello there, assistant: hi! how are you today?"], ["[BOS]", "[EOS]"], 400)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]"}
    if template and not jinja_file:
        cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    if template and jinja_file:
        (dst / "chat_template.jinja").write_text(template)
    return dst


def test_a_k3_checkpoint_with_an_hf_tokenizer_serves_its_own_template(tiny_k3_dir, tmp_path, capsys):
    bare = _hf_k3(tiny_k3_dir, tmp_path / "bare", None)
    assert main(["serve", str(bare), "--cache-memory", "16MiB"]) == 2  # fails at start-up, not per request
    err = capsys.readouterr().err
    assert "lacks K3's XTML special tokens (<|open|>" in err and "--chat-template" in err
    for name, jinja_file in (("cfg", False), ("jinja", True)):
        ckpt = _hf_k3(tiny_k3_dir, tmp_path / name, TEMPLATE, jinja_file)
        app, state = _serve(ckpt, "--cache-memory", "16MiB", "--max-model-len", "512")
        assert state.renderer.source == "the checkpoint's chat template"
        msgs = [{"role": "user", "content": "hello there"}]
        with serving(app) as base:
            r = httpx.post(base + "/v1/chat/completions", timeout=60, json={"messages": msgs, "max_tokens": 3})
            assert r.status_code == 200, r.text
            ids = httpx.post(base + "/tokenize", json={"messages": msgs}).json()["tokens"]
        want = "[BOS]user: hello there\n[BOS]assistant: "
        assert ids == state.tokenizer.encode(want, allow_special=True)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    app, state = _serve(bare, "--cache-memory", "16MiB", "--chat-template", TEMPLATE)  # inline works too
    assert state.renderer.source == "--chat-template"


def test_generation_config_supplies_defaults_a_request_overrides(tiny_k3_dir, tmp_path):
    ckpt = tmp_path / "gc"
    shutil.copytree(tiny_k3_dir, ckpt)
    (ckpt / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "max_new_tokens": 5, "temperature": 0.0})
    )
    app, _ = _serve(ckpt, "--cache-memory", "16MiB", "--max-model-len", "512")
    msgs = [{"role": "user", "content": "tell me"}]
    with serving(app) as base:
        a, b = (
            httpx.post(
                base + "/v1/chat/completions", timeout=60, json={"messages": msgs, "ignore_eos": True, "seed": s}
            ).json()
            for s in (1, 2)
        )
        assert a["usage"]["completion_tokens"] == 5 and a["choices"][0]["finish_reason"] == "length"
        assert a["choices"][0]["message"] == b["choices"][0]["message"]  # greedy whatever the seed
        own = httpx.post(
            base + "/v1/chat/completions", timeout=60, json={"messages": msgs, "max_tokens": 2, "ignore_eos": True}
        ).json()
        assert own["usage"]["completion_tokens"] == 2
    app, _ = _serve(ckpt, "--cache-memory", "16MiB", "--max-model-len", "128", "--generation-config", "vllm")
    with serving(app) as base:
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={"messages": msgs, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] > 5  # no file defaults: up to max_model_len


def test_fp8_latent_cache_costs_a_quarter_of_fp32_and_tracks_it(tiny_k3_dir):
    """An fp8 latent row costs 1 B per element against fp32's 4 B (CPU's auto dtype); the first
    sampled position's top-5 logprobs, which read back every prompt row just written, stay
    within 0.1 nats of the fp32-cache run (stated tolerance for e4m3's 3-bit mantissa)."""
    ref = LLMEngine.from_args(str(tiny_k3_dir), cache_memory="16MiB", max_model_len=256)
    fp8 = LLMEngine.from_args(str(tiny_k3_dir), cache_memory="16MiB", max_model_len=256, kv_cache_dtype="fp8")
    assert fp8.plan.token_bytes * 4 == ref.plan.token_bytes
    prompt = list(range(3, 60))
    got = []
    for eng in (ref, fp8):
        eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, logprobs=5))
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        got.append(next(o for o in outs if o.finished))
    a, b = got
    first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
    shared = set(first_a) & set(first_b)
    assert len(shared) >= 4  # the top-5 sets nearly agree
    assert all(abs(first_a[t] - first_b[t]) < 0.1 for t in shared)
    assert b.outputs[0].token_ids and all(0 <= t < fp8.model.cfg.vocab_size for t in b.outputs[0].token_ids)


@pytest.mark.parametrize(
    "path, field, value, says",
    [
        ("/v1/completions", "use_beam_search", True, "beam search is not supported"),
        ("/v1/chat/completions", "use_beam_search", True, "beam search is not supported"),
        ("/v1/chat/completions", "functions", [{"name": "f"}], "declare `tools`"),
        ("/v1/completions", "truncate_prompt_tokens", 8, "this server does not honour it"),
        ("/v1/chat/completions", "made_up_field", 1, "this server does not honour it"),
    ],
)
def test_fields_the_server_does_not_honour_are_refused_by_name(live_server, path, field, value, says):
    base, _ = live_server
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    r = httpx.post(base + path, timeout=60, json={**body, "max_tokens": 2, field: value})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and f"`{field}`" in err["message"] and says in err["message"]
    ok = httpx.post(
        base + path,
        timeout=60,
        json={
            **body,
            "max_tokens": 2,
            "use_beam_search": False,
            "skip_special_tokens": False,
            "add_special_tokens": False,
        },
    )
    assert ok.status_code == 200


def test_every_engine_knob_is_one_serve_flag_read_by_name():
    """Each EngineConfig field is set by the `serve` flag whose dest is its name, and the server
    hands it on by that name (server/flags.py config_kwargs: no hand copy to fall out of step);
    the few that are not flags say why here."""
    import argparse
    import dataclasses

    from k3serve.cli import build_parser
    from k3serve.config.engine_config import EngineConfig
    from k3serve.server.launch import engine_kwargs

    not_flags = {  # (`model` is the positional MODEL, or --model, resolved apart)
        "extra": "unknown keywords, refused",
        "device": "library callers only (the server places by --tensor-parallel-size and CUDA_VISIBLE_DEVICES)",
        "cache_memory_fraction": "library callers only (the server's is --gpu-memory-utilization / --cache-memory)",
        "num_state_slots": "library callers and tests only",
        "load_progress": "the server always shows it",
    }
    args = build_parser().parse_args(["serve"])
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert fields - set(vars(args)) == set(not_flags)
    # a value set on every flag's dest reaches the engine's kwargs under the field's name
    marked = argparse.Namespace(**vars(args))
    for name in fields & set(vars(args)) - {"model", "kv_cache_dtype", "distributed_executor_backend"}:
        if name != "speculative_config":
            setattr(marked, name, ("marker", name))
    kw = engine_kwargs(marked)
    for name in fields & set(vars(args)) - {
        "model",
        "kv_cache_dtype",
        "distributed_executor_backend",
        "speculative_config",
    }:
        assert kw[name] == ("marker", name), name
