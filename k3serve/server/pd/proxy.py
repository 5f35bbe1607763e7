"""`k3serve router --prefill URL... --decode URL...`: an OpenAI-compatible proxy for
prefill/decode disaggregation (issue 17; vLLM's disaggregated-serving proxy, SGLang's router).

POST /v1/completions and /v1/chat/completions (streaming or not):
  1. a prefill server runs the prompt with max_tokens 1 and `kv_transfer_params.do_remote_decode`
     and answers with a pull id. With several, each is asked (`/v1/kv/held`) how much of the
     prompt its prefix cache holds: the longest wins (the least loaded on a tie); when none holds
     any, the prompt's first characters pick one by hash, so a new prefix's later requests meet it;
  2. the least-loaded decode server gets the client's own body plus `do_remote_prefill`, the pull
     id and the prefill URL; it pulls the request's latent rows + KDA state and decodes; its
     answer (or its SSE stream, byte for byte) goes back to the client.
With `decode_prefill_tokens` N > 0 (`--decode-prefill-tokens`), the decode servers are asked first
(`/v1/kv/held`, their prefix-cache tiers included): one that already holds all but at most N of
the prompt's tokens (a prefix on its device, or in a prefix-tier directory it shares with the
prefill servers: offload/store.py discovers what they wrote) serves the request itself, prefilling
only the rest, without a prefill server; if it cannot, the request takes the path above.
A decode server that cannot be reached or answers 5xx before any byte was sent gets the request
retried once on another decode server (a fresh prefill: the first pull may have consumed the
state; an unpulled one is released with `/v1/kv/release`); after that the client gets a 503. A client that disconnects closes the upstream stream,
which aborts the request on the decode server. /health is the router's; /v1/models a decode
server's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("k3serve.router")
PREFIX_CHARS = 256  # what the prefill choice hashes when no server caches the prompt: about a block
PROBE_TIMEOUT_S = 5.0  # a prefill server's /v1/kv/held answer, and /v1/kv/release


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "server_error" if status >= 500 else "invalid_request_error",
                "code": status,
            }
        },
        status_code=status,
    )


@dataclass
class Pool:
    prefill: list[str]
    decode: list[str]
    in_flight: dict[str, int] = field(default_factory=dict)
    local: int = 0  # requests a decode server served from its own prefix cache (decode_prefill_tokens)

    def by_hash(self, body: dict) -> str:
        """The prefill server a prompt's first characters hash to: a cold prefix still goes
        where its later requests will go."""
        key = json.dumps(body.get("prompt", body.get("messages")), separators=(",", ":"))[:PREFIX_CHARS].encode()
        return self.prefill[int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") % len(self.prefill)]

    def pick_prefill(self, body: dict, held: dict[str, int]) -> str:
        """The prefill server whose cache holds the longest prefix of the prompt (asked of each,
        `held`), the least loaded of those; by hash when none holds any."""
        best = max(held.values(), default=0)
        if best <= 0:
            return self.by_hash(body)
        return min((u for u in self.prefill if held.get(u) == best), key=lambda u: self.in_flight.get(u, 0))

    def pick_decode(self, exclude: set[str]) -> str | None:
        choices = [u for u in self.decode if u not in exclude]
        return min(choices, key=lambda u: self.in_flight.get(u, 0)) if choices else None


def build_router(
    prefill: list[str], decode: list[str], timeout_s: float = 600.0, tracing=None, decode_prefill_tokens: int = 0
) -> FastAPI:
    """`tracing` (server/observability/tracing.py): a `router_request` span per request, the parent of the
    prefill and decode servers' spans (its traceparent goes on to both). `decode_prefill_tokens`:
    see the module."""
    if not prefill or not decode:
        raise ValueError("the router needs at least one --prefill and one --decode server")
    pool = Pool([u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode])
    client = httpx.AsyncClient(timeout=timeout_s)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()
        if tracing is not None:
            tracing.flush()

    app = FastAPI(title="k3serve router", lifespan=lifespan)
    app.state.pool = pool

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        r = await client.get(pool.decode[0] + "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    async def disaggregated(raw: Request, path: str):
        if tracing is None:
            return await route(raw, path, {})
        span, headers = tracing.router_span(dict(raw.headers), path)
        try:
            answer = await route(raw, path, headers)
            span.set_attribute("http.status_code", answer.status_code)
            return answer
        finally:
            span.end()

    async def route(raw: Request, path: str, headers: dict):
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        tried: set[str] = set()
        if decode_prefill_tokens > 0:
            held = await _reusable(client, pool.decode, path, body)
            near = [u for u, (reused, n) in held.items() if reused > 0 and n - reused <= decode_prefill_tokens]
            if near:  # the most reused, the least loaded of those
                url = max(near, key=lambda u: (held[u][0], -pool.in_flight.get(u, 0)))
                answer = await _decode(client, pool, url, path, body, None, headers)
                if isinstance(answer, Response):
                    pool.local += 1
                    return answer
                tried.add(url)
        pull_failed = None  # the last decode server's 502: it could not pull the prefill's state
        for _ in range(2):  # the first decode server, then one retry elsewhere
            decode_url = pool.pick_decode(tried)
            if decode_url is None:
                break
            prefill_url = pool.pick_prefill(body, await _held(client, pool, path, body))
            pool.in_flight[prefill_url] = pool.in_flight.get(prefill_url, 0) + 1
            try:
                prefilled = await _prefill(client, prefill_url, path, body, headers)
            finally:
                pool.in_flight[prefill_url] -= 1
            if isinstance(prefilled, Response):
                return prefilled  # the prefill server's own 4xx/5xx, passed through
            answer = await _decode(client, pool, decode_url, path, body, prefilled, headers)
            if isinstance(answer, PullFailed):  # the prefill side failed, not this decode server: retry it
                pull_failed = answer
            elif answer is not None:
                return answer
            else:
                tried.add(decode_url)
            await _release(client, prefilled)  # the retry prefills again: drop the unpulled state
        if pull_failed is not None:  # name the server that failed, not the decode server that asked it
            return _error(
                503,
                f"the prefill server {pull_failed.prefill} failed before its state was pulled "
                f"(decode server {pull_failed.decode}: {pull_failed.message})",
            )
        return _error(503, "no decode server could serve the request (tried " + ", ".join(sorted(tried)) + ")")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await disaggregated(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await disaggregated(raw, "/v1/chat/completions")

    return app


async def _held(client: httpx.AsyncClient, pool: Pool, path: str, body: dict) -> dict[str, int]:
    """Each prefill server's cached prefix of this prompt, in tokens, its host and disk tiers
    included (0: none, or it did not answer)."""
    if len(pool.prefill) == 1:
        return {}
    return {u: reused for u, (reused, _) in (await _reusable(client, pool.prefill, path, body)).items()}


async def _reusable(client: httpx.AsyncClient, urls: list[str], path: str, body: dict) -> dict[str, tuple[int, int]]:
    """Each server's (reusable prefix, prompt) of this request in tokens; (0, 0) when it did not
    answer."""
    probe = {"chat" if path.endswith("chat/completions") else "completion": body}

    async def ask(url: str) -> tuple[int, int]:
        try:
            r = await client.post(url + "/v1/kv/held", json=probe, timeout=PROBE_TIMEOUT_S)
            if r.status_code != 200:
                return 0, 0
            a = r.json()
            return int(a.get("reusable_tokens", a["held_tokens"])), int(a["prompt_tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return 0, 0

    return dict(zip(urls, await asyncio.gather(*(ask(u) for u in urls))))


async def _release(client: httpx.AsyncClient, kv: dict) -> None:
    """Best effort: a prefill server that cannot be told keeps the state until its TTL."""
    try:
        await client.post(
            kv["remote_url"] + "/v1/kv/release", json={"request_id": kv["remote_request_id"]}, timeout=PROBE_TIMEOUT_S
        )
    except httpx.HTTPError:
        pass


async def _prefill(client: httpx.AsyncClient, url: str, path: str, body: dict, headers: dict) -> dict | Response:
    first = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    try:
        r = await client.post(url + path, json=first, headers=headers)
    except httpx.HTTPError as e:
        return _error(503, f"the prefill server {url} cannot be reached ({type(e).__name__})")
    if r.status_code != 200:
        return Response(r.content, status_code=r.status_code, media_type="application/json")
    return {
        "do_remote_prefill": True,
        "remote_request_id": r.json()["kv_transfer_params"]["remote_request_id"],
        "remote_url": url,
    }


@dataclass
class PullFailed:
    """A decode server's 502: pulling the hand-off from the prefill server failed."""

    prefill: str
    decode: str
    message: str


