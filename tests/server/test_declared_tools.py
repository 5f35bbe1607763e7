"""tool_choice "auto", declared tools only (issue 63 item 11): the reply stays free text, but a
call, once opened, is to a declared tool with arguments its schema allows.

The grammar itself, over strings with xgrammar's matcher (K3 and K2 markup): it takes content
then the end of the message, a declared call, thinking then a call (K3's own renderer writes the
K3 references) and refuses an undeclared tool or schema-invalid arguments. End to end on tiny
random checkpoints, steered by logit_bias toward the call markers so that calls open: on the K2
family the returned calls are declared and schema-valid; on K3, thinking and ngram speculation
on, every call the model opened in its raw output (its tokens, from logprobs) is a declared one.
And the issue's own request on the bundled demo model, which (unconstrained) called
unit_converter with only get_weather declared. Before the grammar, auto was unconstrained:
each of these fails.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from k3serve.chat.k3_xtml import assistant_body, message, open_tag, segments_text
from k3serve.chat.markers import (
    END_OF_MSG,
    K2_ARGUMENT_BEGIN,
    K2_CALL_BEGIN,
    K2_CALL_END,
    K2_SECTION_BEGIN,
    K2_SECTION_END,
    OPEN,
)
from k3serve.chat.messages import Message, ToolCall
from k3serve.server.openai.protocol import ChatCompletionRequest
from k3serve.server.parsers.xtml import lex
from tests.live import serving
from tests.server.test_tool_choice import WEATHER
from tests.server.conftest import make_app

xgr = pytest.importorskip("xgrammar")

WEATHER_ONLY = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]  # the issue's case
ASK = [{"role": "user", "content": "Convert 5 km to miles."}]
EOS = 0  # the grammar's stop token is not part of its text: any id does for the string checks


def _k3_auto(tools=WEATHER_ONLY, parallel=True):
    from k3serve.server.parsers.tool_choice import k3_auto_tool_choice

    return k3_auto_tool_choice(tools, {}, parallel, EOS)


def _k2_auto(tools=WEATHER_ONLY, parallel=True):
    from k3serve.server.parsers.tool_choice import k2_auto_tool_choice

    return k2_auto_tool_choice(tools, parallel, EOS)


def _matcher(so):
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(so.spec)
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)


def ends(so, text: str) -> bool:
    """The grammar takes `text` and the reply may end there (EOS)."""
    m = _matcher(so)
    return m.accept_string(text) and m.is_terminated()


def refuses(so, text: str) -> bool:
    """The grammar refuses `text` somewhere along it (not merely: more must follow)."""
    return not _matcher(so).accept_string(text)


def k3_reply(m: Message, thinking: bool) -> str:
    """What K3's renderer writes for an assistant turn after the generation prompt (which opens
    the message and its first channel), less the EOS that ends it."""
    text = segments_text(message("assistant", assistant_body(m, thinking)))
    opened = segments_text(open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response"))
    assert text.startswith(opened) and text.endswith(END_OF_MSG)
    return text[len(opened) : -len(END_OF_MSG)]


def k3_call(name: str, arguments: dict) -> str:
    return k3_reply(Message("assistant", "", tool_calls=[ToolCall("a", name, json.dumps(arguments))]), False)


OSLO = {"city": "Oslo", "days": 3}


@pytest.mark.parametrize("parallel", [True, False])
def test_k3_auto_grammar_takes_free_text_and_declared_calls(parallel):
    so = _k3_auto(parallel=parallel)
    assert so.markup and so.stop_ids == (EOS,) and not so.start_after  # the whole reply, from its first token
    weather = ToolCall("a", "get_weather", json.dumps(OSLO))
    for thinking in (False, True):
        said = Message("assistant", "5 km is 3.1 miles.", reasoning="km to miles" if thinking else None)
        assert ends(so, k3_reply(said, thinking)), thinking  # content, then the end of the message
        called = Message("assistant", "", reasoning="look it up" if thinking else None, tool_calls=[weather])
        assert ends(so, k3_reply(called, thinking)), thinking  # [thinking then] a declared call
    assert ends(so, "") and ends(so, "no markup at all")
    assert ends(so, "half a<|close|>response<|sep|><|close|>mess")  # EOS may come anywhere outside a call


def test_k3_auto_grammar_refuses_undeclared_tools_and_invalid_arguments():
    so = _k3_auto()
    assert ends(so, k3_call("get_weather", OSLO))
    for bad in (
        k3_call("convert_units", {"value": 5, "from": "km", "to": "mi"}),  # the issue's case
        k3_call("calc", {"expr": "5*0.62"}),  # a real tool, but not declared here
        k3_call("get_weather", {"city": "Oslo", "days": 12}),  # maximum 9
        k3_call("get_weather", {"city": "Oslo", "days": "3"}),  # an integer
        k3_call("get_weather", {"city": "Reykjavik", "days": 3}),  # maxLength 6
        k3_call("get_weather", {"city": "Oslo"}),  # days is required
        k3_call("get_weather", {"city": "Oslo", "days": 3, "country": "NO"}),  # additionalProperties
        k3_call("get_weather", {"city": "Oslo", "days": 3, "units": "k"}),  # enum
    ):
        assert refuses(so, bad), bad
    # the lexer reads other spellings of the call open too: a call no trigger saw is refused
    assert refuses(so, f'{OPEN} call tool="convert_units" index="1"')
    assert refuses(so, f'{OPEN}\ncall tool="get_weather" index="1"')
    assert refuses(so, f'{OPEN}call index="1" tool="convert_units"')


def test_k3_auto_grammar_without_parallel_calls_takes_one_call():
    one = k3_call("get_weather", OSLO)
    calls = one[: one.index("<|close|>tools")]
    assert ends(_k3_auto(parallel=False), one)
    assert refuses(_k3_auto(parallel=False), calls + calls[calls.index(f"{OPEN}call") :])
    assert ends(_k3_auto(parallel=True), calls + calls[calls.index(f"{OPEN}call") :])


def k2_call(name: str, arguments: str, index: int = 0) -> str:
    return f"{K2_CALL_BEGIN}functions.{name}:{index}{K2_ARGUMENT_BEGIN}{arguments}{K2_CALL_END}"


def k2_section(*calls: str) -> str:
    return K2_SECTION_BEGIN[0] + "".join(calls) + K2_SECTION_END[0]


@pytest.mark.parametrize("parallel", [True, False])
def test_k2_auto_grammar_takes_free_text_and_declared_calls(parallel):
    so = _k2_auto(parallel=parallel)
    weather = k2_call("get_weather", '{"city":"Oslo","days":3}')
    assert ends(so, "5 km is 3.1 miles.")
    assert ends(so, k2_section(weather))
    assert ends(so, "<think>km to miles</think>" + k2_section(weather))
    assert ends(so, "<think>look it up</think>Let me check." + k2_section(weather) + " Done.")


def test_k2_auto_grammar_refuses_undeclared_tools_and_invalid_arguments():
    so = _k2_auto()
    for bad in (
        k2_call("convert_units", '{"value":5}'),
        k2_call("calc", '{"expr":"5*0.62"}'),
        k2_call("get_weather", '{"city":"Oslo","days":12}'),
        k2_call("get_weather", '{"city":"Oslo"}'),
        k2_call("get_weather", '{"city":"Reykjavik","days":3}'),
        k2_call("get_weather", '{"city":"Oslo","days":3,"country":"NO"}'),
        k2_call("get_weather", '{"city":"O\x01","days":3}'),  # not JSON: a raw control character
        f"{K2_CALL_BEGIN} functions.convert_units:0",
    ):
        assert refuses(so, K2_SECTION_BEGIN[0] + bad), bad
    assert refuses(_k2_auto(parallel=False), k2_section(*[k2_call("get_weather", '{"city":"Oslo","days":3}')] * 2))


def test_k2_auto_stays_off_where_the_grammar_would_refuse_a_free_text_marker():
    """A tokenizer with `<think>` (or the other section spelling) as a special: the call
    vocabulary leaves it unspelled, so the grammar would keep the model from writing it."""
    from k3serve.server.parsers.tool_choice import k2_auto_applies

    assert k2_auto_applies(SimpleNamespace(special_tokens={K2_CALL_BEGIN: 1}))
    assert not k2_auto_applies(SimpleNamespace(special_tokens={"<think>": 1}))
    assert not k2_auto_applies(SimpleNamespace(special_tokens={K2_SECTION_BEGIN[1]: 1}))


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=ASK, tools=WEATHER_ONLY, tool_choice="auto", max_tokens=64, **extra)


def test_auto_gets_the_grammar_only_where_it_applies(live_server, monkeypatch):
    """K3 server: auto gets the declared-calls grammar (from the first token, or after the think
    channel under a thinking budget); another output constraint keeps its own; without
    xgrammar, or with a tool schema xgrammar cannot compile, auto stays unconstrained."""
    from k3serve.server.openai import serving_chat

    _, state = live_server

    def pick(req, tools=WEATHER_ONLY):
        return serving_chat._structured(state, req, "think", tools, "auto", 64)

    so = pick(_request())
    assert so is not None and so.kind == "grammar" and so.markup and 'tool=\\"get_weather\\"' in so.spec
    assert not so.start_after and not so.free_close
    budgeted = pick(_request(thinking_token_budget=8))
    assert budgeted.spec == so.spec and budgeted.free_budget == 8 and budgeted.free_close and not budgeted.free_refused
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    assert pick(_request(response_format=schema)).kind == "json"
    bad = [{"type": "function", "function": {"name": "bad", "parameters": {"type": "nonsense"}}}]
    assert pick(_request(), tools=bad) is None
    monkeypatch.setattr(serving_chat, "xgrammar_missing", lambda: "not installed")
    assert pick(_request()) is None


def _check_call(call: dict) -> None:
    name = call["function"]["name"]
    assert name == "get_weather", call
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


UNDECLARED_K2 = re.compile(r"functions\.(?!get_weather:)")


def test_auto_on_the_k2_family_calls_declared_tools_only(tiny_kl_dir):
    """Kimi-Linear, random weights, steered toward the section and call markers and EOS: the
    calls it opens are get_weather's, with valid arguments, and no other tool's markup reaches
    the message."""
    app, state = make_app(tiny_kl_dir, "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2")
    steer = [state.tokenizer.special_tokens[m] for m in (K2_SECTION_BEGIN[0], K2_CALL_BEGIN)] + [state.eos_token_id]
    with serving(app) as base:
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=300,
            json={
                "messages": ASK,
                "tools": WEATHER_ONLY,
                "tool_choice": "auto",
                "max_tokens": 160,
                "temperature": 1.0,
                "seed": 0,
                "n": 8,
                "logit_bias": {str(t): 100 for t in steer},
            },
        )
    assert r.status_code == 200, r.text
    calls = []
    for choice in r.json()["choices"]:
        msg = choice["message"]
        calls += msg.get("tool_calls") or []
        for text in (msg.get("content") or "", msg.get("reasoning_content") or ""):
            assert not UNDECLARED_K2.search(text), text
    assert calls, "steering opened no call"
    for call in calls:
        _check_call(call)


def k3_opened_calls(text: str) -> list[tuple[str, dict | None]]:
    """Each call the raw K3 output opens: (its tool, its typed arguments, None while unclosed)."""
    calls, call, arg = [], None, None
    for e in lex(text):
        if e.kind == "open" and e.value == "call":
            call = (e.attr("tool"), {})
            calls.append((call[0], None))
        elif call is not None and e.kind == "open" and e.value == "argument":
            arg = (e.attr("key"), e.attr("type"), [])
        elif call is not None and arg is not None and e.kind == "text":
            arg[2].append(e.value)
        elif call is not None and e.kind == "close" and e.value == "argument" and arg is not None:
            value = "".join(arg[2])
            call[1][arg[0]] = value if arg[1] == "string" else json.loads(value)
            arg = None
        elif call is not None and e.kind == "close" and e.value == "call":
            calls[-1], call = (call[0], call[1]), None
    return calls


DECLARED_K3 = f'{OPEN}call tool="get_weather" index="'


def test_auto_on_k3_with_thinking_and_speculation_opens_declared_calls_only(tiny_k3_dir):
    """Tiny K3, random weights, thinking on, ngram speculation: steered toward `<|open|>` and
    the pieces of `call`, the model opens calls; in its raw output (the tokens logprobs name)
    every `<|open|>call` goes on as a call to get_weather, and each that closed has arguments
    its schema allows."""
    app, state = make_app(
        tiny_k3_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    )
    tok = state.tokenizer
    steer = [tok.special_tokens[OPEN], *tok.encode("call")]
    with serving(app) as base:
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=600,
            json={
                "messages": ASK,
                "tools": WEATHER_ONLY,
                "tool_choice": "auto",
                "max_tokens": 320,
                "temperature": 1.0,
                "seed": 0,
                "n": 4,
                "logprobs": True,
                "logit_bias": {str(t): 100 for t in steer},
            },
        )
    assert r.status_code == 200, r.text
    closed = []
    for choice in r.json()["choices"]:
        raw = "".join(t["token"] for t in choice["logprobs"]["content"])
        for at in re.finditer(re.escape(OPEN) + r"\s*call", raw):
            rest = raw[at.start() :]  # a call, or the start of one max_tokens cut
            assert rest.startswith(DECLARED_K3) or DECLARED_K3.startswith(rest), rest[:80]
        calls = k3_opened_calls(raw)
        assert all(name == "get_weather" for name, _ in calls), calls
        closed += [args for _, args in calls if args is not None]
    assert closed, "steering opened no call that closed"
    for args in closed:
        jsonschema.validate(args, WEATHER)


def test_the_issues_case_on_the_demo_model_with_dspark():
    """The issue's request on the bundled demo model (trained on get_weather, calculator and
    unit_converter), DSpark speculation and thinking on: "Convert 5 km to miles." with only
    get_weather declared. Unconstrained it called unit_converter (its raw output); now the call
    it opens is get_weather's, schema-valid, and nothing else names a tool."""
    from k3serve.cli import build_parser
    from k3serve.demo.data import TOOLS as DEMO_TOOLS
    from k3serve.server.launch import build_server

    spec = '{"method": "dspark", "model": "dspark", "num_speculative_tokens": 4}'
    parsers = ["--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3"]
    app, _ = build_server(build_parser().parse_args(["serve", *parsers, "--speculative-config", spec]))
    with serving(app) as base:
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=300,
            json={
                "messages": ASK,
                "tools": DEMO_TOOLS[:1],
                "tool_choice": "auto",
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": 0,
                "n": 4,
                "logprobs": True,
            },
        )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        raw = "".join(t["token"] for t in choice["logprobs"]["content"])
        opened = re.findall(re.escape(OPEN) + r'\s*call\s+tool="([^"]*)"', raw)
        assert opened and set(opened) == {"get_weather"}, raw
        calls = choice["message"].get("tool_calls") or []
        assert choice["finish_reason"] == "tool_calls" and calls, choice
        for call in calls:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), DEMO_TOOLS[0]["function"]["parameters"])
