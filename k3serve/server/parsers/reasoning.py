"""Reasoning parsers: split model output into reasoning and the rest (serving-notes.md §4.1-4.2).

kimi_k3: the think channel. The chat prompt usually pre-opens it (`<|open|>think<|sep|>`), so
output starts mid-channel. It ends at `<|close|>think<|sep|>` or, when the model skips that
marker (vllm#53246, ~5% of tool turns), at the next channel opening (`response` / `tools`) or
the message close, which count as an implied think-close.
kimi_k2: `<think>…</think>` text; a tool-call section also ends it (vllm PR #32216).
"""

from __future__ import annotations

from k3serve.chat.markers import K2_SECTION_BEGIN
from k3serve.server.parsers.xtml import lex


class KimiK3ReasoningParser:
    name = "kimi_k3"

    def split(self, text: str, start_channel: str | None) -> tuple[str, str, str | None]:
        """(reasoning, rest, channel the rest starts in)."""
        events = lex(text)
        if start_channel != "think":
            if not (events and events[0].kind == "open" and events[0].value == "think"):
                return "", text, start_channel
            events = events[1:]
        parts = []
        for e in events:
            if e.kind == "close" and e.value == "think":
                return "".join(parts), text[e.end :], None
            if (e.kind == "open" and e.value in ("response", "tools")) or (e.kind == "close" and e.value == "message"):
                return "".join(parts), text[e.start :], None
            if e.kind == "text":
                parts.append(e.value)  # stray markers inside the think channel are dropped
        return "".join(parts), "", None


class KimiK2ReasoningParser:
    name = "kimi_k2"
    markers = ("<think>", "</think>")

    def split(self, text: str, start_channel: str | None) -> tuple[str, str, str | None]:
        in_think = start_channel == "think"
        if text.startswith("<think>"):
            in_think, text = True, text[len("<think>") :]
        if not in_think:
            return "", text, start_channel
        ends = [(text.find(m), len(m)) for m in ("</think>",)] + [(text.find(m), 0) for m in K2_SECTION_BEGIN]
        ends = [(i, n) for i, n in ends if i >= 0]
        if not ends:
            return text, "", None
        i, n = min(ends)
        return text[:i], text[i + n :], None


REASONING_PARSERS = {"kimi_k3": KimiK3ReasoningParser, "kimi_k2": KimiK2ReasoningParser}
