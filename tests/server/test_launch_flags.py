"""vLLM launch flags that died at argparse (issue 47 item 5): each is accepted and acts, or is
refused with the reason; a flag that is read but ignored fails its test here."""

from __future__ import annotations

import httpx
import pytest

from k3serve.cli import build_parser, main
from k3serve.server.config_file import apply_config_file
from k3serve.server.launch import engine_kwargs, resolve_args
from k3serve.server.openai.protocol import ChatCompletionRequest
from k3serve.server.parsers.response_format import requested
from tests.live import serving
from tests.server.conftest import make_app


def parsed(*flags: str):
    args = build_parser().parse_args(apply_config_file(["serve", "MODEL", *flags]))
    return args, resolve_args(args)


def test_dtype_spellings():
    args, _ = parsed("--dtype", "float")
    assert engine_kwargs(args)["dtype"] == "float32"
    for half in ("half", "float16"):
        with pytest.raises(ValueError, match="bfloat16"):
            parsed("--dtype", half)


def test_scheduling_policy_reaches_the_engine(tiny_k3_dir):
    args, _ = parsed("--scheduling-policy", "priority")
    assert engine_kwargs(args)["scheduling_policy"] == "priority"
    app, state = make_app(tiny_k3_dir, "--scheduling-policy", "priority")
    assert state.engine.engine.scheduler.config.policy == "priority"


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "max_num_seqs: 7\nblock_size: 32\nenable_prefix_caching: false\nseed: 5\n"
        "speculative_config: {method: ngram, num_speculative_tokens: 2}\n"
    )
    args, _ = parsed("--config", str(cfg), "--max-num-seqs", "9")
    kw = engine_kwargs(args)
    assert (kw["max_num_seqs"], kw["block_size"], kw["seed"]) == (9, 32, 5)
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    (tmp_path / "bad.yaml").write_text("- a list\n")
    assert main(["serve", "--config", str(tmp_path / "bad.yaml")]) == 2


def test_structured_outputs_config():
    with pytest.raises(ValueError, match="xgrammar only"):
        parsed("--structured-outputs-config", '{"backend": "outlines"}')
    with pytest.raises(ValueError, match="unknown keys"):
        parsed("--structured-outputs-config", '{"backend": "xgrammar", "reasoning_parser": "x"}')
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"})
    assert requested(req)[2] is False  # JSON without free whitespace runs, by default
    assert requested(req, any_whitespace=True)[2] is True  # the server's default from the flag
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True},
    )
    assert requested(req, any_whitespace=True)[2] is False  # a request's own setting wins


def test_response_role_and_whitespace_default_act_in_the_server(tiny_k3_dir):
    app, state = make_app(
        tiny_k3_dir,
        "--response-role",
        "model",
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": false}',
    )
    assert state.json_any_whitespace is True
    with serving(app) as base:
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "model"


@pytest.mark.parametrize(
    "flags, match",
    [
        (("--tokenizer-revision", "main"), "the model's own revision"),
        (("--max-num-partial-prefills", "2"), "no separate cap"),
    ],
)
def test_flags_refused_with_the_reason(flags, match):
    with pytest.raises(ValueError, match=match):
        parsed(*flags)


def test_flags_accepted_because_they_hold():
    args, notes = parsed("--hf-token", "hf_x", "--async-scheduling", "--revision", "v2", "--download-dir", "/d")
    assert not any("hf_x" in n for n in notes)  # the token is used now (weights/hub.py), never printed
    assert any("--async-scheduling" in n and "changes nothing" in n for n in notes)
    from k3serve.config.engine_config import EngineConfig
    from k3serve.server.launch import engine_kwargs

    cfg = EngineConfig.from_kwargs("org/name", **engine_kwargs(args))
    assert (cfg.revision, cfg.download_dir, cfg.hf_token) == ("v2", "/d", "hf_x") and "hf_x" not in repr(cfg)


def test_root_path_and_request_id_headers_act(tiny_k3_dir):
    app, _ = make_app(tiny_k3_dir, "--root-path", "/api", "--enable-request-id-headers", "--api-key", "k")
    with serving(app) as base:
        auth = {"Authorization": "Bearer k"}
        r = httpx.get(base + "/api/v1/models", headers=auth)  # under the prefix
        assert r.status_code == 200 and r.json()["data"] and len(r.headers["x-request-id"]) == 32
        assert httpx.get(base + "/v1/models", headers=auth).status_code == 200  # a proxy that strips it
        assert httpx.get(base + "/api/health").status_code == 200  # still public under the prefix
        assert httpx.get(base + "/api/v1/models").status_code == 401
        r = httpx.get(base + "/api/v1/models", headers={**auth, "X-Request-Id": "abc-1"})
        assert r.headers["x-request-id"] == "abc-1"  # the caller's own id comes back
