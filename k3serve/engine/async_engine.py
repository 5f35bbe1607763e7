"""AsyncEngine: asyncio front of LLMEngine for the server (reference: vLLM `AsyncLLM`).

- One worker thread owns the LLMEngine; every engine call (add, step, abort) runs there, so
  the model never runs concurrently with bookkeeping and the event loop never blocks on it.
- Each request gets a stream that keeps only the newest *cumulative* RequestOutput: a slow
  consumer skips intermediate snapshots but loses no tokens (backpressure without buffers).
- Leaving the stream early (client disconnect, task cancellation, `break`) aborts the request
  and frees its cache before the next step.
- Admission backpressure: beyond `max_waiting` queued requests, `generate` raises
  EngineOverloaded (the server answers 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from k3serve.engine.llm_engine import LLMEngine, PromptInput
from k3serve.outputs import RequestOutput
from k3serve.engine.stats import EngineStats, snapshot
from k3serve.sampling_params import SamplingParams
from k3serve.outputs import ModelFault

log = logging.getLogger("k3serve.engine")


class EngineOverloaded(RuntimeError):
    pass


class EngineUnavailable(RuntimeError):
    """The engine cannot run any request (a tensor-parallel worker died): the server answers 503."""


class RequestFailed(RuntimeError):
    """This request failed alone (its sampling, output processing or model step raised); the
    message is the engine's own sentence, safe to show to the client. `model_fault`: the
    model's doing (non-finite logits), not the request's."""

    def __init__(self, message: str):
        super().__init__(message)
        self.model_fault = isinstance(message, ModelFault)


class _Stream:
    """Latest-value mailbox: put() replaces, get() waits for a value not yet taken."""

    def __init__(self):
        self._value: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._value = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        item, self._value = self._value, None
        if isinstance(item, BaseException):
            raise item
        return item


async def cancel(task: asyncio.Task | None) -> None:
    """Cancel a step loop and wait until it has stopped."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 4096):
        self.engine, self.max_waiting = engine, max_waiting
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="k3serve-engine")
        self._streams: dict[str, _Stream] = {}
        self._to_abort: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._adding = 0  # samples accepted but not yet in the scheduler's queue
        self.stats: EngineStats = snapshot(engine)  # refreshed on the engine thread after every call
        self._busy_since: float | None = None  # when the engine-thread call now running began
        self._died: BaseException | None = None
        self.lockstep = None  # engine/lockstep.py: DP-attention replicas step together, from its loop

    @property
    def num_waiting(self) -> int:
        """Queued samples, counting those still on their way to the scheduler."""
        return len(self.engine.scheduler.waiting) + self._adding

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs) -> "AsyncEngine":
        return cls(LLMEngine.from_args(model, **kwargs))

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        keep_cache: bool = False,
        handoff=None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request until it finishes. `keep_cache`: a prefill
        whose state a decode engine pulls afterwards (`pull_handoff`); `handoff`: a KVHandoff
        pulled from a prefill engine, decoded from its first token on (`add_prefilled`)."""
        self._ensure_loop()
        rid = request_id or f"req-{next(self._ids)}"
        n = params.n if params is not None else 1
        # check and reserve in one event-loop turn: a burst cannot all pass the check before
        # the first of them reaches the scheduler's queue
        if self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(f"{self.max_waiting} requests are already waiting; retry later")
        workers = self.engine.executor
        if workers is not None and not workers.alive:
            raise EngineUnavailable(f"the engine cannot serve: {workers.error}")
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream = self._streams[rid] = _Stream()
        self._adding += n
        try:
            if handoff is not None:
                done = await self._call(self.engine.add_prefilled, dataclasses.replace(handoff, request_id=rid), params)
                if done is not None:  # the first token ended it: no step will report it
                    stream.put(done)
            else:
                await self._call(self.engine.add_request, rid, prompt, params, priority, keep_cache)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        finally:
            self._adding -= n
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:  # consumer left early: free the request before the next step
                self._to_abort.add(rid)
                self._wakeup.set()

    async def pull_handoff(self, request_id: str, held_tokens: int = 0):
        """A finished `keep_cache` prefill's latent rows (beyond `held_tokens`) and KDA state."""
        return await self._call(self.engine.pull_handoff, request_id, held_tokens)

    async def held_tokens(self, prompt_token_ids: list[int]) -> int:
        return await self._call(self.engine.held_tokens, prompt_token_ids)

    def info(self):
        return self.engine.info()

    async def reusable_tokens(self, prompt_token_ids: list[int]) -> int:
        return await self._call(self.engine.reusable_tokens, prompt_token_ids)

    async def release_handoff(self, request_id: str) -> bool:
        return await self._call(self.engine.release_handoff, request_id)

    async def cache_ids(self, prompt) -> list[int]:
        return await self._call(self.engine.cache_ids, prompt)

    @property
    def counters(self) -> dict[str, int]:
        return self.engine.counters

    async def reset_prefix_cache(self) -> tuple[int, int]:
        return await self._call(self.engine.reset_prefix_cache)

    async def abort(self, request_id: str) -> None:
        self._to_abort.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def shutdown(self) -> None:
        await cancel(self._task)
        self._executor.shutdown(wait=True)
        self.engine.shutdown()

    # ---- the step loop -------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self.lockstep is not None:  # one loop steps every replica
            self.lockstep.ensure_loop()
            return
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="k3serve-engine-loop")

    async def call(self, fn, *args):
        """Run `fn(*args)` on the engine thread, between steps."""
        return await self._call(fn, *args)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn, args)

    def _timed(self, fn, args):
        """On the engine thread: run `fn`, then take the stats snapshot metrics read."""
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.stats = snapshot(self.engine)
            self._busy_since = None

    def health(self, wedged_after_s: float = 120.0) -> str | None:
        """None while the engine serves; else why not (its loop died, or one call has run for
        longer than `wedged_after_s`)."""
        if self._died is not None:
            return f"the engine loop stopped ({type(self._died).__name__})"
        workers = self.engine.executor
        if workers is not None and not workers.alive:
            return workers.error
        began = self._busy_since
        if began is not None and time.monotonic() - began > wedged_after_s:
            return f"an engine step has been running for {time.monotonic() - began:.0f} s"
        return None

    # ---- what a loop driving this engine calls (its own `_run`, or engine/lockstep.py's) ------
    def has_work(self) -> bool:
        """Requests to step, or aborts to apply."""
        return self.engine.has_unfinished_requests() or bool(self._to_abort)

    def share_wakeup(self, event: asyncio.Event) -> None:
        """Wake `event` (a loop stepping several engines) on this engine's requests and aborts."""
        self._wakeup = event

    async def step_once(self, always: bool = False) -> None:
        """One step on the engine thread: pending aborts applied, outputs delivered to their
        streams; a step that raises fails the running requests and the engine goes on.
        `always`: step with nothing to run (a DP-attention replica's idle forward)."""
        aborts, self._to_abort = self._to_abort, set()
        try:
            outs = await self._call(self._step, aborts, always)
        except Exception as e:  # a bug in a step must not take the server down
            await self._step_failed(e)
            return
        self._deliver(outs)

    def stopped(self, e: BaseException) -> None:
        """The driving loop ended (cancelled at shutdown, or a fault outside any step): not serving."""
        self._died = e
        self._fail_streams(list(self._streams), RuntimeError("the engine stopped"))

    async def _run(self) -> None:
        try:
            while True:
                if not self.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                await self.step_once()
        except BaseException as e:
            self.stopped(e)
            raise

    async def _step_failed(self, e: Exception) -> None:
        log.error("engine step failed; failing the running requests", exc_info=e)
        await self._fail_all(e)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(RequestFailed(out.error) if out.error else out)

    def _step(self, aborts: set[str], always: bool = False) -> list[RequestOutput]:
        """`always`: step even with nothing to run (a DP-attention replica's idle forward)."""
        for rid in aborts:
            self.engine.abort(rid)
        return self.engine.step() if always or self.engine.has_unfinished_requests() else []

    async def _fail_all(self, error: Exception) -> None:
        rids = list(self._streams)
        await self._call(lambda: [self.engine.abort(r) for r in rids])
        workers = self.engine.executor
        if workers is not None and not workers.alive:  # a dead worker: nothing can run again
            self._fail_streams(rids, EngineUnavailable(f"the engine cannot serve: {workers.error}"))
        else:
            self._fail_streams(rids, RuntimeError(f"engine step failed: {error}"))

    def _fail_streams(self, rids: list[str], error: BaseException) -> None:
        for rid in rids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)
