"""Output constraints hold with thinking on and speculation on (the README's own server).

The bundled demo model behind `k3serve serve` with DSpark (the `make serve` flags) and with
ngram speculation, thinking on (the default): json_schema (strict), json_object, choice, regex,
named and required tool choice, 20 requests each at temperature 1. Every reply is valid for its
constraint (jsonschema, `json.loads`, `re.fullmatch`: independent checks), none is empty, none
errors. A drafted token the grammar refuses is a rejected draft, never a 400; the think channel
must close before the constrained part (the end of the message is refused inside it), and a
thinking budget forces its closing.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from k3serve.cli import build_parser
from k3serve.demo.data import TOOLS
from tests.live import serving

PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3"]
SPEC = {
    "dspark": '{"method": "dspark", "model": "dspark", "num_speculative_tokens": 4}',
    "ngram": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "city": {"type": "string", "maxLength": 12}},
    "required": ["answer", "city"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[0-9]{1,3} (apples|pears)"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # bounded forms validate too
N = 20


@pytest.fixture(scope="module", params=["dspark", "ngram"])
def base(request):
    from k3serve.server.launch import build_server

    app, _ = build_server(build_parser().parse_args(["serve", *PARSERS, "--speculative-config", SPEC[request.param]]))
    with serving(app) as url:
        yield url


def _content_check(kind: str):
    def check(msg: dict, finish: str) -> None:
        text = msg["content"]
        assert text, msg
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "json_object":
            assert text.startswith("{"), text
            if finish == "stop":
                assert isinstance(json.loads(text), dict), text
        elif kind == "choice":
            assert text in CHOICES, text
        else:
            assert re.fullmatch(REGEX, text), text

    return check


def _calls_check(named: str | None):
    def check(msg: dict, finish: str) -> None:
        calls = msg.get("tool_calls") or []
        assert calls, msg
        if named:
            assert len(calls) == 1 and calls[0]["function"]["name"] == named, calls
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])

    return check


CASES = {
    "json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": SCHEMA}}},
        _content_check("json_schema"),
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, _content_check("json_object")),
    "choice": ({"structured_outputs": {"choice": CHOICES}}, _content_check("choice")),
    "regex": ({"structured_outputs": {"regex": REGEX}}, _content_check("regex")),
    "named": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "calculator"}}},
        _calls_check("calculator"),
    ),
    "required": ({"tools": TOOLS, "tool_choice": "required"}, _calls_check(None)),
}
QUESTIONS = [
    "What is 23 + 45?",
    "What is the weather in Paris?",
    "Convert 3 km to miles.",
    "What is the capital of Japan?",
    "Repeat after me: Oslo 12",
]


JINJA = (
    "{% for m in messages %}[BOS]{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[BOS]assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def jinja_base(tiny_k3_dir, tmp_path_factory):
    """A tiny K3 served through a Jinja template (no XTML, no K2 tool markup) with ngram drafts:
    required / named tool choice take vLLM's JSON form there."""
    from k3serve.server.launch import build_server

    tpl = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    tpl.write_text(JINJA)
    app, state = build_server(
        build_parser().parse_args(
            [
                "serve",
                str(tiny_k3_dir),
                "--chat-template",
                str(tpl),
                "--speculative-config",
                SPEC["ngram"],
                "--max-model-len",
                "1024",
            ]
        )
    )
    assert not state.renderer.xtml
    with serving(app) as url:
        yield url


# the random-weight tiny model never closes a free string on its own: its tools bound theirs, so
# what is tested is the enforcement, not that model's taste
def _bounded(v: dict) -> dict:
    if v.get("type") == "string":
        return {**v, "maxLength": 10}
    return {"type": "integer", "minimum": -999, "maximum": 999} if v.get("type") == "number" else v


