"""Tool-call parsers: the rest of an output (after reasoning) -> content + tool calls.

kimi_k3 (serving-notes.md §4.1): channels `response` (content) and `tools`; each
`<|open|>call tool="N" index="i"<|sep|>` holds `argument key="K" type="T"` elements (string
bodies raw, other types JSON) or one `json type="object"` element with the raw object.
Attribute values are unescaped (&quot; &amp;). A call counts only once `<|close|>call<|sep|>`
arrives; `<|close|>message<|sep|>` ends parsing, so it never reaches content. Markup never
reaches content, also when no tools were declared (sglang#39583): the tools channel is dropped.
Malformed JSON values fall back to the raw string instead of failing (sglang#34604).
kimi_k2 (§4.2): `<|tool_calls_section_begin|>` … `<|tool_call_begin|>ID<|tool_call_argument_begin|>
{JSON}<|tool_call_end|>` … `<|tool_calls_section_end|>`; the name is the part of ID between
the last '.' and ':'.
"""

from __future__ import annotations

from k3serve.chat.markers import K2_ARGUMENT_BEGIN, K2_CALL_BEGIN, K2_CALL_END, K2_SECTION_END

import json
import re

from k3serve.server.parsed import ParsedCall
from k3serve.server.reasoning_parser import K2_SECTION_BEGIN
from k3serve.server.xtml import lex


def typed_value(text: str, kind: str):
    if kind == "string":
        return text
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return text


class KimiK3ToolParser:
    name = "kimi_k3"

    def parse(
        self, text: str, start_channel: str | None, declared: frozenset[str] | None = None
    ) -> tuple[str, list[ParsedCall]]:
        """(content, calls). A call to a tool not in `declared` stays content, in K3 markup, where
        it stood: later text follows it, so a streamed content stays a prefix of the final one."""
        content: list[str] = []
        calls: list[ParsedCall] = []
        in_tools = False
        call: dict | None = None
        arg: tuple[str, str, list[str]] | None = None
        raw: list[str] | None = None
        for e in lex(text):
            if e.kind == "text":
                if arg is not None:
                    arg[2].append(e.value)
                elif raw is not None:
                    raw.append(e.value)
                elif not in_tools:
                    content.append(e.value)
            elif e.kind == "open":
                if e.value == "message":
                    break  # the model started another message: the turn is over
                if e.value in ("think", "response"):
                    in_tools = False
                elif e.value == "tools":
                    in_tools = True
                elif e.value == "call" and in_tools:
                    call = {"name": e.attr("tool") or "", "args": {}, "raw": None}
                elif e.value == "argument" and call is not None:
                    arg = (e.attr("key") or "", e.attr("type") or "string", [])
                elif e.value == "json" and call is not None:
                    raw = []
            else:
                if e.value == "message":
                    break
                if e.value == "argument" and arg is not None and call is not None:
                    call["args"][arg[0]] = typed_value("".join(arg[2]), arg[1])
                    arg = None
                elif e.value == "json" and raw is not None and call is not None:
                    call["raw"], raw = "".join(raw), None
                elif e.value == "call" and call is not None:
                    done = self._finish(call)
                    if declared is not None and done.name not in declared:
                        content.append(self.render(done))
                    else:
                        calls.append(done)
                    call, arg, raw = None, None, None
                elif e.value == "tools":
                    in_tools = False
        return "".join(content), calls

    @staticmethod
    def render(call: ParsedCall) -> str:
        """The call in K3 markup again (for a call that stays content)."""
        from k3serve.chat.k3_xtml import segments_text, tool_calls_body
        from k3serve.chat.messages import ToolCall

        return segments_text(tool_calls_body([ToolCall(call.id or "", call.name, call.arguments)]))

    @staticmethod
    def _finish(call: dict) -> ParsedCall:
        if call["raw"] is not None:
            return ParsedCall(call["name"], call["raw"].strip() or "{}")
        return ParsedCall(call["name"], json.dumps(call["args"], ensure_ascii=False))


class KimiK2ToolParser:
    name = "kimi_k2"
    markers = K2_SECTION_BEGIN
    _END = K2_SECTION_END
    _CALL = re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>"
        r"(?P<args>.*?)<\|tool_call_end\|>",
        re.S,
    )

    def parse(
        self, text: str, start_channel: str | None, declared: frozenset[str] | None = None
    ) -> tuple[str, list[ParsedCall]]:
        """(content, calls); a call to a tool not in `declared` stays content where it stood."""
        begins = [(text.find(m), len(m)) for m in K2_SECTION_BEGIN if m in text]
        if not begins:
            return text, []
        i, n = min(begins)
        section, after = text[i + n :], ""
        ends = [(section.find(m), len(m)) for m in self._END if m in section]
        if ends:
            j, m = min(ends)
            section, after = section[:j], section[j + m :]
        calls = [
            ParsedCall(self._name(c["id"]), c["args"].strip() or "{}", c["id"]) for c in self._CALL.finditer(section)
        ]
        kept = "".join(self.render(c) for c in calls if declared is not None and c.name not in declared)
        return text[:i] + kept + after, [c for c in calls if declared is None or c.name in declared]

    @staticmethod
    def render(call: ParsedCall) -> str:
        return f"{K2_CALL_BEGIN}{call.id or f'functions.{call.name}:0'}{K2_ARGUMENT_BEGIN}{call.arguments}{K2_CALL_END}"

    @staticmethod
    def _name(call_id: str) -> str:
        return call_id.split(":")[0].split(".")[-1]


TOOL_PARSERS = {"kimi_k3": KimiK3ToolParser, "kimi_k2": KimiK2ToolParser}
