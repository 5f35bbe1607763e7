"""K3 XTML and K2 output parsers: round trips, failure modes, streaming == non-streaming."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from k3serve.chat.k3_xtml import close_tag, element, open_tag, segments_text, tool_calls_body
from k3serve.chat.messages import ToolCall
from k3serve.tokenizer.detokenizer import IncrementalDetokenizer
from k3serve.sampling_params import SamplingParams
from k3serve.server.parsers.output import OutputParser
from k3serve.server.parsers.parsed import ParsedCall


def xtml_calls(calls: list[tuple[str, object]]) -> str:
    return segments_text(
        tool_calls_body(
            [ToolCall(f"c{i}", n, a if isinstance(a, str) else json.dumps(a)) for i, (n, a) in enumerate(calls)]
        )
    )


def k3_output(
    reasoning: str | None, content: str, calls=(), close_think=True, close_response=True, close_message=True
) -> str:
    """What a K3 model emits after a prompt ending in <|open|>think<|sep|> (reasoning given)
    or <|open|>response<|sep|> (reasoning None)."""
    text = ""
    if reasoning is not None:
        text += reasoning + (segments_text(close_tag("think")) if close_think else "")
        text += segments_text(open_tag("response"))
    text += content + (segments_text(close_tag("response")) if close_response else "")
    if calls:
        text += xtml_calls(list(calls))
    return text + (segments_text(close_tag("message")) if close_message else "")


ARGS = [
    {"city": "Zürich", "days": 3, "units": {"temp": "C", "nested": [1, {"a": None}]}},
    {"q": 'he said "hi" & <b>bold</b> 1 < 2'},
    {},
    {"flag": True, "n": -1.5e3, "list": ["x", "y"], "s": "{not json}"},
]


@pytest.mark.parametrize("args", ARGS)
def test_k3_round_trip_typed_arguments(args):
    text = k3_output("think about it", "Let me check.", [("get_weather", args), ("calc", {"expr": "2*3"})])
    p = OutputParser("kimi_k3", "think", tools_enabled=True, history_calls=2).parse(text)
    assert p.reasoning == "think about it" and p.content == "Let me check."
    assert [c.name for c in p.tool_calls] == ["get_weather", "calc"]
    assert json.loads(p.tool_calls[0].arguments) == args
    assert [c.id for c in p.tool_calls] == ["functions.get_weather:2", "functions.calc:3"]


def test_k3_attribute_unescaping_and_raw_json_form():
    text = segments_text(
        open_tag("tools")
        + element(
            "call", element("argument", [], [("key", 'a"b&c'), ("type", "string")]), [("tool", "t&x"), ("index", "1")]
        )
        + close_tag("tools")
    )
    text += segments_text(element("tools", element("call", element("json", []), [("tool", "raw"), ("index", "1")])))
    text = text.replace("<|sep|><|close|>argument", "<|sep|>v<|close|>argument")
    text = text.replace("<|sep|><|close|>json", '<|sep|>["not", "an object"]<|close|>json')
    p = OutputParser("kimi_k3", "response", reasoning=True, tools_enabled=True).parse(text)
    assert p.tool_calls[0].name == "t&x" and json.loads(p.tool_calls[0].arguments) == {'a"b&c': "v"}
    assert p.tool_calls[1].arguments == '["not", "an object"]'


def test_k3_string_args_not_json_decoded_and_bad_json_kept_raw():
    text = k3_output(None, "", []).replace(segments_text(close_tag("message")), "")
    text += (
        '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
        '<|open|>argument key="s" type="string"<|sep|>123<|close|>argument<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>12x<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>"
    )
    p = OutputParser("kimi_k3", "response", tools_enabled=True).parse(text)
    assert json.loads(p.tool_calls[0].arguments) == {"s": "123", "n": "12x"}


def test_k3_missing_think_close_is_implied_by_next_channel():
    text = k3_output("plan", "answer", [("f", {"x": 1})], close_think=False)
    p = OutputParser("kimi_k3", "think", tools_enabled=True).parse(text)
    assert p.reasoning == "plan" and p.content == "answer" and len(p.tool_calls) == 1
    direct_tools = "plan" + xtml_calls([("f", {"x": 1})])  # tools straight after thinking
    p = OutputParser("kimi_k3", "think", tools_enabled=True).parse(direct_tools)
    assert p.reasoning == "plan" and p.content == "" and p.tool_calls[0].name == "f"


def test_k3_message_close_without_response_close_never_leaks():
    text = k3_output("r", "visible", close_response=False)
    p = OutputParser("kimi_k3", "think").parse(text)
    assert p.content == "visible" and "<|" not in p.content and "message" not in p.content


def test_k3_tools_markup_without_declared_tools_is_stripped():
    text = k3_output("r", "hello", [("f", {"x": 1})])
    p = OutputParser("kimi_k3", "think", tools_enabled=False).parse(text)
    assert p.content == "hello" and p.tool_calls == []


def test_k3_thinking_off_and_unprefilled_think():
    assert OutputParser("kimi_k3", "response").parse(k3_output(None, "hi")).content == "hi"
    text = segments_text(open_tag("think")) + k3_output("deep", "ok")
    p = OutputParser("kimi_k3", None).parse(text)
    assert (p.reasoning, p.content) == ("deep", "ok")


def test_k3_a_call_cut_at_length_keeps_the_arguments_it_had():
    """Its name and arguments so far have streamed out already (as OpenAI does at a length cut,
    the call comes back incomplete); before, it was dropped and the stream said more than the
    final reply."""
    text = k3_output("r", "c", [("f", {"x": 1, "s": "ab"})], close_message=False)
    cut = text[: text.index("ab") + 1]
    p = OutputParser("kimi_k3", "think", tools_enabled=True).parse(cut)
    assert p.content == "c" and p.tool_calls == [ParsedCall("f", '{"x": 1, "s": "a', "functions.f:0", False)]


def test_k2_sections_ids_and_reasoning():
    text = (
        "<think>why</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>search:4'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    )
    p = OutputParser("kimi_k2", None, tools_enabled=True).parse(text)
    assert (p.reasoning, p.content) == ("why", "Sure.")
    assert [(c.name, c.id, c.arguments) for c in p.tool_calls] == [
        ("get_weather", "functions.get_weather:3", '{"city": "Paris"}'),
        ("search", "search:4", "{}"),
    ]
    p = OutputParser("kimi_k2", None, tools_enabled=False).parse(text)
    assert p.content == "Sure." and p.tool_calls == []


# ---- streaming == non-streaming -------------------------------------------------------------

TEXT = st.lists(st.sampled_from(list("ab <>&\"'{}é🙂\n|") + ["<|", "|>", "x"]), max_size=12).map("".join)
VALUES = st.one_of(
    TEXT,
    st.integers(-5, 5),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from("kq"), TEXT, max_size=2),
)
CALLS = st.lists(
    st.tuples(
        st.sampled_from(["get_weather", "calc", "f"]),
        st.dictionaries(st.sampled_from(["a", "b", 'q"&']), VALUES, max_size=3),
    ),
    max_size=3,
)


@pytest.fixture(scope="module")
def k3_tok(tiny_k3_dir):
    from k3serve.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_k3_dir)


def stream_pieces(tok, text: str, cuts: list[int]) -> list[str]:
    """Token ids of `text`, detokenized incrementally as the engine does for chat requests;
    returns the accumulated text at each chosen token boundary."""
    ids = tok.encode(text, allow_special=True)
    keep = [tok.token_to_id(n) for n in ("<|open|>", "<|close|>", "<|sep|>")]
    d = IncrementalDetokenizer(tok, SamplingParams(keep_special_token_ids=keep))
    out = []
    for i, t in enumerate(ids):
        d.add(t)
        if i in cuts:
            out.append(d.text)
    d.flush()
    return out + [d.text]


def check_streaming(make, full: str, prefixes: list[str]) -> list[int]:
    """The deltas, joined as an OpenAI client joins them (a call's name and id from its first
    piece, its arguments concatenated), equal the final parse; returns how many pieces each
    call came in."""
    ref = make().parse(full)
    p = make()
    got_r, got_c, got_calls, pieces = "", "", [], []
    for i, text in enumerate(prefixes):
        d = p.delta(text, final=i == len(prefixes) - 1)
        got_r, got_c = got_r + d.reasoning, got_c + d.content
        for c in d.tool_calls:
            if c.name is not None:  # a new call: the next index, name and id with it
                assert c.index == len(got_calls) and c.id is not None
                got_calls.append([c.name, "", c.id, False])
                pieces.append(0)
            call = got_calls[c.index]
            assert not call[3], "a piece after the call was done"
            call[1], call[3] = call[1] + c.arguments, c.done
            pieces[c.index] += 1
    want = [[c.name, c.arguments, c.id, c.complete] for c in ref.tool_calls]
    assert (got_r, got_c, got_calls) == (ref.reasoning, ref.content, want)
    return pieces


@settings(max_examples=150, deadline=None)
@given(
    reasoning=st.one_of(st.none(), TEXT),
    content=TEXT,
    calls=CALLS,
    close_think=st.booleans(),
    close_response=st.booleans(),
    close_message=st.booleans(),
    tools_enabled=st.booleans(),
    data=st.data(),
)
def test_k3_streaming_equals_non_streaming(
    k3_tok, reasoning, content, calls, close_think, close_response, close_message, tools_enabled, data
):
    full = k3_output(reasoning, content, calls, close_think, close_response, close_message)
    n = len(k3_tok.encode(full, allow_special=True))
    every = data.draw(st.booleans())
    cuts = list(range(n)) if every else sorted(data.draw(st.sets(st.integers(0, max(0, n - 1)), max_size=6)))
    prefixes = stream_pieces(k3_tok, full, cuts)
    start = "think" if reasoning is not None else "response"
    check_streaming(lambda: OutputParser("kimi_k3", start, tools_enabled=tools_enabled), prefixes[-1], prefixes)
    if tools_enabled and close_message:  # complete calls all come back, in order, with typed args
        got = OutputParser("kimi_k3", start, tools_enabled=True).parse(prefixes[-1]).tool_calls
        assert [(c.name, json.loads(c.arguments)) for c in got] == [(n_, a) for n_, a in calls]


@settings(max_examples=100, deadline=None)
@given(think=st.booleans(), before=TEXT, calls=CALLS, split=st.lists(st.integers(1, 200), max_size=8))
def test_k2_streaming_equals_non_streaming(think, before, calls, split):
    full = ("<think>plan</think>" if think else "") + before
    if calls:
        full += (
            "<|tool_calls_section_begin|>"
            + "".join(
                f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
                for i, (n, a) in enumerate(calls)
            )
            + "<|tool_calls_section_end|>"
        )
    cuts = sorted({min(c, len(full)) for c in split})
    prefixes = [full[:c] for c in cuts] + [full]  # character-level splits: markers split anywhere
    check_streaming(lambda: OutputParser("kimi_k2", None, tools_enabled=True), full, prefixes)


MARKER_TEXT = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


@settings(max_examples=60, deadline=None)
@given(reasoning=st.one_of(st.none(), TEXT), content=TEXT, calls=CALLS, tools_enabled=st.booleans())
def test_k3_truncated_anywhere_leaks_no_markup_and_streams_its_final(k3_tok, reasoning, content, calls, tools_enabled):
    """max_tokens may cut a reply at any token, inside a channel marker too (`<|close|>think`
    without its `<|sep|>` came back in reasoning_content, `<|open|>` in content): at every cut
    the final parse holds no marker text in any field, and the streamed deltas equal it."""
    full = k3_output(reasoning, content, calls)
    n = len(k3_tok.encode(full, allow_special=True))
    prefixes = stream_pieces(k3_tok, full, list(range(n)))
    start = "think" if reasoning is not None else "response"
    make = lambda: OutputParser("kimi_k3", start, tools_enabled=tools_enabled)  # noqa: E731
    for k in range(1, len(prefixes)):
        cut = prefixes[:k]  # the reply as max_tokens = k leaves it
        final = make().parse(cut[-1])
        fields = [final.reasoning, final.content] + [c.arguments for c in final.tool_calls]
        assert not any(m in f for f in fields for m in MARKER_TEXT), (cut[-1], final)
        check_streaming(make, cut[-1], cut)


DECLARED = frozenset({"get_weather"})


@settings(max_examples=80, deadline=None)
@given(reasoning=st.one_of(st.none(), TEXT), content=TEXT, calls=CALLS, after=TEXT, data=st.data())
def test_k3_undeclared_calls_are_dropped_and_stream_as_final(k3_tok, reasoning, content, calls, after, data):
    """A call to a tool the request did not declare is neither a call nor content (issue 63
    item 11: it came back as raw markup in content); text after it (another response channel)
    still streams as the final reply has it."""
    full = k3_output(reasoning, content, calls, close_message=False)
    full += segments_text(open_tag("response")) + after + segments_text(close_tag("response") + close_tag("message"))
    n = len(k3_tok.encode(full, allow_special=True))
    cuts = sorted(data.draw(st.sets(st.integers(0, max(0, n - 1)), max_size=8)))
    prefixes = stream_pieces(k3_tok, full, cuts)
    start = "think" if reasoning is not None else "response"
    make = lambda: OutputParser("kimi_k3", start, tools_enabled=True, declared=DECLARED)  # noqa: E731
    check_streaming(make, prefixes[-1], prefixes)
    final = make().parse(prefixes[-1])
    assert [c.name for c in final.tool_calls] == [n_ for n_, _ in calls if n_ in DECLARED]
    assert final.content == content + after and "<|" not in final.content.replace(content + after, "")


@settings(max_examples=80, deadline=None)
@given(before=TEXT, calls=CALLS, after=TEXT, split=st.lists(st.integers(1, 300), max_size=8))
def test_k2_undeclared_calls_are_dropped_and_stream_as_final(before, calls, after, split):
    full = (
        before
        + "<|tool_calls_section_begin|>"
        + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        + "<|tool_calls_section_end|>"
        + after
    )
    cuts = sorted({min(c, len(full)) for c in split})
    prefixes = [full[:c] for c in cuts] + [full]
    make = lambda: OutputParser("kimi_k2", None, tools_enabled=True, declared=DECLARED)  # noqa: E731
    check_streaming(make, full, prefixes)
    final = make().parse(full)
    assert final.content == before + after and [c.name for c in final.tool_calls] == [
        n for n, _ in calls if n in DECLARED
    ]


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_k2"])
def test_tool_call_arguments_stream_as_they_are_generated(k3_tok, family):
    """Issue 63 item 10: a long call's name goes out when it opens and its arguments in pieces
    as tokens arrive (before: nothing until the call closed, and long file-writing calls tripped
    client idle timeouts); joined, they are the final call."""
    body = "line of the file\n" * 40
    if family == "kimi_k3":
        full = k3_output(None, "Writing.", [("write_file", {"path": "a.txt", "content": body, "mode": 420})])
        pieces = stream_pieces(k3_tok, full, list(range(len(k3_tok.encode(full, allow_special=True)))))
        make = lambda: OutputParser("kimi_k3", "response", tools_enabled=True)  # noqa: E731
    else:
        args = json.dumps({"path": "a.txt", "content": body, "mode": 420})
        full = f"Writing.<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
        pieces = [full[:i] for i in range(1, len(full), 7)] + [full]
        make = lambda: OutputParser("kimi_k2", None, tools_enabled=True)  # noqa: E731
    assert check_streaming(make, full if family == "kimi_k2" else pieces[-1], pieces)[0] > 20
    p, first = make(), None
    for i, text in enumerate(pieces):
        if p.delta(text, final=False).tool_calls and first is None:
            first = i
    assert first is not None and first < len(pieces) // 4  # the name went out near the call's start
    (call,) = make().parse(pieces[-1]).tool_calls
    assert json.loads(call.arguments) == {"path": "a.txt", "content": body, "mode": 420} and call.complete
