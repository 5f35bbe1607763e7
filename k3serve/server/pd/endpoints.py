"""The prefill server's hand-off endpoints (server/pd/kv_transfer.py has the roles and the pull):
`POST /v1/kv/held` (how much of a request's prompt this server's prefix cache holds, for a
router), `/v1/kv/pull` (a kept prefill's latent rows past the puller's held tokens, KDA state and
continuation, as bytes or a NIXL offer) and `/v1/kv/release`."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from k3serve.server.openai.errors import APIError
from k3serve.server.openai.media_parts import engine_prompt
from k3serve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from k3serve.server.openai.serving_chat import render_chat
from k3serve.server.openai.serving_completion import _prompts


class PullRequest(BaseModel):
    request_id: str
    held_tokens: int = 0
    transport: str = "http"  # "http": the bytes in the answer; "nixl": an offer to READ them (server/pd/nixl.py)


class ReleaseRequest(BaseModel):
    request_id: str


class HeldRequest(BaseModel):
    """A request body as the router would send it: how much of its prompt this server caches."""

    chat: dict | None = None  # a /v1/chat/completions body
    completion: dict | None = None  # a /v1/completions body (one prompt)


async def held(state, req: HeldRequest) -> dict:
    """The prompt tokens of a request this server's prefix cache holds (whole blocks), for a
    router choosing the prefill server with the longest cached prefix; the prompt is rendered
    exactly as the request itself would be (tools, media keys), nothing is run."""
    if (req.chat is None) == (req.completion is None):
        raise APIError(400, "give exactly one of `chat` or `completion`")
    try:
        if req.chat is not None:
            prompt = (await render_chat(state, ChatCompletionRequest.model_validate(req.chat)))[2]
            ids, media = prompt.token_ids, prompt.media
        else:
            prompts = await state.offload(_prompts, state, CompletionRequest.model_validate(req.completion).prompt)
            if len(prompts) != 1:
                raise APIError(400, "a prefill/decode hand-off is one prompt", param="prompt")
            ids, media = prompts[0][1], ()
    except ValueError as e:  # pydantic's ValidationError
        raise APIError(400, f"not a valid request body: {e}") from None
    cache_ids = await state.engine.cache_ids(engine_prompt(ids, media)) if media else ids
    return {
        "held_tokens": await state.engine.held_tokens(cache_ids),  # on the device (a hand-off skips them)
        "reusable_tokens": await state.engine.reusable_tokens(cache_ids),  # the prefix-cache tiers too
        "prompt_tokens": len(ids),
    }


async def pull(state, req: PullRequest) -> Response:
    from k3serve.engine.handoff import to_bytes

    if state.kv_transfer is None or not state.kv_transfer.produces:
        raise APIError(404, "this server keeps no prefills for remote decode (no --kv-transfer-config producer role)")
    if req.held_tokens < 0:
        raise APIError(400, "held_tokens must be >= 0", param="held_tokens")
    if req.transport not in ("http", "nixl") or (req.transport == "nixl") != (state.nixl is not None):
        raise APIError(
            400,
            f"transport {req.transport!r} does not match this server's kv_connector {state.kv_transfer.kv_connector}",
            param="transport",
        )
    try:
        h = await state.engine.pull_handoff(req.request_id, req.held_tokens)
    except KeyError as e:
        raise APIError(404, str(e.args[0]), param="request_id") from None
    data = await state.offload(to_bytes, h)
    state.metrics.kv_transfer_bytes.inc(len(data))
    if state.nixl is not None:
        return JSONResponse(await state.offload(state.nixl.lend, req.request_id, data))
    return Response(content=data, media_type="application/octet-stream")


async def release(state, req: ReleaseRequest) -> dict:
    """Drop a kept prefill nobody will pull (the router retried the request elsewhere)."""
    if state.kv_transfer is None or not state.kv_transfer.produces:
        raise APIError(404, "this server keeps no prefills for remote decode (no --kv-transfer-config producer role)")
    return {"request_id": req.request_id, "released": await state.engine.release_handoff(req.request_id)}