async def _decode(
    client: httpx.AsyncClient, pool: Pool, url: str, path: str, body: dict, kv: dict, headers: dict
) -> Response | PullFailed | None:
    """The decode server's answer; None when it failed before sending anything (retry
    elsewhere); PullFailed when it says it could not pull the prefill's state (a 502). `kv`
    None: the client's body as it is (the decode server prefills it itself)."""
    sent = body if kv is None else {**body, "kv_transfer_params": kv}
    req = client.build_request("POST", url + path, json=sent, headers=headers)
    pool.in_flight[url] = pool.in_flight.get(url, 0) + 1
    try:
        r = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        pool.in_flight[url] -= 1
        log.warning("decode server %s failed (%s); retrying elsewhere", url, type(e).__name__)
        return None
    if r.status_code == 502 and kv is not None:  # server/pd/kv_transfer.py: the pull from the prefill server failed
        try:
            message = json.loads(await r.aread())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = "pulling the prefill failed"
        finally:
            await r.aclose()
            pool.in_flight[url] -= 1
        log.warning("decode server %s could not pull from the prefill server %s: %s", url, kv["remote_url"], message)
        return PullFailed(kv["remote_url"], url, message)
    if r.status_code >= 500:
        await r.aclose()
        pool.in_flight[url] -= 1
        log.warning("decode server %s answered %d; retrying elsewhere", url, r.status_code)
        return None
    if not body.get("stream") or r.status_code != 200:
        try:
            content = await r.aread()
        finally:
            await r.aclose()
            pool.in_flight[url] -= 1
        return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def relay():
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        finally:  # also when the client left: closing the upstream aborts the decode
            await r.aclose()
            pool.in_flight[url] -= 1

    return StreamingResponse(relay(), media_type="text/event-stream")
