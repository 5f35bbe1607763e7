"""Compose reasoning + tool parsing for one choice, for final and streaming output.

Streaming re-parses the accumulated text each time, cut back to its stable prefix (no
half-received marker), and sends only what grew since the last delta. Because the parse of a
stable prefix is always a prefix of the parse of any longer text, the concatenated deltas equal
the non-streaming result for every way the token stream can be split (tested with hypothesis).
A tool call streams as OpenAI's deltas do: its id and name once it opens, then its arguments
as they grow (CallDelta); a reply cut inside a call keeps the call with the arguments it had.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from k3serve.server.parsers.parsed import Parsed, ParsedCall, hold_back
from k3serve.server.parsers.reasoning import REASONING_PARSERS
from k3serve.server.parsers.tool import TOOL_PARSERS
from k3serve.chat.markers import (
    K2_ARGUMENT_BEGIN,
    K2_CALL_BEGIN,
    K2_CALL_END,
    K2_SECTION_BEGIN,
    K2_SECTION_END,
    K2_THINK,
)
from k3serve.server.parsers.xtml import complete_length, stable_length

K2_MARKERS = (*K2_THINK, *K2_SECTION_BEGIN, K2_CALL_BEGIN, K2_ARGUMENT_BEGIN, K2_CALL_END, *K2_SECTION_END)


def json_calls(text: str) -> list[ParsedCall]:
    """`[{"name": ..., "parameters": {...}}, ...]` -> calls; [] unless the text is exactly that."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not (
        isinstance(value, list)
        and value
        and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
            for c in value
        )
    ):
        return []
    return [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


@dataclass(frozen=True)
class CallDelta:
    """A piece of one tool call: `name` and `id` on the call's first piece only, `arguments`
    what its JSON text grew by; `done` once its close has arrived."""

    index: int  # the call's place in the choice
    name: str | None
    id: str | None
    arguments: str
    done: bool


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[CallDelta] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class OutputParser:
    def __init__(
        self,
        family: str,
        start_channel: str | None = None,
        *,
        reasoning: bool = True,
        tools_enabled: bool = False,
        parallel_tool_calls: bool = True,
        history_calls: int = 0,
        declared: frozenset[str] | None = None,
        json_calls: bool = False,
    ):
        """`json_calls`: the reply is a JSON array of calls (server/parsers/tool_choice.py
        json_tool_choice); it becomes tool_calls once whole, and stays content if it never is."""
        if family not in TOOL_PARSERS:
            raise ValueError(f"unknown parser {family!r}; choose one of {sorted(TOOL_PARSERS)}")
        self.family, self.start_channel = family, start_channel
        self.reasoning = REASONING_PARSERS[family]() if reasoning else None
        self.tools = TOOL_PARSERS[family]()
        self.tools_enabled, self.parallel, self.history = tools_enabled, parallel_tool_calls, history_calls
        self.declared = declared  # tool names the request declared; None: any
        self.json_calls = json_calls
        self._sent = Parsed()

    def parse(self, text: str) -> Parsed:
        if self.family == "kimi_k3":  # a reply cut inside a marker: the half marker is no text
            text = text[: complete_length(text)]
        reasoning, rest, channel = "", text, self.start_channel
        if self.reasoning is not None:
            reasoning, rest, channel = self.reasoning.split(text, self.start_channel)
        if self.json_calls:
            calls = json_calls(rest)
            content = "" if calls else rest
        else:
            # a call to a tool the request never declared is not a tool call: it stays content,
            # in the model's own markup where it stood (vLLM does the same)
            content, calls = self.tools.parse(rest, channel, self.declared)
        if not self.tools_enabled:
            calls = []
        elif not self.parallel:
            calls = calls[:1]
        calls = [
            ParsedCall(c.name, c.arguments, c.id or f"functions.{c.name}:{self.history + i}", c.complete)
            for i, c in enumerate(calls)
        ]
        return Parsed(reasoning, content, calls)

    def stable(self, text: str) -> str:
        if self.family == "kimi_k3":
            return text[: stable_length(text)]
        return text[: hold_back(text, K2_MARKERS)]

    def delta(self, text: str, final: bool) -> Delta:
        now = self.parse(text if final else self.stable(text))
        if self.json_calls and not final and not now.tool_calls:  # an unfinished array is not content yet
            now = Parsed(now.reasoning, "", [])
        sent = self._sent
        calls = _call_deltas(sent.tool_calls, now.tool_calls)
        if calls is None or not (now.reasoning.startswith(sent.reasoning) and now.content.startswith(sent.content)):
            # cannot happen for stable prefixes; never resend or rewrite what a client holds
            return Delta()
        out = Delta(now.reasoning[len(sent.reasoning) :], now.content[len(sent.content) :], calls)
        self._sent = now
        return out


def _call_deltas(sent: list[ParsedCall], now: list[ParsedCall]) -> list[CallDelta] | None:
    """What the calls grew by since `sent`; None if `now` does not extend it."""
    if len(now) < len(sent):
        return None
    out = []
    for i, c in enumerate(now):
        if i >= len(sent):
            out.append(CallDelta(i, c.name, c.id, c.arguments, c.complete))
            continue
        old = sent[i]
        if (c.name, c.id) != (old.name, old.id) or not c.arguments.startswith(old.arguments):
            return None
        if len(c.arguments) > len(old.arguments) or c.complete != old.complete:
            out.append(CallDelta(i, None, None, c.arguments[len(old.arguments) :], c.complete))
    return out
