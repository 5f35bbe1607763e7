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
MAX_JSON_DEPTH = 64  # nesting allowed in tool arguments / schemas; deeper input is refused, not recursed


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of decoded JSON, counted without recursion and stopping past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_depth(value: Any, where: str) -> None:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ChatInputError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels")


def _text(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ChatInputError(f"{where} must be a string, got {type(value).__name__}")
    return value


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
            parts.append(_text(part.get("text", ""), f"{where}.content[{i}].text") or "")
        return "".join(parts)
    raise ChatInputError(f"{where}.content must be a string or a list of parts")


def normalize(messages: list[dict]) -> list[Message]:
    """OpenAI message dicts -> Messages, validated."""
    if not isinstance(messages, list):
        raise ChatInputError("messages must be a list of messages")
    if not messages:
        raise ChatInputError("messages must contain at least one message")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatInputError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ChatInputError(f"{where}.role must be one of {ROLES}, got {role!r}")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        out.append(Message("system" if role == "developer" else role, content_text(m.get("content"), where),
                           _text(reasoning, f"{where}.reasoning_content"), _tool_calls(m, where),
                           _text(m.get("tool_call_id"), f"{where}.tool_call_id"),
                           _text(m.get("name"), f"{where}.name")))
    return out


def _tool_calls(m: dict, where: str) -> list[ToolCall]:
    raw = m.get("tool_calls") or []
    if not isinstance(raw, list):
        raise ChatInputError(f"{where}.tool_calls must be a list of tool calls")
    calls = []
    for j, c in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise ChatInputError(f"{at}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatInputError(f"{at}.function.name is required (a string)")
        args = fn.get("arguments", "{}")
        check_depth(args, f"{at}.function.arguments")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(str(c.get("id") or ""), name, args))
    return calls
