"""Kimi K3 "XTML" chat rendering as a pure function (k3-model-spec.md §7.3).

Output is a list of segments, each either one structural special token or a piece of ordinary
text; `encode_segments` tokenizes each text piece on its own (specials disallowed inside), which
is what makes ids differ from tokenizing the concatenated string (COLI id-parity rule).

  <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>
  assistant: [<|open|>think<|sep|>R<|close|>think<|sep|>] <|open|>response<|sep|>C<|close|>response<|sep|>
             [<|open|>tools<|sep|> <|open|>call tool="N" index="i"<|sep|> <|open|>argument key="K" type="T"<|sep|>V
              <|close|>argument<|sep|> ... <|close|>call<|sep|> ... <|close|>tools<|sep|>]
  tool result: <|open|>message role="tool" tool="N" index="i"<|sep|>...  (re-sorted into call order)
  generation prompt: <|open|>message role="assistant"<|sep|><|open|>think<|sep|>  (or response)

Where the spec is silent (placement of the per-request internal system messages), they go
after the conversation, just before the generation prompt, so a multi-turn conversation keeps a
stable token prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from k3serve.chat.markers import CLOSE, END_OF_MSG, OPEN, SEP
from k3serve.chat.messages import MEDIA, ChatInputError, Message, ToolCall

EOM = END_OF_MSG
EFFORTS = ("low", "medium", "high", "max")
TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"


@dataclass(frozen=True)
class Seg:
    text: str
    special: bool = False


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def open_tag(name: str, attrs: list[tuple[str, str]] = ()) -> list[Seg]:
    segs = [Seg(OPEN, True), Seg(name)]
    for key, value in attrs:
        segs += [Seg(" " + key), Seg('="'), Seg(escape_attr(value)), Seg('"')]
    return segs + [Seg(SEP, True)]


def close_tag(name: str) -> list[Seg]:
    return [Seg(CLOSE, True), Seg(name), Seg(SEP, True)]


def element(name: str, body: list[Seg], attrs: list[tuple[str, str]] = ()) -> list[Seg]:
    return open_tag(name, attrs) + body + close_tag(name)


def message(role: str, body: list[Seg], attrs: list[tuple[str, str]] = ()) -> list[Seg]:
    return element("message", body, [("role", role), *attrs]) + [Seg(EOM, True)]


def json_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return "object" if isinstance(value, dict) else "array"


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def tool_calls_body(calls: list[ToolCall]) -> list[Seg]:
    body: list[Seg] = []
    for i, call in enumerate(calls, 1):
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError):  # carried raw below; depth is bounded upstream
            args = None
        if isinstance(args, dict):
            inner = []
            for key, value in args.items():
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                inner += element("argument", [Seg(text)], [("key", key), ("type", json_type(value))])
        else:  # not a JSON object: carried raw
            inner = element("json", [Seg(call.arguments)], [("type", "object")])
        body += element("call", inner, [("tool", call.name), ("index", str(i))])
    return element("tools", body)


def assistant_body(m: Message, thinking: bool) -> list[Seg]:
    body = element("think", [Seg(m.reasoning or "")]) if thinking else []
    body += element("response", [Seg(m.content)])
    if m.tool_calls:
        body += tool_calls_body(m.tool_calls)
    return body


def tool_results(results: list[Message], calls: list[ToolCall]) -> list[Seg]:
    """Consecutive tool messages, re-sorted into the order of the calls they answer."""
    if not calls:
        raise ChatInputError("a tool message must follow an assistant message with tool_calls")
    order = {c.id: i for i, c in enumerate(calls)}
    if all(r.tool_call_id is None for r in results) and len(results) <= len(calls):
        for pos, r in enumerate(results):  # no ids given: answers are in call order
            r.tool_call_id = calls[pos].id
    for r in results:
        if r.tool_call_id not in order:
            raise ChatInputError(f"tool message answers unknown tool_call_id {r.tool_call_id!r}")
    segs: list[Seg] = []
    for r in sorted(results, key=lambda r: order[r.tool_call_id]):
        i = order[r.tool_call_id]
        segs += message("tool", [Seg(r.content)], [("tool", calls[i].name), ("index", str(i + 1))])
    return segs


def render_k3(
    messages: list[Message],
    tools: list[dict] | None = None,
    *,
    thinking: bool = True,
    effort: str | None = None,
    tool_choice: Any = None,
    response_format: dict | None = None,
    add_generation_prompt: bool = True,
) -> list[Seg]:
    segs: list[Seg] = []
    if tools:
        segs += message("system", [Seg(TOOL_DECLARE_HEAD + compact_json(tools) + "\n```")], [("type", "tool-declare")])
    last_calls: list[ToolCall] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.role == "tool":
            j = i
            while j < len(messages) and messages[j].role == "tool":
                j += 1
            segs += tool_results(messages[i:j], last_calls)
            i = j
            continue
        if m.role == "assistant":
            segs += message("assistant", assistant_body(m, thinking))
            last_calls = m.tool_calls
        else:
            segs += message(m.role, content_segs(m), [("name", m.name)] if m.name else [])
        i += 1
    segs += _internal_messages(thinking, effort, tool_choice if tools else None, response_format)
    if add_generation_prompt:
        segs += open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")
    return segs


def media_block(item) -> list[Seg]:
    """An image: `<|media_begin|>image WxH<|media_content|>` + one `<|media_pad|>` per tower row +
    `<|media_end|>` (W x H the original image size). A video: per 4-frame chunk,
    `HH:MM:SS.fff<|media_begin|>video<|media_content|>` + pads + `<|media_end|>`, the time of the
    chunk's first frame (k3-model-spec.md §9.3)."""
    chunks = getattr(item, "chunks", None)
    if chunks is not None:
        return [s for c in chunks for s in [Seg(c.label)] + _media("video", c.num_tokens)]
    w, h = item.size
    return _media(f"image {w}x{h}", item.num_tokens)


