"""POST /v1/responses (OpenAI Responses API) on the chat path: reasoning items from the think
channel, function tools and their outputs, streaming events in the official order, and
`store` + `previous_response_id` kept in memory with a bound (GET / DELETE /v1/responses/{id}).

Stream order: response.created, response.in_progress, then per output item
output_item.added -> (content_part.added -> output_text.delta* -> output_text.done ->
content_part.done | reasoning_text.delta* -> reasoning_text.done |
function_call_arguments.delta -> function_call_arguments.done) -> output_item.done, and
response.completed (or response.incomplete at max_output_tokens). Every event carries `type`
and an increasing `sequence_number`.
"""

from __future__ import annotations

import itertools
import json
import re
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3serve.chat.markers import CLOSE
from k3serve.server.openai.errors import APIError
from k3serve.server.openai.protocol import ChatCompletionRequest
from k3serve.server.openai.responses_convert import (
    ECHOED,
    ResponsesRequest,
    assistant_message,
    call_item,
    chat_body,
    input_messages,
    message_item,
    output_items,
)
from k3serve.server.openai.runs import ClientGone, stream_error, unless_disconnected
from k3serve.server.openai.serving_chat import start_chat
from k3serve.server.state import ServerState, new_id


def _usage(prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _body(
    state: ServerState,
    req: ResponsesRequest,
    rid: str,
    created: int,
    status: str,
    output: list,
    usage: dict | None,
    incomplete: str | None = None,
) -> dict:
    body = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": state.served_model_name,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "usage": usage,
    }
    body.update({k: getattr(req, k) for k in ECHOED if getattr(req, k) is not None})
    body.setdefault("metadata", {})
    return body


def input_location(message: str, req: ResponsesRequest, total: int) -> str:
    """`messages[k]...` in a chat-side error -> `input[i]...` (or the instructions / an earlier
    turn of previous_response_id), since the client sent input items, not messages."""
    sources: list[int] = []
    input_messages(req.input, sources)
    first = total - len(sources)  # the instructions and the stored turns come first

    def where(m: re.Match) -> str:
        k = int(m.group(1))
        if k >= first:
            return f"input[{sources[k - first]}]" if not isinstance(req.input, str) else "input"
        if req.instructions and k == 0:
            return "instructions"
        return f"an earlier turn (previous_response_id), message {k - bool(req.instructions)}"

    return re.sub(r"messages\[(\d+)\]", where, message)


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request):
    req.check_fields()
    history = (
        state.responses.get(req.previous_response_id, "previous_response_id")[1] if req.previous_response_id else []
    )
    try:
        chat_req = ChatCompletionRequest(**chat_body(req, history))
    except ValueError as e:
        raise APIError(400, f"request does not convert to a chat turn: {e}", param="input") from None
    try:
        chat = await start_chat(state, chat_req)
    except APIError as e:
        if e.param == "messages":  # the chat turn this request became: name the field the client sent
            e.param, e.message = "input", input_location(e.message, req, len(chat_req.messages))
        raise
    rid, created = new_id("resp"), int(time.time())
    convo = history + input_messages(req.input)
    if req.stream:
        return StreamingResponse(_events(state, req, chat, rid, created, convo), media_type="text/event-stream")
    try:
        last = await unless_disconnected(raw, chat.run.final())
    except ClientGone:
        return Response(status_code=499)
    o = last.outputs[0]
    parsed = chat.make_parser().parse(o.text)
    incomplete = "max_output_tokens" if o.finish_reason == "length" else None
    body = _body(
        state,
        req,
        rid,
        created,
        "incomplete" if incomplete else "completed",
        output_items(parsed, not incomplete),
        _usage(
            len(chat.prompt.token_ids),
            len(o.token_ids),
            last.num_cached_tokens,
            _reasoning_tokens(state, chat, list(o.token_ids), parsed.reasoning),
        ),
        incomplete,
    )
    if req.store:
        state.responses.put(rid, body, convo + [assistant_message(parsed)])
    return JSONResponse(body)


