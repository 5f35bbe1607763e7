"""Responses API <-> chat: a `/v1/responses` request becomes the ChatCompletionRequest the chat
path already serves (messages, tools, tool_choice, response_format, reasoning effort), and a
parsed reply becomes Responses output items (reasoning, message, function_call).

Input items (OpenAI Responses API): a string, or messages ({role, content: str | parts}, also
typed "message"), `function_call` (an earlier call by the model) and `function_call_output`
(its result); `reasoning` items are dropped (K3 re-renders history without its thinking).
Reference: the OpenAI Responses API reference; vLLM `entrypoints/openai/serving_responses.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt

from k3serve.server.openai.errors import APIError
from k3serve.server.parsers.parsed import Parsed
from k3serve.server.state import new_id

# Fields of the Responses request that change nothing here (they are echoed back).
ECHOED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "truncation")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    background: StrictBool = False  # strict: lax pydantic read `background: 0` as false
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None

    def check_fields(self) -> None:
        for name in self.model_extra or {}:
            raise APIError(400, f"unsupported field `{name}`: this server does not honour it", param=name)
        if self.background:
            raise APIError(400, "background responses are not supported", param="background")
        if self.include:
            raise APIError(400, f"include {self.include} is not supported", param="include")
        if self.truncation not in (None, "disabled"):
            raise APIError(400, "truncation 'auto' is not supported: the prompt is never truncated", param="truncation")


TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """Responses content -> chat content: a string, or (with images) chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and images:
            parts.append({"type": "input_image", "image_url": part.get("image_url")})
        else:
            raise APIError(400, f"{where}: content part {kind!r} is not supported (text, input_image)", param="input")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(inp: str | list[dict], sources: list[int] | None = None) -> list[dict]:
    """Responses input items -> chat messages; `sources` gets each message's input item index."""
    if isinstance(inp, str):
        if sources is not None:
            sources.append(0)
        return [{"role": "user", "content": inp}]
    msgs: list[dict] = []
    for i, item in enumerate(inp):
        n0 = len(msgs)
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role {role!r} is not user, system, developer or assistant", param="input")
            msgs.append({"role": role, "content": _text(item.get("content", ""), where, images=role == "user")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)  # parallel calls of one turn
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output", "")
            msgs.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": out if isinstance(out, str) else _text(out, where),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input item type {kind!r} is not supported", param="input")
        if sources is not None:  # a call merged into the previous message keeps that one's index
            sources.extend([i] * (len(msgs) - n0))
    return msgs


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported, not {t.get('type')!r}", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError(
                400, "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The ChatCompletionRequest fields for this Responses request."""
    msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    msgs += input_messages(req.input)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": msgs,
        "tools": chat_tools(req.tools),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": response_format(req.text),
    }
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    effort = (req.reasoning or {}).get("effort")
    if effort in ("none", "minimal"):
        body["chat_template_kwargs"] = {"thinking": False}
    elif effort is not None:
        body["reasoning_effort"] = effort
    return {k: v for k, v in body.items() if v is not None}


def output_items(p: Parsed, finished: bool = True) -> list[dict]:
    """A parsed reply as Responses output items, in the order the model produced them."""
    status = "completed" if finished else "incomplete"
    items: list[dict] = []
    if p.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": p.reasoning}],
                "status": status,
            }
        )
    if p.content or not (p.tool_calls or p.reasoning):  # an empty reply is still one (empty) message
        items.append(message_item(p.content, status))
    for c in p.tool_calls:  # a call cut off (max_output_tokens) keeps the arguments it had
        items.append(call_item(c.id, c.name, c.arguments, status="completed" if c.complete else "incomplete"))
    return items


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_message(p: Parsed) -> dict:
    """The reply as a chat message, for `previous_response_id` history."""
    msg: dict[str, Any] = {"role": "assistant", "content": p.content}
    if p.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in p.tool_calls
        ]
    return msg
