"""The outermost ASGI layer of the app (pure ASGI, so `http.disconnect` reaches the handlers).

For every HTTP request, in order:
  1. auth: `Authorization: Bearer KEY` (scheme case-insensitive, constant-time compare) on every
     route but the public ones (`/health`, `/ping`, and `/metrics` when configured); 401 carries
     `WWW-Authenticate: Bearer`;
  2. body: read in full before the app sees it, counting bytes as they stream in (413 for a
     declared or a chunked body over the limit) with a per-chunk read timeout and a whole-body
     deadline (408: the body must finish within the timeout plus one second per BODY_MIN_RATE
     bytes, so a body trickled a byte at a time cannot hold a connection open), then replayed
     to the app; later `receive()` calls go to the server, so a disconnect is seen;
  3. any exception the app lets escape becomes a JSON 500 on a connection kept open, logged in
     one line (the trace at debug level), instead of uvicorn's text 500 and closed socket; a
     request still running when shutdown's grace period ends gets a JSON 503;
  4. the response's status is counted per route in `k3serve:http_requests`;
  5. while the server drains at shutdown (`Lifecycle.draining`), a new request gets a JSON 503
     with `Connection: close` (only `/metrics` still answers), while those already in flight
     (`Lifecycle.active`) run on;
  6. `--root-path /prefix` (behind a path-routing proxy): a path under the prefix is routed, and
     checked above, as the path after it (the app sees the prefix as the scope's root_path);
     `--enable-request-id-headers`: every response carries `X-Request-Id`, the request's own or
     a new one (vLLM's flag).
References: Starlette's ServerErrorMiddleware (what it does, minus the re-raise), vLLM's
`AuthenticationMiddleware` (pure ASGI since vLLM PR #12197).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from dataclasses import dataclass

from k3serve.server.openai.errors import error_body

log = logging.getLogger("k3serve.server")


@dataclass
class Lifecycle:
    """Shared by the guard and `http.DrainingServer`: requests in flight, and whether new
    ones are refused because shutdown has begun."""

    draining: bool = False
    active: int = 0


DRAIN_OPEN = frozenset({"/metrics"})
BODY_MIN_RATE = 64 * 1024  # bytes a second a body must average past its first body_timeout_s


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None
    public_paths: frozenset[str] = frozenset({"/health", "/ping"})
    max_body_bytes: int = 32 * 2**20
    body_timeout_s: float = 30.0  # longest wait for the next body chunk
    lifecycle: Lifecycle | None = None
    root_path: str = ""  # --root-path, without a trailing slash
    request_id_headers: bool = False  # --enable-request-id-headers


class GuardMiddleware:
    def __init__(self, app, config: GuardConfig, count=None, routes: frozenset[str] = frozenset()):
        self.app, self.config = app, config
        self.count, self.routes = count, routes  # count(route, status) -> None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = self.config.root_path
        if root:
            scope = dict(scope, root_path=root)
            if path == root or path.startswith(root + "/"):
                path = path[len(root) :] or "/"
        status = {"code": 0}
        request_id = None
        if self.config.request_id_headers:
            request_id = dict(scope.get("headers") or []).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if request_id is not None:
                    message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", request_id)])
            await send(message)

        life = self.config.lifecycle
        if life is not None and life.draining and path not in DRAIN_OPEN:
            await reply(send_counted, 503, "the server is shutting down", [(b"retry-after", b"1")], close=True)
            return self._count(path, status)
        if life is not None:
            life.active += 1
        try:
            await self._handle(scope, receive, send_counted, path, status)
        finally:
            if life is not None:
                life.active -= 1
            self._count(path, status)

    def _count(self, path: str, status: dict) -> None:
        if self.count is not None and status["code"]:
            self.count(path if path in self.routes else "other", str(status["code"]))

    async def _handle(self, scope, receive, send, path: str, status: dict) -> None:
        if not self._authorized(scope, path):
            return await reply(send, 401, "invalid or missing API key", [(b"www-authenticate", b"Bearer")])
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the client to go away

        try:
            await self.app(scope, replay, send)
        except asyncio.CancelledError:  # uvicorn cancels what outlives --timeout-graceful-shutdown
            if not status["code"]:
                await reply(send, 503, "the server is shutting down", [(b"retry-after", b"1")], close=True)
            log.info("%s %s cancelled at shutdown", scope.get("method"), path)
        except Exception as e:  # noqa: BLE001 - the last net: one line, a JSON 500, the socket kept
            log.error(
                "unhandled %s on %s %s: %s",
                type(e).__name__,
                scope.get("method"),
                path,
                e,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            if not status["code"]:
                await reply(send, 500, f"internal server error ({type(e).__name__})")

    def _authorized(self, scope, path: str) -> bool:
        key = self.config.api_key
        if not key or path in self.config.public_paths:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once a 408/413 has been sent."""
        limit = self.config.max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await reply(send, 413, f"request body exceeds {limit} bytes", close=True)
            return None
        chunks, seen = [], 0
        timeout = self.config.body_timeout_s
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            left = start + timeout + seen / BODY_MIN_RATE - loop.time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), min(timeout, left))
            except asyncio.TimeoutError:
                why = (
                    f"request body not received within {timeout:g} s"
                    if left > timeout
                    else f"request body too slow: {seen} bytes in {loop.time() - start:.1f} s (it must arrive "
                    f"within {timeout:g} s plus 1 s per {BODY_MIN_RATE} bytes)"
                )
                await reply(send, 408, why, close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                await reply(send, 413, f"request body exceeds {limit} bytes", close=True)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def reply(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = (), close: bool = False) -> None:
    """Send an OpenAI-style JSON error straight from the ASGI layer."""
    body = json.dumps(error_body(status, message)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:  # the rest of the body was not read: the connection cannot be reused
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
