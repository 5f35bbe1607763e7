"""Running one API request on the AsyncEngine: start it (turning engine errors into HTTP ones
before any byte is sent), follow its cumulative outputs, record metrics when it ends, and stop
early when the client goes away (the engine then aborts and frees its cache)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request

from k3serve.engine.async_engine import EngineOverloaded, EngineUnavailable, RequestFailed
from k3serve.outputs import RequestOutput
from k3serve.server.openai.media_parts import engine_prompt
from k3serve.server.observability.tracing import HEADERS as TRACE_HEADERS
from k3serve.sampling_params import ParamError, SamplingParams
from k3serve.server.openai.errors import APIError, error_body
from k3serve.server.state import ServerState

log = logging.getLogger("k3serve.server")
RETRY_AFTER_S = 1  # Retry-After on 503: the queue drains at decode speed
# ... and on a 503 for a dead engine (a worker died): a supervisor restarts it in seconds, or a
# load balancer moves the client to another replica; either way not at once
UNAVAILABLE_RETRY_AFTER_S = 5


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


async def unless_disconnected(raw: Request, work: Awaitable):
    """`await work`, but stop it (raising ClientGone) as soon as the client disconnects.

    Runs under the pure-ASGI guard, so `receive()` after the body really reports
    `http.disconnect` (a BaseHTTPMiddleware would hide it). Cancelling `work` closes the
    engine streams it is reading, which aborts their requests before the next step.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(raw))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


async def finals(runs: list["Run"]) -> list[RequestOutput]:
    """The last outputs of several runs; if one fails, the others are stopped (and aborted)."""
    tasks = [asyncio.ensure_future(r.final()) for r in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stream_error(e: BaseException) -> dict:
    """The in-band error event of a stream: the engine's own sentence for a request that failed
    alone, a fixed one (and a log line) for anything else; never raw exception text."""
    if isinstance(e, RequestFailed):
        return error_body(500 if e.model_fault else 400, str(e))
    if isinstance(e, EngineUnavailable):
        return error_body(503, str(e))
    log.error("stream failed: %s", type(e).__name__, exc_info=log.isEnabledFor(logging.DEBUG))
    return error_body(500, f"generation failed (internal {type(e).__name__})")


async def _disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class Run:
    def __init__(
        self,
        state: ServerState,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        media: tuple = (),
        keep_cache: bool = False,
        handoff=None,
    ):
        self.state, self.prompt_ids, self.params, self.request_id = state, prompt_ids, params, request_id
        self.trace_headers = TRACE_HEADERS.get()  # the request's traceparent (server/observability/tracing.py)
        self.arrival, self.first_token, self.last = time.monotonic(), None, None
        self._gen = state.engine.generate(
            engine_prompt(prompt_ids, media), params, request_id, priority, keep_cache, handoff
        )
        if state.log_requests:
            p = params
            log.info(
                "request %s: %d prompt tokens, n=%d, max_tokens=%s, temperature=%s, top_p=%s, top_k=%s, seed=%s",
                request_id,
                len(prompt_ids),
                p.n,
                p.max_tokens,
                p.temperature,
                p.top_p,
                p.top_k,
                p.seed,
            )
        self._first: RequestOutput | None = None
        self._recorded = False
        self._tokens, self._at = 0, self.arrival  # output tokens seen so far, and when

    async def start(self) -> None:
        """Submit the request and wait for its first output; errors become APIErrors."""
        try:
            self._first = await self._gen.__anext__()
        except EngineOverloaded as e:
            raise APIError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}) from None
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        except RequestFailed as e:
            raise APIError(500 if e.model_fault else 400, str(e)) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self._seen(self._first)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The first output, then the rest (RequestFailed if the request failed alone)."""
        try:
            out = self._first
            yield out
            while not out.finished:
                out = await self._gen.__anext__()
                self._seen(out)
                yield out
            self._record(out)
        finally:
            await self._gen.aclose()  # not finished: the engine aborts the request

    async def final(self) -> RequestOutput:
        """The last output; APIError(400) if the request failed alone after it started."""
        last = None
        try:
            async for out in self.outputs():
                last = out
        except RequestFailed as e:
            raise APIError(500 if e.model_fault else 400, str(e)) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}) from None
        return last

    async def close(self) -> None:
        """Give the request up (aborted in the engine if it had started)."""
        await self._gen.aclose()

    def _seen(self, out: RequestOutput) -> None:
        now = time.monotonic()
        tokens = sum(len(o.token_ids) for o in out.outputs)
        if self.first_token is None and tokens:
            self.first_token = now
        elif tokens > self._tokens:  # inter-token latency, per token of this output
            self.state.metrics.observe_gap(now - self._at, tokens - self._tokens)
        if tokens > self._tokens:
            self._tokens, self._at = tokens, now
        self.last = out

    def _record(self, out: RequestOutput) -> None:
        if self._recorded:
            return
        self._recorded = True
        n = sum(len(o.token_ids) for o in out.outputs)
        if self.state.log_requests:
            log.info(
                "request %s finished: %d tokens, %s, %.3f s",
                self.request_id,
                n,
                ",".join(str(o.finish_reason) for o in out.outputs),
                time.monotonic() - self.arrival,
            )
        asked = self.params.max_tokens
        if asked is None:  # up to the context: what is left of it after the prompt
            asked = max(0, self.state.max_model_len - len(self.prompt_ids))
        if self.state.tracing is not None:
            self.state.tracing.request_span(
                self.trace_headers,
                self.request_id,
                self.state.served_model_name,
                self.params,
                len(self.prompt_ids),
                n,
                out.num_cached_tokens,
                out.metrics,
                self.arrival,
                time.monotonic(),
            )
        self.state.metrics.observe_request(
            len(self.prompt_ids),
            n,
            [o.finish_reason for o in out.outputs],
            self.arrival,
            self.first_token,
            time.monotonic(),
            out.metrics,
            max_tokens=asked,
        )
