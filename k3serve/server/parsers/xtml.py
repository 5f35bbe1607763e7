"""Lexer for K3 XTML output text (serving-notes.md §4.1): markers and the text between them.

  open:  <|open|>NAME key="v" ...<|sep|>      close: <|close|>NAME<|sep|>
Whitespace inside markers is tolerated. `stable_length` is the streaming cut: an open/close
marker whose <|sep|> has not arrived yet, or a partial marker token, is held back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from k3serve.chat.markers import CLOSE, OPEN, SEP
from k3serve.server.parsers.parsed import hold_back

_MARKER = re.compile(
    r"<\|open\|>\s*([A-Za-z_][\w-]*)((?:\s+[\w-]+\s*=\s*\"[^\"]*\")*)\s*<\|sep\|>"
    r"|<\|close\|>\s*([A-Za-z_][\w-]*)\s*<\|sep\|>"
)
_ATTR = re.compile(r"([\w-]+)\s*=\s*\"([^\"]*)\"")


@dataclass(frozen=True)
class Event:
    kind: str  # "text" | "open" | "close"
    value: str  # the text, or the tag name
    attrs: tuple[tuple[str, str], ...] = ()
    start: int = 0  # offset of the event in the lexed text
    end: int = 0

    def attr(self, key: str) -> str | None:
        return next((v for k, v in self.attrs if k == key), None)


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&") if "&" in value else value


def lex(text: str) -> list[Event]:
    events, pos = [], 0
    for m in _MARKER.finditer(text):
        if m.start() > pos:
            events.append(Event("text", text[pos : m.start()], (), pos, m.start()))
        if m.group(1) is not None:
            attrs = tuple((k, unescape_attr(v)) for k, v in _ATTR.findall(m.group(2)))
            events.append(Event("open", m.group(1), attrs, m.start(), m.end()))
        else:
            events.append(Event("close", m.group(3), (), m.start(), m.end()))
        pos = m.end()
    if pos < len(text):
        events.append(Event("text", text[pos:], (), pos, len(text)))
    return events


def stable_length(text: str) -> int:
    """Prefix of `text` that can be lexed now without a marker changing meaning later."""
    cut = len(text)
    last_open = max(text.rfind(OPEN), text.rfind(CLOSE))
    if last_open >= 0 and text.find(SEP, last_open) < 0:
        cut = last_open
    return min(cut, hold_back(text[:cut], (OPEN, CLOSE, SEP)))


def complete_length(text: str) -> int:
    """`text` without a trailing tag that never closed: a reply cut by max_tokens inside a
    marker (`...<|close|>think`, `<|open|>resp`) ends before its `<|open|>` / `<|close|>`, so
    no half marker is read as text."""
    last = max(text.rfind(OPEN), text.rfind(CLOSE))
    return last if last >= 0 and text.find(SEP, last) < 0 else len(text)


__all__ = ["Event", "complete_length", "lex", "stable_length", "unescape_attr"]
