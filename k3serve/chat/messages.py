"""Normalized chat input shared by the renderers (plain dataclasses, no I/O).

Message content may be a string or OpenAI content parts: text, and image / video parts on user
messages, which a `load_media` callable turns into processed media (the server decodes them);
each leaves a MEDIA mark in the text where the renderer writes its placeholder block. Anything
else raises ChatInputError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from collections.abc import Callable
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
    media: list = field(default_factory=list)  # processed media, in order; MEDIA marks each in content


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


MEDIA = "\ufffc"  # OBJECT REPLACEMENT CHARACTER: where a media item sits in a message's text
MEDIA_PARTS = ("image_url", "input_image", "video_url")


def content_text(content: Any, where: str, load_media: Callable | None = None) -> tuple[str, list]:
    """(text with MEDIA at each media part, the media items loaded in order)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise ChatInputError(f"{where}.content must be a string or a list of parts")
    parts, media = [], []
    for i, part in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = _text(part.get("text", ""), f"{at}.text") or ""
            if MEDIA in text and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in content):
                raise ChatInputError(f"{at}.text contains U+FFFC, which marks media in this message")
            parts.append(text)
        elif kind in MEDIA_PARTS:
            if load_media is None:
                raise ChatInputError(f"{at}: this model takes text only (no vision tower)")
            media.append(load_media(part, at))
            parts.append(MEDIA)
        else:
            raise ChatInputError(f"{at}: part type {kind!r} is not supported (text, image_url, video_url)")
    return "".join(parts), media


def normalize(messages: list[dict], load_media: Callable | None = None) -> list[Message]:
    """OpenAI message dicts -> Messages, validated; media parts go through `load_media`."""
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
        text, media = content_text(m.get("content"), where, load_media if role == "user" else None)
        out.append(
            Message(
                "system" if role == "developer" else role,
                text,
                _text(reasoning, f"{where}.reasoning_content"),
                _tool_calls(m, where),
                _text(m.get("tool_call_id"), f"{where}.tool_call_id"),
                _text(m.get("name"), f"{where}.name"),
                media,
            )
        )
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