def _media(header: str, pads: int) -> list[Seg]:
    return (
        [Seg("<|media_begin|>", True), Seg(header), Seg("<|media_content|>", True)]
        + [Seg("<|media_pad|>", True)] * pads
        + [Seg("<|media_end|>", True)]
    )


def content_segs(m: Message) -> list[Seg]:
    """A message's text with a media block where each MEDIA mark stands."""
    if not m.media:
        return [Seg(m.content)]
    pieces = m.content.split(MEDIA)
    segs = [Seg(pieces[0])] if pieces[0] else []
    for item, text in zip(m.media, pieces[1:]):
        segs += media_block(item) + ([Seg(text)] if text else [])
    return segs


def _internal_messages(thinking, effort, tool_choice, response_format) -> list[Seg]:
    segs: list[Seg] = []
    if thinking:
        effort = effort or "max"
        if effort not in EFFORTS:
            raise ChatInputError(f"reasoning_effort must be one of {EFFORTS}, got {effort!r}")
        segs += message("system", [Seg(effort)], [("type", "thinking-effort")])
    if tool_choice in ("required", "none") or isinstance(tool_choice, dict):
        text = tool_choice if isinstance(tool_choice, str) else compact_json(tool_choice)
        segs += message("system", [Seg(text)], [("type", "tool-choice")])
    if response_format and response_format.get("type") in ("json_object", "json_schema"):
        segs += message("system", [Seg(compact_json(response_format))], [("type", "response-format")])
    return segs


def encode_segments(tokenizer, segs: list[Seg]) -> list[int]:
    ids: list[int] = []
    for s in segs:
        if s.special:
            ids.append(tokenizer.token_to_id(s.text))
            continue
        for part in tokenizer.encode_parts(s.text):  # piece by piece: one extend by the 20 M ids
            ids += part  # of a 30 MiB message holds the GIL (and the event loop) for ~0.2 s
    return ids


def segments_text(segs: list[Seg]) -> str:
    return "".join(s.text for s in segs)
