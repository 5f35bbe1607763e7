"""POST /v1/chat/completions: render -> engine -> parse (reasoning, content, tool calls)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3serve.chat.messages import ChatInputError, check_depth
from k3serve.chat.render import ChatOptions, RenderedPrompt
from k3serve.sampling.grammar import grammar_error_text
from k3serve.sampling_params import StructuredOutputs
from k3serve.server.openai.errors import APIError
from k3serve.server.pd.kv_transfer import RemotePrefill, fetch_handoff, handoff_role
from k3serve.server.openai.logprobs import chat_logprobs, prompt_logprobs_json
from k3serve.server.parsers.response_format import (
    k3_chat_span,
    k3_think_close,
    need_xgrammar,
    requested,
    to_spec,
    whole_output_span,
    xgrammar_missing,
)
from k3serve.server.parsers.tool_choice import (
    json_tool_choice,
    k2_auto_applies,
    k2_auto_tool_choice,
    k2_tool_choice,
    k3_auto_tool_choice,
    k3_tool_choice,
)
from k3serve.server.parsers.output import Delta, OutputParser
from k3serve.server.openai.protocol import ChatCompletionRequest, NamedToolChoice, as_dicts
from k3serve.server.openai.runs import ClientGone, Run, stream_error, unless_disconnected
from k3serve.server.state import ServerState, new_id, sse, usage

log = logging.getLogger("k3serve.server")


def _tool_choice(req: ChatCompletionRequest, state: ServerState):
    tools = as_dicts(req.tools) or None
    check_json_depth(tools, "tools")
    check_json_depth(req.response_format, "response_format")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump(exclude_unset=True)
    if choice in ("auto", "required") or isinstance(choice, dict):
        if not tools:
            raise APIError(400, f"tool_choice {choice!r} needs `tools`", param="tool_choice")
    if choice == "auto" and not state.enable_auto_tool_choice:
        raise APIError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            param="tool_choice",
        )
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in {(t.get("function") or {}).get("name") for t in tools}:
            raise APIError(400, f"tool_choice names tool {name!r}, which is not in `tools`", param="tool_choice")
    return tools, choice


async def render_chat(state: ServerState, req: ChatCompletionRequest) -> tuple[list | None, Any, RenderedPrompt]:
    """(tools, tool choice, the rendered prompt) of a chat request; rendered off the event loop."""
    tools, choice = _tool_choice(req, state)
    return tools, choice, await state.offload(_render, req, state, tools, choice)


def check_json_depth(value, param: str) -> None:
    try:
        check_depth(value, param)
    except ChatInputError as e:
        raise APIError(400, str(e), param=param) from None


def template_options(chat_template_kwargs: dict | None) -> tuple[bool, dict]:
    """(thinking, the other template kwargs): K3's renderer takes `thinking` (or vLLM's
    `enable_thinking`) itself; a Jinja template gets the rest."""
    kw = dict(chat_template_kwargs or {})
    name = "thinking" if "thinking" in kw else "enable_thinking"
    thinking = kw.pop("thinking", kw.pop("enable_thinking", True))
    if not isinstance(thinking, bool):  # "no" is truthy: a string here is a client's mistake, not a yes
        raise APIError(
            400,
            f"chat_template_kwargs.{name} must be a boolean, got {thinking!r}",
            param=f"chat_template_kwargs.{name}",
        )
    return thinking, kw


def _render(req: ChatCompletionRequest, state: ServerState, tools, choice) -> RenderedPrompt:
    thinking, kw = template_options(req.chat_template_kwargs)
    try:
        return state.renderer.render(
            as_dicts(req.messages),
            ChatOptions(
                tools=tools,
                tool_choice=choice,
                response_format=req.response_format,
                thinking=thinking,
                effort=req.reasoning_effort,
                add_generation_prompt=req.add_generation_prompt,
                template_kwargs=kw,
            ),
            load_media=state.media_loader(),
        )
    except ChatInputError as e:
        raise APIError(400, str(e), param="messages") from None


def _structured(
    state: ServerState, req: ChatCompletionRequest, start_channel: str | None, tools, choice, max_tokens: int
):
    """The output constraint: a required / named tool choice's call grammar, else what
    response_format / structured_outputs / guided_* ask, else an auto tool choice's
    declared-calls grammar (_declared_only), else None. On K3 with thinking on,
    a constrained reply must close its think channel first: within the request's thinking
    budget, or half of max_tokens when it gives none, so the constrained part has room."""
    want = requested(req, state.json_any_whitespace)
    budget = req.thinking_budget()
    constrained = want is not None or (tools and (choice == "required" or isinstance(choice, dict)))
    if constrained or budget is not None:
        need_xgrammar()
    think = (
        k3_think_close(state.tokenizer, start_channel, budget if budget is not None else max_tokens // 2)
        if state.renderer.xtml and constrained
        else {}
    )
    if tools and (choice == "required" or isinstance(choice, dict)):
        if want is not None:
            raise APIError(
                400, "a required or named tool_choice cannot be combined with an output constraint", param="tool_choice"
            )
        try:
            if state.renderer.xtml:
                return k3_tool_choice(tools, choice, think, req.parallel_tool_calls, state.eos_token_id)
            if state.tool_call_parser == "kimi_k2":
                return k2_tool_choice(tools, choice, req.parallel_tool_calls, state.eos_token_id)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:  # xgrammar's words for a bad schema
            raise APIError(
                400,
                f"tool_choice {_named(choice)}: a tool's parameters do not compile to a grammar: "
                f"{grammar_error_text(e)}",
                param="tools",
            ) from None
        # no tool-call markup to enforce: a JSON array of calls, as vLLM does for any model
        return json_tool_choice(tools, choice, req.parallel_tool_calls, state.eos_token_id)
    if want is None:
        if tools and choice == "auto" and (auto := _declared_only(state, req, start_channel, tools, budget)):
            return auto
        if budget is not None and state.renderer.xtml and start_channel == "think":  # a budget alone
            return StructuredOutputs("text", **k3_think_close(state.tokenizer, start_channel, budget, refuse=False))
        return None
    span = (
        {**k3_chat_span(state.tokenizer, start_channel), **think}
        if state.renderer.xtml
        else whole_output_span(state.eos_token_id)
    )
    return to_spec(*want, **span)


def _declared_only(state: ServerState, req: ChatCompletionRequest, start_channel: str | None, tools, budget):
    """tool_choice "auto": a call, once opened, is to a declared tool with schema-valid
    arguments; the rest of the reply stays free (a thinking budget still closes the think
    channel, and the grammar starts after it). None leaves auto unconstrained, as it was: no
    xgrammar, a format with no call markup (or, K2 family, free-text markers the grammar cannot
    spell: k2_auto_applies), or a tool schema xgrammar cannot compile (a 400 for required; here
    the request is served, and the output parser drops undeclared calls)."""
    if xgrammar_missing() is not None:
        return None
    try:
        if state.renderer.xtml:
            think = k3_think_close(state.tokenizer, start_channel, budget, refuse=False) if budget is not None else {}
            return k3_auto_tool_choice(tools, think, req.parallel_tool_calls, state.eos_token_id)
        if state.tool_call_parser == "kimi_k2" and k2_auto_applies(state.tokenizer):
            return k2_auto_tool_choice(tools, req.parallel_tool_calls, state.eos_token_id)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:  # xgrammar's words for a bad schema
        log.warning("tool_choice auto left unconstrained: %s", grammar_error_text(e))
    return None


def _named(choice) -> str:
    return repr(choice["function"]["name"]) if isinstance(choice, dict) else repr(choice)


@dataclass
class ChatRun:
    """A started chat request: its engine run, rendered prompt and a parser factory."""

    run: Run
    prompt: RenderedPrompt
    make_parser: Callable[[], OutputParser]
    top_n: int | None  # top logprobs asked per token, None: no logprobs
    keeps_cache: bool = False  # a prefill for a remote decode: the answer carries its pull id


async def start_chat(state: ServerState, req: ChatCompletionRequest) -> ChatRun:
    """Validate, render, build sampling parameters and submit: every 4xx happens here, before
    a byte of the response is sent (the Responses API starts its turns here too)."""
    state.check_model(req.model)
    req.check_fields()
    tools, choice, prompt = await render_chat(state, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    state.check_logprobs(req.top_logprobs, "top_logprobs")
    state.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(
            400,
            "prompt_logprobs is returned in non-streamed chat responses only; set stream=false",
            param="prompt_logprobs",
        )
    max_tokens = state.max_tokens(len(prompt.token_ids), req.max_completion_tokens or req.max_tokens)
    top_n = req.top_logprobs or 0
    params = req.sampling_params(
        max_tokens,
        top_n if req.logprobs else None,
        state.sampling_defaults,
        keep_special_token_ids=state.structural_ids,
        structured=_structured(state, req, prompt.start_channel, tools, choice, max_tokens),
    )

    declared = frozenset((t.get("function") or {}).get("name") for t in tools or [])
    # the JSON form of a required / named choice (json_tool_choice): the reply is the calls
    json_calls = (
        bool(tools)
        and (choice == "required" or isinstance(choice, dict))
        and not state.renderer.xtml
        and state.tool_call_parser != "kimi_k2"
    )

    def parser() -> OutputParser:
        return OutputParser(
            state.tool_call_parser,
            prompt.start_channel,
            reasoning=True,
            tools_enabled=bool(tools) and choice != "none",
            parallel_tool_calls=req.parallel_tool_calls,
            history_calls=prompt.history_tool_calls,
            declared=declared,
            json_calls=json_calls,
        )

    role = handoff_role(state.kv_transfer, req.kv_transfer_params, req.n, bool(req.stream), 1)
    handoff = None
    if isinstance(role, RemotePrefill):
        handoff = await fetch_handoff(state, role, prompt.token_ids, prompt.media)
    run = Run(
        state,
        prompt.token_ids,
        params,
        new_id("chatcmpl"),
        req.priority,
        media=prompt.media,
        keep_cache=role == "produce",
        handoff=handoff,
    )
    await run.start()
    return ChatRun(run, prompt, parser, top_n if req.logprobs else None, role == "produce")


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    chat = await start_chat(state, req)
    run, prompt, parser, top_n = chat.run, chat.prompt, chat.make_parser, req.top_logprobs or 0
    head = {"id": run.request_id, "created": int(time.time()), "model": state.served_model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(state, run, head, parser, req.n, top_n if req.logprobs else None, include_usage),
            media_type="text/event-stream",
        )
    try:
        last = await unless_disconnected(raw, run.final())
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    choices = []
    for o in last.outputs:
        p = parser().parse(o.text)
        msg = {
            "role": state.response_role,
            "content": p.content if (p.content or not p.tool_calls) else None,
            "reasoning_content": p.reasoning or None,
            "reasoning": p.reasoning or None,
        }
        if p.tool_calls:
            msg["tool_calls"] = [_call_json(c) for c in p.tool_calls]
        choices.append(
            {
                "index": o.index,
                "message": msg,
                "finish_reason": _finish(o.finish_reason, p.tool_calls),
                "logprobs": chat_logprobs(state.tokenizer, o.token_ids, o.logprobs, top_n) if req.logprobs else None,
            }
        )
    n_out = sum(len(o.token_ids) for o in last.outputs)
    body = {
        **head,
        "object": "chat.completion",
        "choices": choices,
        "usage": usage(len(prompt.token_ids), n_out, last.num_cached_tokens),
    }
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(state.tokenizer, last.prompt_logprobs)
    if chat.keeps_cache:  # what the decode side pulls with (POST /v1/kv/pull)
        body["kv_transfer_params"] = {
            "remote_request_id": run.request_id,
            "remote_block_size": state.info.block_size,
        }
    return JSONResponse(body)


def _call_json(c) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _call_piece(c) -> dict:
    """A streamed tool-call delta (OpenAI's shape): id, type and name on a call's first piece,
    then only its index and what the arguments grew by."""
    if c.name is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _finish(reason: str | None, calls) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


async def _stream(state, run: Run, head, make_parser, n, top_n, include_usage):
    chunk = {**head, "object": "chat.completion.chunk"}
    parsers = [make_parser() for _ in range(n)]
    sent_tokens, done, called = [0] * n, [False] * n, [False] * n
    yield sse(
        {
            **chunk,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": state.response_role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(n)
            ],
        }
    )
    try:
        async for out in run.outputs():
            for o in out.outputs:
                i = o.index
                if done[i]:
                    continue
                d: Delta = parsers[i].delta(o.text, final=o.finished)
                called[i] = called[i] or bool(d.tool_calls)
                new_ids = o.token_ids[sent_tokens[i] :]
                lp = None
                if top_n is not None and new_ids:
                    lp = chat_logprobs(state.tokenizer, new_ids, o.logprobs[sent_tokens[i] :], top_n)
                sent_tokens[i] = len(o.token_ids)
                if not d.empty or lp is not None:
                    delta = {}
                    if d.content:
                        delta["content"] = d.content
                    if d.reasoning:
                        delta["reasoning_content"] = delta["reasoning"] = d.reasoning
                    if d.tool_calls:
                        delta["tool_calls"] = [_call_piece(c) for c in d.tool_calls]
                    yield sse(
                        {**chunk, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}]}
                    )
                if o.finished:
                    done[i] = True
                    reason = "tool_calls" if called[i] and o.finish_reason == "stop" else o.finish_reason
                    yield sse(
                        {**chunk, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]}
                    )
        if include_usage and run.last is not None:
            n_out = sum(len(o.token_ids) for o in run.last.outputs)
            yield sse({**chunk, "choices": [], "usage": usage(len(run.prompt_ids), n_out, run.last.num_cached_tokens)})
    except Exception as e:  # noqa: BLE001 - the request failed mid-stream: tell the client in-band
        yield sse(stream_error(e))
    yield "data: [DONE]\n\n"
