"""Running one API request on the AsyncEngine: start it (turning engine errors into HTTP ones
before any byte is sent), follow its cumulative outputs, record metrics when it ends, and stop
early when the client goes away (the engine then aborts and frees its cache)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from k3serve.engine.async_engine import EngineOverloaded
from k3serve.engine.outputs import RequestOutput
from k3serve.sampling.params import SamplingParams
from k3serve.server.errors import APIError
from k3serve.server.state import ServerState


class Run:
    def __init__(self, state: ServerState, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 priority: int = 0):
        self.state, self.prompt_ids, self.params, self.request_id = state, prompt_ids, params, request_id
        self.arrival, self.first_token, self.last = time.monotonic(), None, None
        self._gen = state.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id, priority)
        self._first: RequestOutput | None = None
        self._recorded = False

    async def start(self) -> None:
        """Submit the request and wait for its first output; errors become APIErrors."""
        try:
            self._first = await self._gen.__anext__()
        except EngineOverloaded as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self._seen(self._first)

    async def outputs(self, raw: Request | None = None) -> AsyncIterator[RequestOutput]:
        """The first output, then the rest; with `raw`, stop when the client disconnects."""
        try:
            out = self._first
            yield out
            while not out.finished:
                if raw is not None and await raw.is_disconnected():
                    return
                out = await self._gen.__anext__()
                self._seen(out)
                yield out
            self._record(out)
        finally:
            await self._gen.aclose()  # not finished: the engine aborts the request

    async def close(self) -> None:
        """Give the request up (aborted in the engine if it had started)."""
        await self._gen.aclose()

    def _seen(self, out: RequestOutput) -> None:
        self.last = out
        if self.first_token is None and any(o.token_ids for o in out.outputs):
            self.first_token = time.monotonic()

    def _record(self, out: RequestOutput) -> None:
        if self._recorded:
            return
        self._recorded = True
        n = sum(len(o.token_ids) for o in out.outputs)
        self.state.metrics.observe_request(len(self.prompt_ids), n, [o.finish_reason for o in out.outputs],
                                           self.arrival, self.first_token, time.monotonic())