BOUNDED = [
    {
        "type": "function",
        "function": {
            "name": t["function"]["name"],
            "parameters": {
                **t["function"]["parameters"],
                "properties": {k: _bounded(v) for k, v in t["function"]["parameters"]["properties"].items()},
            },
        },
    }
    for t in TOOLS
]
JINJA_CASES = {
    **CASES,
    "named": (
        {"tools": BOUNDED, "tool_choice": {"type": "function", "function": {"name": "calculator"}}},
        _calls_check("calculator"),
    ),
    "required": ({"tools": BOUNDED, "tool_choice": "required", "parallel_tool_calls": False}, _calls_check(None)),
}


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def _constrained_replies(base: str, kind: str, cases: dict, max_tokens: int) -> list[dict]:
    """N requests of one kind at temperature 1: every one a 200 ending as its constraint allows;
    json_object is the one open-ended constraint (the demo model never learned JSON and fills
    keys and strings until max_tokens: 19 of 20 at temperature 1, all 20 greedy)."""
    extra, check = cases[kind]
    bodies = [
        {
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": i,
            **extra,
        }
        for i in range(N)
    ]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda b: _post(base, b), bodies))
    choices = []
    for r in replies:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "tool_calls") or kind == "json_object", choice
        check(choice["message"], choice["finish_reason"])
        choices.append(choice)
    return choices


@pytest.mark.parametrize("kind", list(CASES))
def test_every_constrained_reply_is_valid_with_thinking_and_speculation(base, kind):
    _constrained_replies(base, kind, CASES, 400)


@pytest.mark.parametrize("kind", list(CASES))
def test_constraints_hold_on_a_template_without_tool_markup(jinja_base, kind):
    """Before: required / named tool choice answered 400 "cannot be enforced with this chat
    format"; now a JSON array of calls, returned as tool_calls (finish_reason tool_calls)."""
    for choice in _constrained_replies(jinja_base, kind, JINJA_CASES, 300):
        if kind in ("named", "required"):
            assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice


def test_json_tool_calls_stream_as_their_final_form(jinja_base):
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": 4,
        "tools": BOUNDED,
        "tool_choice": "required",
    }
    final = _post(jinja_base, body).json()["choices"][0]["message"]
    calls, content = [], ""
    with httpx.stream("POST", jinja_base + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"] if json.loads(line[6:])["choices"] else {}
                content += delta.get("content") or ""
                calls += delta.get("tool_calls") or []
    assert not content and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in final["tool_calls"]
    ]


def test_a_thinking_budget_closes_the_think_channel(base):
    """thinking_token_budget 0 with a constraint: nothing is thought and the answer is valid; a
    budget alone (no constraint) caps the reasoning at that many tokens."""
    extra, check = CASES["choice"]
    r = _post(
        base,
        {
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "max_tokens": 80,
            "temperature": 1.0,
            "seed": 3,
            "thinking_token_budget": 0,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert not msg.get("reasoning_content"), msg
    check(msg, r.json()["choices"][0]["finish_reason"])
    for seed in range(4):
        r = _post(
            base,
            {
                "messages": [{"role": "user", "content": "What is 123 + 456?"}],
                "max_tokens": 120,
                "temperature": 1.0,
                "seed": seed,
                "max_thinking_tokens": 5,
            },
        )
        assert r.status_code == 200, r.text
        reasoning = r.json()["choices"][0]["message"].get("reasoning_content") or ""
        ids = httpx.post(base + "/tokenize", json={"prompt": reasoning}).json()["tokens"]
        assert len(ids) <= 5, reasoning


def test_bad_budgets_are_400s(base):
    for body, param in (
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"thinking_token_budget": 3, "max_thinking_tokens": 4}, "max_thinking_tokens"),
    ):
        r = _post(base, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_raw_string_arguments_hold_no_markup():
    """A K3 call's string value is raw text up to `<|close|>argument<|sep|>`: the grammar must
    also keep the other markers out of it, or the parser cannot read the call back."""
    from k3serve.server.parsers.tool_choice import VALUE_END, VALUE_EXCLUDES, k3_tool_choice

    so = k3_tool_choice(TOOLS, "required", {}, True, 0)
    assert VALUE_EXCLUDES in so.spec and VALUE_END not in so.spec
