"""The FastAPI application: routes behind the pure-ASGI guard (auth, body limit and read
timeout, clean 500s, per-status request counting; see `guard.py`).

Routes: /v1/models, /v1/chat/completions, /v1/completions, /tokenize, /detokenize, /health,
/ping, /version, /metrics, /reset_prefix_cache. With an API key every route needs
`Authorization: Bearer KEY` except /health and /ping (and /metrics with `metrics_public`);
admin routes (/reset_prefix_cache) can never be opened.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse

from k3serve import __version__
from k3serve.chat.messages import ChatInputError
from k3serve.chat.render import ChatOptions
from k3serve.server.openai.errors import APIError, body_schema, install_error_handlers, parse_body
from k3serve.server.guard import GuardConfig, GuardMiddleware
from k3serve.server.heap import trim_forever
from k3serve.server.pd.endpoints import HeldRequest, PullRequest, ReleaseRequest, held, pull, release
from k3serve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    as_dicts,
)
from k3serve.server.openai.serving_chat import create_chat_completion, template_options
from k3serve.server.openai.serving_completion import create_completion
from k3serve.server.openai.responses_convert import ResponsesRequest
from k3serve.server.openai.serving_responses import create_response
from k3serve.server.openai.runs import UNAVAILABLE_RETRY_AFTER_S
from k3serve.server.state import ServerState
from k3serve.server.observability.stats_log import log_stats_forever

ROUTES = frozenset(
    {
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/health",
        "/ping",
        "/version",
        "/metrics",
        "/reset_prefix_cache",
        "/v1/kv/pull",
        "/v1/kv/held",
        "/v1/kv/release",
    }
)
ALWAYS_PUBLIC = frozenset({"/health", "/ping"})


def build_app(
    state: ServerState,
    max_body_bytes: int = 32 * 2**20,
    metrics_public: bool = False,
    body_timeout_s: float = 30.0,
    stats_interval_s: float = 0.0,
    cors: dict | None = None,
    root_path: str = "",
    request_id_headers: bool = False,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(log_stats_forever(state.engine, stats_interval_s)) if stats_interval_s > 0 else None
        trim = asyncio.create_task(trim_forever())  # freed heap back to the OS: RSS stays flat (server/heap.py)
        yield
        trim.cancel()
        if task is not None:
            task.cancel()
        if state.tracing is not None:  # the last spans leave before the process does
            state.tracing.flush()

    app = FastAPI(title="k3serve", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health():  # 503 once the engine loop has died or one step has hung (vLLM's meaning)
        why = state.engine.health(state.wedged_after_s)
        if why is not None:
            raise APIError(503, f"engine unhealthy: {why}", headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})
        return Response(status_code=200)

    async def ping():  # SageMaker-style liveness, as vLLM serves it
        return Response(status_code=200)

    app.add_api_route("/ping", ping, methods=["GET"], operation_id="ping_get")
    app.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        blocks, checkpoints = await state.engine.reset_prefix_cache()
        return {"freed_blocks": blocks, "dropped_checkpoints": checkpoints}

    @app.get("/v1/models")
    async def models():
        # vLLM's card: `parent` null for a base model, one permission object; `root` the hub repo
        # id served (what a tokenizer-driven client, guidellm / lm-eval / aiperf, loads its
        # tokenizer from, as vLLM's `root`), or the served name for a local folder: the server
        # shows no file paths
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "k3serve",
            "root": state.info.model_source or state.served_model_name,
            "parent": None,
            "max_model_len": state.max_model_len,
            "max_num_seqs": state.max_num_seqs,
            "permission": [
                {
                    "id": f"modelperm-{state.served_model_name}",
                    "object": "model_permission",
                    "created": state.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        if state.info.seq_limit_note:  # fewer slots than asked for: say why
            card["max_num_seqs_note"] = state.info.seq_limit_note
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state, req, raw)

    @app.post("/v1/kv/pull")
    async def kv_pull(req: PullRequest):
        return await pull(state, req)

    @app.post("/v1/kv/held")
    async def kv_held(req: HeldRequest):
        return await held(state, req)

    @app.post("/v1/kv/release")
    async def kv_release(req: ReleaseRequest):
        return await release(state, req)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        return await create_response(state, req, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return state.responses.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        state.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # The body is parsed here, not by FastAPI: FastAPI runs json.loads on the event loop, and a
    # 30 MiB body held it 53 ms in one C call. pydantic parses the bytes itself on a worker thread
    # (one 17 ms hold); openapi_extra keeps the schema /docs shows.
    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(raw: Request):
        req = await state.offload(parse_body, TokenizeRequest, await raw.body())
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`")
        # a 30 MiB prompt is ~20 M ids: encoding, JSON and freeing them all stay off the event loop
        body = await state.offload(_tokenize_body, state, req)
        return StreamingResponse(iter(body), media_type="application/json")  # one big write would stall too

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        bad = next((t for t in req.tokens if not state.decodable(t)), None)
        if bad is not None:
            raise APIError(
                400,
                f"token id {bad} is not in the vocabulary (0..{state.vocab_size - 1}"
                f"{', some ids unmapped' if state.unmapped_ids else ''})",
                param="tokens",
            )
        return {"prompt": await state.offload(state.tokenizer.decode, req.tokens)}

    public = ALWAYS_PUBLIC | ({"/metrics"} if metrics_public else set())
    guard = GuardConfig(
        state.api_key,
        frozenset(public),
        max_body_bytes,
        body_timeout_s,
        state.lifecycle,
        root_path.rstrip("/"),
        request_id_headers,
    )
    app.add_middleware(
        GuardMiddleware,
        config=guard,
        routes=ROUTES,
        count=lambda route, status: state.metrics.http.labels(route, status).inc(),
    )
    if state.tracing is not None:  # the request's traceparent, for its span (server/observability/tracing.py)
        from k3serve.server.observability.tracing import TraceHeaders

        app.add_middleware(TraceHeaders)
    if cors:  # outermost: a preflight carries no API key and is answered here
        app.add_middleware(CORSMiddleware, **cors)
    return app


def _tokenize_body(state: ServerState, req: TokenizeRequest) -> list[bytes]:
    if req.prompt is not None:  # parts made, written and freed one by one
        return tokens_json(state.tokenizer.encode_parts(req.prompt, allow_special=True), state.max_model_len)
    thinking, kw = template_options(req.chat_template_kwargs)
    try:
        ids = state.renderer.render(
            as_dicts(req.messages),
            ChatOptions(thinking=thinking, add_generation_prompt=req.add_generation_prompt, template_kwargs=kw),
            load_media=state.media_loader(),
        ).token_ids
    except ChatInputError as e:
        raise APIError(400, str(e), param="messages") from None
    body = tokens_json([ids], state.max_model_len)
    while ids:  # freed a slice per call, from the end (a slice off the front moves the rest):
        del ids[-TOKENS_PER_JOIN:]  # freeing 20 M ids at once holds the GIL ~0.1 s
    return body


TOKENS_PER_JOIN = 1 << 14  # ids written, or freed, by one call (~3 ms of the GIL)


def tokens_json(parts, max_model_len: int) -> list[bytes]:
    """The /tokenize body from id parts, written a slice of at most TOKENS_PER_JOIN
    ids per call so other threads get the GIL in between: one join of 20 M ids holds it for
    seconds (a rendered chat, one part of every id, stalled the event loop 1.9 s). The event
    loop waits out each hold it meets (one /health reply meets several), so holds stay short."""
    out, count = [b'{"tokens":['], 0
    for ids in parts:
        for i in range(0, len(ids), TOKENS_PER_JOIN):
            piece = ids[i : i + TOKENS_PER_JOIN]
            out.append((b"," if count else b"") + ",".join(map(str, piece)).encode())
            count += len(piece)
    out.append(f'],"count":{count},"max_model_len":{max_model_len}}}'.encode())
    return out


__all__ = ["build_app"]
