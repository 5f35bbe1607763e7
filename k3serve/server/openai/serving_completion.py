"""POST /v1/completions: text or token-id prompts (one or a batch), streaming or not."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3serve.server.openai.errors import APIError
from k3serve.server.pd.kv_transfer import RemotePrefill, fetch_handoff, handoff_role
from k3serve.server.openai.logprobs import completion_logprobs, echo_logprobs, join_logprobs, prompt_logprobs_json
from k3serve.server.openai.protocol import CompletionRequest
from k3serve.server.parsers.response_format import need_xgrammar, requested, to_spec, whole_output_span
from k3serve.server.openai.runs import ClientGone, Run, finals, stream_error, unless_disconnected
from k3serve.server.state import ServerState, new_id, sse, usage


def _prompts(state: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    """(text, ids) per prompt; a list of ints is one tokenized prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, state.tokenizer.encode(p, allow_special=True)))
        else:
            out.append((None, list(p)))
    for _, ids in out:
        if not ids:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
    return out


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    state.check_model(req.model)
    req.check_fields()
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, req.n):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    prompts = await state.offload(_prompts, state, req.prompt)  # tokenizing a long prompt takes seconds
    state.check_logprobs(req.logprobs, "logprobs")
    state.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    top_n = req.logprobs
    # echo + logprobs returns the prompt's logprobs too (lm-evaluation-harness loglikelihood)
    wanted = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    want = requested(req, state.json_any_whitespace)
    if want:
        need_xgrammar()
    structured = to_spec(*want, **whole_output_span(state.eos_token_id)) if want else None
    rid = new_id("cmpl")
    role = handoff_role(state.kv_transfer, req.kv_transfer_params, req.n, bool(req.stream), len(prompts))
    keep = role == "produce"
    runs, handoff = [], None
    for k, (_, ids) in enumerate(prompts):
        params = req.sampling_params(
            state.max_tokens(len(ids), req.max_tokens, "prompt"), top_n, state.sampling_defaults, structured=structured
        )
        if wanted:
            params = dataclasses.replace(params, prompt_logprobs=max(wanted))
        if isinstance(role, RemotePrefill):  # pull only once the request is known to be servable
            handoff = await fetch_handoff(state, role, ids)
        runs.append(Run(state, ids, params, f"{rid}-{k}", req.priority, keep_cache=keep, handoff=handoff))
    try:
        for r in runs:
            await r.start()
    except BaseException as e:
        for r in runs:  # release the ones already submitted
            await r.close()
        if isinstance(e, APIError) and e.param == "messages":  # the engine's name for the prompt's
            e.param = "prompt"  # own fault (media pad ids without images): here the field is `prompt`
        raise
    head = {"id": rid, "created": int(time.time()), "model": state.served_model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(state, runs, prompts, head, req, include_usage), media_type="text/event-stream"
        )
    try:
        outs = await unless_disconnected(raw, finals(runs))
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    choices = []
    for k, (final, (text, ids)) in enumerate(zip(outs, prompts)):
        prefix = (text if text is not None else state.tokenizer.decode(ids)) if req.echo else ""
        for o in final.outputs:
            lp = (
                completion_logprobs(state.tokenizer, o.token_ids, o.logprobs, top_n, len(prefix))
                if top_n is not None
                else None
            )
            if req.echo and top_n is not None:
                lp = join_logprobs(echo_logprobs(state.tokenizer, ids, final.prompt_logprobs, top_n), lp)
            choice = {
                "index": k * req.n + o.index,
                "text": prefix + o.text,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "logprobs": lp,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(state.tokenizer, final.prompt_logprobs)
            choices.append(choice)
    n_prompt = sum(len(ids) for _, ids in prompts)
    n_out = sum(len(o.token_ids) for f in outs for o in f.outputs)
    cached = sum(f.num_cached_tokens for f in outs)
    body = {**head, "object": "text_completion", "choices": choices, "usage": usage(n_prompt, n_out, cached)}
    if keep:  # what the decode side pulls with (POST /v1/kv/pull)
        body["kv_transfer_params"] = {
            "remote_request_id": runs[0].request_id,
            "remote_block_size": state.info.block_size,
        }
    return JSONResponse(body)


async def _stream(state: ServerState, runs: list[Run], prompts, head, req: CompletionRequest, include_usage: bool):
    chunk = {**head, "object": "text_completion"}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, run: Run):
        try:
            async for out in run.outputs():
                await queue.put((k, out))
        except Exception as e:  # noqa: BLE001 - reported in-band, see stream_error
            await queue.put((k, e))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, r)) for k, r in enumerate(runs)]
    sent = {}  # (prompt, choice) -> (chars, tokens)
    # with logprobs the echo waits for the prompt's logprobs, which come with the first output
    late_echo = req.echo and (req.logprobs is not None or req.prompt_logprobs is not None)
    try:
        if req.echo and not late_echo:
            for k, (text, ids) in enumerate(prompts):
                for i in range(req.n):
                    echo = text if text is not None else state.tokenizer.decode(ids)
                    yield sse(
                        {
                            **chunk,
                            "choices": [
                                {"index": k * req.n + i, "text": echo, "logprobs": None, "finish_reason": None}
                            ],
                        }
                    )
        live = len(runs)
        while live:
            k, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, Exception):
                yield sse(stream_error(item))
                continue
            for o in item.outputs:
                if (k, o.index) not in sent and late_echo:
                    yield sse({**chunk, "choices": [_echo_choice(state, req, k * req.n + o.index, prompts[k], item)]})
                chars, toks = sent.get((k, o.index), (0, 0))
                text, new_ids = o.text[chars:], o.token_ids[toks:]
                lp = None
                if req.logprobs is not None and new_ids:
                    lp = completion_logprobs(state.tokenizer, new_ids, o.logprobs[toks:], req.logprobs, chars)
                if not (text or lp or o.finished):
                    continue  # bytes of a character still in flight: nothing to show yet
                sent[(k, o.index)] = (len(o.text), len(o.token_ids))
                yield sse(
                    {
                        **chunk,
                        "choices": [
                            {
                                "index": k * req.n + o.index,
                                "text": text,
                                "logprobs": lp,
                                "finish_reason": o.finish_reason if o.finished else None,
                            }
                        ],
                    }
                )
        if include_usage:
            n_prompt = sum(len(ids) for _, ids in prompts)
            n_out = sum(len(o.token_ids) for r in runs if r.last for o in r.last.outputs)
            yield sse({**chunk, "choices": [], "usage": usage(n_prompt, n_out)})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()


def _echo_choice(state: ServerState, req: CompletionRequest, index: int, prompt, out) -> dict:
    """The streamed echo of a prompt, with its logprobs once the engine has computed them."""
    text, ids = prompt
    choice = {
        "index": index,
        "text": text if text is not None else state.tokenizer.decode(ids),
        "logprobs": None,
        "finish_reason": None,
    }
    if req.logprobs is not None:
        choice["logprobs"] = echo_logprobs(state.tokenizer, ids, out.prompt_logprobs, req.logprobs)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(state.tokenizer, out.prompt_logprobs)
    return choice
