"""Tool-call parsers: the rest of an output (after reasoning) -> content + tool calls.

kimi_k3 (serving-notes.md §4.1): channels `response` (content) and `tools`; each
`<|open|>call tool="N" index="i"<|sep|>` holds `argument key="K" type="T"` elements (string
bodies raw, other types JSON) or one `json type="object"` element with the raw object.
Attribute values are unescaped (&quot; &amp;). A call is complete once `<|close|>call<|sep|>`
arrives (before, it comes back incomplete, with its arguments so far: `CallArguments`);
`<|close|>message<|sep|>` ends parsing, so it never reaches content. Markup never
reaches content, also when no tools were declared (sglang#39583): the tools channel is dropped.
Malformed JSON values fall back to the raw string instead of failing (sglang#34604).
kimi_k2 (§4.2): `<|tool_calls_section_begin|>` … `<|tool_call_begin|>ID<|tool_call_argument_begin|>
{JSON}<|tool_call_end|>` … `<|tool_calls_section_end|>`; the name is the part of ID between
the last '.' and ':'.
"""

from __future__ import annotations

from k3serve.chat.markers import K2_SECTION_END

import json
import re

from k3serve.server.parsers.parsed import ParsedCall
from k3serve.server.parsers.reasoning import K2_SECTION_BEGIN
from k3serve.server.parsers.xtml import lex


def typed_value(text: str, kind: str):
    if kind == "string":
        return text
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return text


class CallArguments:
    """One call's arguments as JSON text, built element by element as they arrive, so the text of
    a call still open is always a prefix of its final text (streamed as OpenAI's argument
    deltas). `argument` elements make an object: a string value streams as it comes (escaped a
    character at a time, which is how json.dumps escapes the whole), any other value goes out
    whole once its element closes. A `json` element is the object itself, stripped of the
    whitespace around it. Whichever kind comes first is the call's; the other is ignored.
    A well-formed call's text equals json.dumps of its {key: typed value}."""

    def __init__(self):
        self.parts: list[str] = []
        self.mode: str | None = None  # "kv" (argument elements) | "raw" (a json element)
        self.held = ""  # raw mode: whitespace that is dropped if nothing follows it

    def open_argument(self, key: str, kind: str) -> bool:
        if self.mode == "raw":
            return False
        self.parts.append(("{" if self.mode is None else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        self.mode = "kv"
        if kind == "string":
            self.parts.append('"')
        return True

    def string_text(self, text: str) -> None:
        self.parts.append(json.dumps(text, ensure_ascii=False)[1:-1])

    def close_argument(self, kind: str, text: str) -> None:
        self.parts.append('"' if kind == "string" else json.dumps(typed_value(text, kind), ensure_ascii=False))

    def open_raw(self) -> bool:
        if self.mode is not None:
            return False
        self.mode = "raw"
        return True

    def raw_text(self, text: str) -> None:
        text = self.held + text
        if not self.parts:
            text = text.lstrip()
        body = text.rstrip()
        self.held = text[len(body) :]
        if body:
            self.parts.append(body)

    def text(self, closed: bool) -> str:
        out = "".join(self.parts)
        if not closed:
            return out
        if self.mode == "kv":
            return out + "}"
        return out or "{}"


class KimiK3ToolParser:
    name = "kimi_k3"

    def parse(
        self, text: str, start_channel: str | None, declared: frozenset[str] | None = None
    ) -> tuple[str, list[ParsedCall]]:
        """(content, calls). A call whose close has not arrived comes last, incomplete, with its
        arguments so far. A call to a tool not in `declared` is dropped: neither a call nor
        content (the auto grammar keeps the model from writing one when xgrammar is there)."""
        content: list[str] = []
        calls: list[ParsedCall] = []
        in_tools = False
        call: tuple[str, CallArguments] | None = None  # the open call: name, arguments
        skip = False  # the open call is to an undeclared tool
        arg: tuple[str, list[str]] | None = None  # the open argument: type, text (non-string types)
        raw = False  # inside the open call's json element
        for e in lex(text):
            if e.kind == "text":
                if call is None:
                    if not in_tools:
                        content.append(e.value)
                elif arg is not None and arg[0] == "string":
                    call[1].string_text(e.value)  # streams as it comes
                elif arg is not None:
                    arg[1].append(e.value)  # a typed value goes out whole at its close
                elif raw:
                    call[1].raw_text(e.value)
            elif e.kind == "open":
                if e.value == "message":
                    break  # the model started another message: the turn is over
                if e.value in ("think", "response"):
                    in_tools = False
                elif e.value == "tools":
                    in_tools = True
                elif e.value == "call" and in_tools and call is None:
                    call, arg, raw = (e.attr("tool") or "", CallArguments()), None, False
                    skip = declared is not None and call[0] not in declared
                elif e.value == "argument" and call is not None and arg is None and not raw:
                    kind = e.attr("type") or "string"
                    if call[1].open_argument(e.attr("key") or "", kind):
                        arg = (kind, [])
                elif e.value == "json" and call is not None and arg is None:
                    raw = call[1].open_raw()
            else:
                if e.value == "message":
                    break
                if e.value == "argument" and arg is not None:
                    call[1].close_argument(arg[0], "".join(arg[1]))
                    arg = None
                elif e.value == "json":
                    raw = False
                elif e.value == "call" and call is not None:
                    if arg is not None:  # a call closed inside an argument: the argument ends with it
                        call[1].close_argument(arg[0], "".join(arg[1]))
                    if not skip:
                        calls.append(ParsedCall(call[0], call[1].text(closed=True)))
                    call, arg, raw = None, None, False
                elif e.value == "tools":
                    in_tools = False
        if call is not None and not skip:
            calls.append(ParsedCall(call[0], call[1].text(closed=False), complete=False))
        return "".join(content), calls


class KimiK2ToolParser:
    name = "kimi_k2"
    markers = K2_SECTION_BEGIN
    _END = K2_SECTION_END
    _CALL = re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>"
        r"(?P<args>.*?)<\|tool_call_end\|>",
        re.S,
    )
    # a call whose id is whole but whose end has not arrived: the rest of the section is its arguments
    _OPEN = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>(?P<args>.*)\Z", re.S)

    def parse(
        self, text: str, start_channel: str | None, declared: frozenset[str] | None = None
    ) -> tuple[str, list[ParsedCall]]:
        """(content, calls); a call whose end has not arrived comes last, incomplete, with its
        arguments so far (stripped as the final ones are); a call to a tool not in `declared`
        is dropped."""
        begins = [(text.find(m), len(m)) for m in K2_SECTION_BEGIN if m in text]
        if not begins:
            return text, []
        i, n = min(begins)
        section, after = text[i + n :], ""
        ends = [(section.find(m), len(m)) for m in self._END if m in section]
        if ends:
            j, m = min(ends)
            section, after = section[:j], section[j + m :]
        calls, last = [], 0
        for c in self._CALL.finditer(section):
            calls.append(ParsedCall(self._name(c["id"]), c["args"].strip() or "{}", c["id"]))
            last = c.end()
        open_call = self._OPEN.search(section, last)
        if open_call is not None:
            args = open_call["args"].lstrip()
            calls.append(ParsedCall(self._name(open_call["id"]), args.rstrip(), open_call["id"], complete=False))
        return text[:i] + after, [c for c in calls if declared is None or c.name in declared]

    @staticmethod
    def _name(call_id: str) -> str:
        return call_id.split(":")[0].split(".")[-1]


TOOL_PARSERS = {"kimi_k3": KimiK3ToolParser, "kimi_k2": KimiK2ToolParser}
