"""Normalized chat input shared by the renderers (plain dataclasses, no I/O).

Message content may be a string or OpenAI content parts; only text parts are accepted here
(the engine has no vision path yet), and anything else raises ChatInputError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class ChatInputError(ValueError):
    """A message list the renderer cannot express; the server answers 400 with this text."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text as the OpenAI API carries it


@dataclass
class Message:
    role: str
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


ROLES = ("system", "developer", "user", "assistant", "tool")


def content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ChatInputError(f"{where}.content[{i}]: only text parts are supported, got {kind!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatInputError(f"{where}.content must be a string or a list of parts")


def normalize(messages: list[dict]) -> list[Message]:
    """OpenAI message dicts -> Messages, validated."""
    if not messages:
        raise ChatInputError("messages must contain at least one message")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ROLES:
            raise ChatInputError(f"{where}.role must be one of {ROLES}, got {role!r}")
        calls = []
        for j, c in enumerate(m.get("tool_calls") or []):
            fn = c.get("function") or {}
            if not fn.get("name"):
                raise ChatInputError(f"{where}.tool_calls[{j}].function.name is required")
            args = fn.get("arguments", "{}")
            calls.append(ToolCall(str(c.get("id") or ""), fn["name"],
                                  args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        out.append(Message("system" if role == "developer" else role, content_text(m.get("content"), where),
                           reasoning, calls, m.get("tool_call_id"), m.get("name")))
    return out