def _reasoning_tokens(state: ServerState, chat, token_ids: list[int], reasoning: str) -> int:
    """Sampled ids of the think channel: on K3, those before its first `<|close|>` (the
    channel the prompt opened ends there); elsewhere the reasoning text re-encoded, never more
    than the ids sampled (re-encoding can count more tokens than the model sampled)."""
    if not reasoning:
        return 0
    close = state.tokenizer.special_tokens.get(CLOSE)
    if chat.prompt.start_channel == "think" and close is not None:
        return token_ids.index(close) if close in token_ids else len(token_ids)
    return min(len(state.tokenizer.encode(reasoning)), len(token_ids))


def _event(seq, kind: str, **fields) -> str:
    data = json.dumps({"type": kind, "sequence_number": next(seq), **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"


async def _events(state: ServerState, req: ResponsesRequest, chat, rid: str, created: int, convo: list[dict]):
    seq, output = itertools.count(), []
    ev = lambda kind, **f: _event(seq, kind, **f)  # noqa: E731
    start = _body(state, req, rid, created, "in_progress", [], None)
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    parser, open_item, text = chat.make_parser(), None, ""

    def close():
        nonlocal open_item, text
        if open_item is None:
            return []
        i, item = len(output), open_item
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out = [ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)]
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out = [
                ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part),
            ]
        item["status"] = "completed"
        output.append(item)
        open_item, text = None, ""
        return out + [ev("response.output_item.done", output_index=i, item=item)]

    def opened(kind: str):
        nonlocal open_item
        if open_item is not None and open_item["type"] == kind:
            return []
        out = close()
        i = len(output)
        if kind == "reasoning":
            open_item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            return out + [ev("response.output_item.added", output_index=i, item=open_item)]
        open_item = {**message_item("", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return out + [
            ev("response.output_item.added", output_index=i, item=open_item),
            ev("response.content_part.added", item_id=open_item["id"], output_index=i, content_index=0, part=part),
        ]

    calls: dict[int, int] = {}  # a tool call's index in the choice -> its output index

    def call_events(c) -> list[str]:
        """A call's item opens with its name, its arguments stream as deltas, it is done at its close."""
        out = []
        if c.name is not None:
            out += close()
            calls[c.index] = len(output)
            output.append({**call_item(c.id, c.name, ""), "status": "in_progress"})
            out.append(ev("response.output_item.added", output_index=calls[c.index], item=output[-1]))
        i = calls[c.index]
        item = output[i]
        if c.arguments:
            item["arguments"] += c.arguments
            out.append(
                ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=c.arguments)
            )
        return out + (call_done(i, "completed") if c.done else [])

    def call_done(i: int, status: str) -> list[str]:
        item = output[i]
        item["status"] = status
        args = item["arguments"]
        return [
            ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=i,
                arguments=args,
                name=item["name"],
            ),
            ev("response.output_item.done", output_index=i, item=item),
        ]

    o = None
    try:
        async for out in chat.run.outputs():
            o = out.outputs[0]
            d = parser.delta(o.text, final=o.finished)
            for kind, piece in (("reasoning", d.reasoning), ("message", d.content)):
                if piece:
                    for e in opened(kind):
                        yield e
                    text += piece
                    name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    yield ev(
                        name, item_id=open_item["id"], output_index=len(output), content_index=0, delta=piece, **extra
                    )
            for c in d.tool_calls:
                for e in call_events(c):
                    yield e
    except Exception as e:  # noqa: BLE001 - the request failed mid-stream: say so in-band
        yield ev("error", **stream_error(e)["error"])
        return
    for e in close():
        yield e
    for i in [i for i in calls.values() if output[i]["status"] == "in_progress"]:  # cut inside a call
        for e in call_done(i, "incomplete"):
            yield e
    parsed = parser.parse(o.text) if o is not None else None
    if parsed is not None and not output:  # an empty reply is still one (empty) message
        for e in opened("message") + close():
            yield e
    incomplete = "max_output_tokens" if o is not None and o.finish_reason == "length" else None
    last = chat.run.last
    usage = _usage(
        len(chat.prompt.token_ids),
        len(o.token_ids) if o else 0,
        last.num_cached_tokens if last else 0,
        _reasoning_tokens(state, chat, list(o.token_ids), parsed.reasoning) if parsed else 0,
    )
    body = _body(state, req, rid, created, "incomplete" if incomplete else "completed", output, usage, incomplete)
    if req.store and parsed is not None:
        state.responses.put(rid, body, convo + [assistant_message(parsed)])
    yield ev("response.incomplete" if incomplete else "response.completed", response=body)
