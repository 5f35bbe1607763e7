"""What output parsing produces, and the streaming hold-back rule shared by the parsers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text (its prefix so far while the call is open)
    id: str | None = None  # K2 carries ids in the output; K3 does not
    complete: bool = True  # False: the call's close has not arrived (yet, or ever: a length cut)


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedCall] = field(default_factory=list)


def hold_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of `text` that is safe to parse while streaming: cut a tail that is a proper
    prefix of any marker (the rest of the marker may still arrive)."""
    for i in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        tail = text[i:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return i
    return len(text)
