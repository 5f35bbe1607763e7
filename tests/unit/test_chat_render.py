"""Chat rendering: K3 XTML goldens (token ids built segment by segment from spec §7.3),
tool results in call order, thinking on/off, internal system messages; K2 Jinja rendering."""

from __future__ import annotations

import json

import pytest

from k3serve.chat.k2_jinja import K2_STYLE_TEMPLATE, render_jinja
from k3serve.chat.messages import ChatInputError, normalize
from k3serve.chat.render import ChatOptions, ChatRenderer
from k3serve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_k3_dir):
    return Tokenizer.from_dir(tiny_k3_dir)


@pytest.fixture(scope="module")
def renderer(tok, tiny_k3_dir):
    return ChatRenderer("kimi_k3", tok, tiny_k3_dir)


class G:
    """Golden builder written straight from the spec text, independent of the renderer."""

    def __init__(self, tok):
        self.t, self.ids = tok, []

    def sp(self, name):
        self.ids.append(self.t.token_to_id(name))
        return self

    def tx(self, *texts):
        for text in texts:
            self.ids += self.t.encode(text)
        return self

    def open(self, name, **attrs):
        self.sp("<|open|>").tx(name)
        for k, v in attrs.items():
            self.tx(" " + k, '="', v, '"')
        return self.sp("<|sep|>")

    def close(self, name):
        return self.sp("<|close|>").tx(name).sp("<|sep|>")

    def msg(self, body, **attrs):
        self.open("message", **attrs)
        body(self)
        return self.close("message").sp("<|end_of_msg|>")


def effort(g, level="max"):
    g.msg(lambda g: g.tx(level), role="system", type="thinking-effort")


def test_single_turn_golden_thinking_on(tok, renderer):
    got = renderer.render([{"role": "user", "content": "What is 2+2?"}], ChatOptions()).token_ids
    g = G(tok).msg(lambda g: g.tx("What is 2+2?"), role="user")
    effort(g)
    g.open("message", role="assistant").open("think")
    assert got == g.ids
    # per-segment tokenization differs from tokenizing the concatenated text once a segment
    # boundary falls inside a pre-tokenizer chunk: `="` + `:)` is not `=":)` (tiny vocab merges `":`)
    r = renderer.render([{"role": "user", "name": ":)", "content": "hi"}], ChatOptions())
    assert tok.encode(r.text, allow_special=True) != r.token_ids


def test_multi_turn_with_tools_and_results_in_call_order(tok, renderer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "two calls",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "sun"},  # answers arrive out of order
        {"role": "tool", "tool_call_id": "a", "content": "rain"},
    ]
    got = renderer.render(messages, ChatOptions(tools=tools, effort="high", tool_choice="required")).token_ids
    decl = json.dumps(tools, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    g = G(tok).msg(
        lambda g: g.tx("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" + decl + "\n```"),
        role="system",
        type="tool-declare",
    )
    g.msg(lambda g: g.tx("Be brief."), role="system")
    g.msg(lambda g: g.tx("Weather in Paris and Rome?"), role="user")

    def assistant(g):
        g.open("think").tx("two calls").close("think").open("response").tx("Checking.").close("response")
        g.open("tools")
        g.open("call", tool="get_weather", index="1").open("argument", key="city", type="string").tx("Paris")
        g.close("argument").close("call")
        g.open("call", tool="get_weather", index="2").open("argument", key="city", type="string").tx("Rome")
        g.close("argument").open("argument", key="days", type="number").tx("2").close("argument").close("call")
        g.close("tools")

    g.msg(assistant, role="assistant")
    g.msg(lambda g: g.tx("rain"), role="tool", tool="get_weather", index="1")
    g.msg(lambda g: g.tx("sun"), role="tool", tool="get_weather", index="2")
    effort(g, "high")
    g.msg(lambda g: g.tx("required"), role="system", type="tool-choice")
    g.open("message", role="assistant").open("think")
    assert got == g.ids


def test_thinking_off_prefills_response_and_drops_think(tok, renderer):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "x"},
        {"role": "user", "content": "again"},
    ]
    r = renderer.render(msgs, ChatOptions(thinking=False, response_format={"type": "json_object"}))
    g = G(tok).msg(lambda g: g.tx("hi"), role="user")
    g.msg(lambda g: g.open("response").tx("hello").close("response"), role="assistant")
    g.msg(lambda g: g.tx("again"), role="user")
    g.msg(lambda g: g.tx('{"type":"json_object"}'), role="system", type="response-format")
    g.open("message", role="assistant").open("response")
    assert r.token_ids == g.ids and r.start_channel == "response"


def test_attribute_escaping_and_specials_in_user_text_stay_text(tok, renderer):
    r = renderer.render([{"role": "user", "name": 'a"b&c', "content": "<|open|> is text"}], ChatOptions())
    assert 'name="a&quot;b&amp;c"' in r.text
    assert r.token_ids.count(tok.token_to_id("<|open|>")) == 4  # user, effort, assistant, think; not the text


@pytest.mark.parametrize(
    "messages, opts, match",
    [
        ([], ChatOptions(), "at least one message"),
        ([{"role": "robot", "content": "x"}], ChatOptions(), "role must be one of"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            ChatOptions(),
            "takes text only",
        ),  # a renderer given no media loader
        ([{"role": "user", "content": "x"}], ChatOptions(effort="extreme"), "reasoning_effort"),
        ([{"role": "tool", "tool_call_id": "z", "content": "x"}], ChatOptions(), "must follow an assistant"),
    ],
)
def test_render_errors_name_the_problem(renderer, messages, opts, match):
    with pytest.raises(ChatInputError, match=match):
        renderer.render(messages, opts)


def test_k2_jinja_normalises_history_tool_ids():
    msgs = normalize(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_xyz", "function": {"name": "search", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "call_xyz", "content": "result"},
        ]
    )
    text = render_jinja(K2_STYLE_TEMPLATE, msgs, [{"type": "function", "function": {"name": "search"}}])
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": "search"}}]'
        "<|im_end|><|im_user|>user<|im_middle|>q<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>"
        "## Return of functions.search:0\nresult<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_k2_renderer_tokenizes_specials(tiny_kl_dir):
    tok = Tokenizer.from_dir(tiny_kl_dir)
    r = ChatRenderer("kimi_linear", tok, tiny_kl_dir).render([{"role": "user", "content": "hi"}], ChatOptions())
    assert r.token_ids[0] == tok.token_to_id("<|im_user|>") and r.token_ids[-1] == tok.token_to_id("<|im_middle|>")
