"""The FastAPI application: routes, auth, body limit, per-status request counting.

Routes: /v1/models, /v1/chat/completions, /v1/completions, /tokenize, /detokenize, /health,
/version, /metrics. `/v1/*` needs `Authorization: Bearer KEY` when the server has an API key.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from k3serve import __version__
from k3serve.chat.messages import ChatInputError
from k3serve.chat.render import ChatOptions
from k3serve.server.errors import APIError, BodyLimitMiddleware, error_response, install_error_handlers
from k3serve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from k3serve.server.serving_chat import create_chat_completion
from k3serve.server.serving_completion import create_completion
from k3serve.server.state import ServerState

ROUTES = {"/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/health",
          "/version", "/metrics", "/reset_prefix_cache"}


def build_app(state: ServerState, max_body_bytes: int = 32 * 2**20) -> FastAPI:
    app = FastAPI(title="k3serve", version=__version__, docs_url=None, redoc_url=None)
    app.state.k3 = state
    install_error_handlers(app)

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        path = request.url.path
        if state.api_key and path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {state.api_key}":
                response = error_response(401, "invalid or missing API key")
                state.metrics.http.labels(path, "401").inc()
                return response
        response = await call_next(request)
        state.metrics.http.labels(path if path in ROUTES else "other", str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        blocks, checkpoints = await state.engine.call(state.engine.engine.reset_prefix_cache)
        return {"freed_blocks": blocks, "dropped_checkpoints": checkpoints}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "k3serve",
            "root": state.engine.engine.model_path, "max_model_len": state.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state, req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`")
        if req.prompt is not None:
            ids = state.tokenizer.encode(req.prompt, allow_special=True)
        else:
            try:
                ids = state.renderer.render(req.messages, ChatOptions(
                    add_generation_prompt=req.add_generation_prompt)).token_ids
            except ChatInputError as e:
                raise APIError(400, str(e), param="messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        V = state.engine.engine.model.cfg.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < V), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{V - 1})", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    return app


__all__ = ["build_app"]
