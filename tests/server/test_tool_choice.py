"""tool_choice "required" and named, enforced by a grammar over the model's tool-call markup:
on random weights every reply is calls to declared tools with schema-valid arguments (K3 and
the K2 family); the K3 grammar accepts exactly what K3's own renderer writes for a tool-calling
turn (thinking on and off); with "auto" a call to an undeclared tool is dropped; streamed
calls join to the final ones."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from k3serve.chat.k3_xtml import assistant_body, encode_segments, message, open_tag
from k3serve.chat.messages import Message, ToolCall
from k3serve.server.parsers.output import OutputParser
from k3serve.server.parsers.response_format import k3_think_close
from k3serve.server.parsers.tool_choice import k3_tool_choice
from tests.live import serving
from tests.server.conftest import make_app

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "units": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CALC = {"type": "object", "properties": {"expr": {"type": "string", "maxLength": 5}}, "required": ["expr"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "calc", "parameters": CALC}},
]
SCHEMAS = {"get_weather": WEATHER, "calc": CALC}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def _check_calls(choice, allowed: set[str]) -> int:
    calls = choice["message"].get("tool_calls") or []
    assert choice["finish_reason"] == "tool_calls" and calls, choice
    for call in calls:
        name = call["function"]["name"]
        assert name in allowed
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return len(calls)


def test_streamed_tool_call_arguments_join_to_the_final_call(client):
    """Issue 63 item 10: a call's id and name come on its first piece, its arguments in pieces
    as they are generated (before: whole, once the call closed); joined as an OpenAI client
    joins them, they are the non-streamed reply's calls."""
    kw = dict(
        model="tiny-k3",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=450,
        temperature=1.0,
        seed=11,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    final = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, pieces = {}, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.index not in calls:
                assert d.id and d.function.name  # the first piece names the call
                calls[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
            calls[d.index][2] += d.function.arguments or ""
            pieces[d.index] = pieces.get(d.index, 0) + 1
    assert [calls[i] for i in sorted(calls)] == [[c.id, c.function.name, c.function.arguments] for c in final]
    assert final and max(pieces.values()) > 2


@pytest.mark.parametrize(
    "tools, choice, allowed",
    [
        (TOOLS[:1], "required", {"get_weather"}),  # the case: only get_weather declared
        (TOOLS, "required", {"get_weather", "calc"}),
        (TOOLS, {"type": "function", "function": {"name": "calc"}}, {"calc"}),
    ],
)
def test_required_and_named_choices_only_call_declared_tools_k3(live_server, tools, choice, allowed):
    base, _ = live_server
    for seed in range(4):
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=120,
            json={
                "messages": MSGS,
                "tools": tools,
                "tool_choice": choice,
                "max_tokens": 450,
                "temperature": 1.0,
                "seed": seed,
                "parallel_tool_calls": False,
                "chat_template_kwargs": {"thinking": False},
            },
        )
        assert r.status_code == 200, r.text
        assert _check_calls(r.json()["choices"][0], allowed) == 1


def test_the_k3_call_grammar_accepts_what_the_renderer_writes(live_server):
    """Independent reference: K3's own renderer. A tool-calling assistant turn it renders (after
    the generation prompt's opening block) is accepted token by token and ends the grammar."""
    _, state = live_server
    eng = state.engine.engine
    backend_owner = eng.runner
    if backend_owner.grammar is None:
        from k3serve.sampling.grammar import GrammarBackend

        backend_owner.grammar = GrammarBackend(eng.tokenizer, eng.model.cfg.vocab_size)
    calls = [
        ToolCall("a", "get_weather", json.dumps({"city": "Paris", "days": 3})),
        ToolCall("b", "calc", json.dumps({"expr": "2+2"})),
    ]
    for thinking in (False, True):
        m = Message("assistant", "", reasoning="let me look" if thinking else None, tool_calls=calls)
        ids = encode_segments(eng.tokenizer, message("assistant", assistant_body(m, thinking)))
        opened = encode_segments(
            eng.tokenizer, open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")
        )  # the generation prompt's end
        assert ids[: len(opened)] == opened
        think = k3_think_close(eng.tokenizer, "think" if thinking else "response", None)
        c = backend_owner.grammar.constraint(k3_tool_choice(TOOLS, "required", think, True, eng.model.cfg.eos_token_id))
        for t in ids[len(opened) :]:
            assert c.accept(t), (thinking, eng.tokenizer.decode([t]))
        assert c.phase == "done"


def test_auto_never_returns_an_undeclared_tool_as_a_call():
    text = (
        '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="calculator" index="1"<|sep|>'
        '<|open|>argument key="expr" type="string"<|sep|>1+1<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="get_weather" index="2"<|sep|><|open|>argument key="city" type="string"<|sep|>Oslo'
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"
    )
    parsed = OutputParser("kimi_k3", "response", tools_enabled=True, declared=frozenset({"get_weather"})).parse(text)
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert parsed.content == ""  # dropped, not shown as markup (issue 63 item 11; it used to stay content)
    anyone = OutputParser("kimi_k3", "response", tools_enabled=True).parse(text)
    assert [c.name for c in anyone.tool_calls] == ["calculator", "get_weather"]


def test_required_choice_on_the_k2_family(tiny_kl_dir):
    app, state = make_app(tiny_kl_dir, "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2")
    with serving(app) as base:
        for seed in range(3):
            r = httpx.post(
                base + "/v1/chat/completions",
                timeout=120,
                json={
                    "messages": MSGS,
                    "tools": TOOLS[:1],
                    "tool_choice": "required",
                    "max_tokens": 400,
                    "temperature": 1.0,
                    "seed": seed,
                    "parallel_tool_calls": False,
                },
            )
            assert r.status_code == 200, r.text
            assert _check_calls(r.json()["choices"][0], {"get_weather"}) == 1


def test_required_choice_through_the_openai_client(client):
    r = client.chat.completions.create(
        model="tiny-k3",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=450,
        temperature=1.0,
        seed=7,
        parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "params", [{"type": "nonsense"}, {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}]
)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_a_tool_schema_that_does_not_compile_is_a_400(live_server, params, choice):
    base, _ = live_server
    tools = [{"type": "function", "function": {"name": "bad", "parameters": params}}]
    r = httpx.post(
        base + "/v1/chat/completions",
        timeout=60,
        json={"messages": MSGS, "tools": tools, "tool_choice": choice, "max_tokens": 8},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "do not compile" in err["message"], err
    ok = httpx.post(base + "/v1/chat/completions", timeout=60, json={"messages": MSGS, "max_tokens": 4})
    assert ok.status_code == 200, ok.text
