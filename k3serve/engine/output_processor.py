"""OutputProcessor: the sampled tokens of each step -> RequestOutputs (vLLM v1's
`OutputProcessor`).

It owns the requests as the caller sees them (engine/groups.py: an n > 1 request is a group of
n scheduler requests), their detokenizers, logprobs, stop strings and timing metrics, and the
engine's token counters. What a finished request held in the cache and the runner the engine
frees after each call (`drain`), not here.
"""

from __future__ import annotations

import logging
import time
from k3serve.engine.groups import Group
from k3serve.outputs import CompletionOutput, RequestOutput
from k3serve.scheduler.batch import ScheduledBatch
from k3serve.outputs import SampledToken, StepOutput
from k3serve.scheduler.request import Request
from k3serve.scheduler.scheduler import Scheduler

log = logging.getLogger("k3serve.engine")


class OutputProcessor:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._released: list[tuple[Request, Group]] = []  # ended since the last drain, with their groups
        self.groups: dict[str, Group] = {}  # caller's request id -> its group
        self.owner: dict[str, Group] = {}  # scheduler request id -> its group
        self._seen: dict[str, int] = {}  # output tokens already detokenized, per scheduler request
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}

    def add(self, group: Group) -> None:
        """A new request: its samples' scheduler requests are added by the caller."""
        self.groups[group.request_id] = group
        for s in group.samples:
            self.owner[s.req.request_id] = group
        self.counters["prompt_tokens"] += len(group.prompt_token_ids)

    def scheduled(self, batch: ScheduledBatch) -> None:
        """Queue time ends when a request is first scheduled."""
        now = time.monotonic()
        for seq in batch.seqs:
            group = self.owner.get(seq.request_id)
            if group is not None:
                group.metrics.setdefault("scheduled_time", now)

    def process(self, batch: ScheduledBatch, out: StepOutput) -> list[RequestOutput]:
        """The outputs of the requests that produced tokens or failed in this step."""
        failed: dict[str, RequestOutput] = {}
        touched: dict[str, Group] = {}
        for seq in batch.seqs:
            group = self.owner.get(seq.request_id)
            if group is None:
                continue
            if seq.request_id in out.prompt_logprobs and group.prompt_logprobs is not None:
                group.prompt_logprobs.update(out.prompt_logprobs[seq.request_id])  # recompute overwrites
            toks = out.sampled.get(seq.request_id, [])
            why = out.failed.get(seq.request_id) or self._emit(group, seq.request, toks)
            if why:
                failed[group.request_id] = self.fail(group, why)
                touched.pop(group.request_id, None)
            elif toks:
                touched[group.request_id] = group
        return list(failed.values()) + [self.output(g) for g in touched.values()]

    def failed_requests(self, reqs: list[Request], why: str) -> list[RequestOutput]:
        """End the groups of requests a failed step blamed."""
        return [self.fail(self.owner[r.request_id], why) for r in reqs if r.request_id in self.owner]

    def _emit(self, group: Group, req: Request, toks: list[SampledToken]) -> str | None:
        """Hand one sequence's tokens of this step to its group; why that failed, or None."""
        try:
            for tok in toks:  # stop after the tokens the scheduler appended (a stop cuts the rest)
                if self._seen.get(req.request_id, 0) >= len(req.output_token_ids):
                    break
                self.on_token(group, req, tok)
        except Exception as e:  # noqa: BLE001 - e.g. a token the tokenizer cannot decode
            log.warning("output processing failed for request %s: %s", group.request_id, e)
            return f"output processing failed for this request ({type(e).__name__})"
        return None

    def on_token(self, group: Group, req: Request, tok: SampledToken) -> None:
        """One emitted token (several per step with speculation): logprobs, detokenize, stop strings."""
        sample = next(s for s in group.samples if s.req is req)
        seen = self._seen[req.request_id] = self._seen.get(req.request_id, 0) + 1
        self.counters["generation_tokens"] += 1
        group.metrics.setdefault("first_token_time", time.monotonic())
        stop = sample.take(tok, seen)
        if stop is not None:  # the output ends here: drafts accepted after the stop string are dropped
            self.scheduler.stop_at(req, seen, stop)
        if req.finished and seen == len(req.output_token_ids):
            sample.detok.flush()
            self.release(req)
            if group.finished:
                group.metrics["finish_time"] = time.monotonic()
                self.counters["requests_finished"] += 1
                self.groups.pop(group.request_id, None)

    def fail(self, group: Group, why: str) -> RequestOutput:
        """End every sample of `group` with finish reason "error"; its final output."""
        group.error = why
        for s in group.samples:
            if not s.req.finished:
                self.scheduler.finish(s.req, "error")
            self.release(s.req)
        self.groups.pop(group.request_id, None)
        group.metrics["finish_time"] = time.monotonic()
        return self.output(group)

    def abort(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.samples:
            if not s.req.finished:
                self.scheduler.abort(s.req.request_id)
            self.release(s.req)
        return True

    def release(self, req: Request) -> None:
        self._released.append((req, self.owner.pop(req.request_id, None)))
        self._seen.pop(req.request_id, None)

    def drain(self) -> list[tuple[Request, Group]]:
        """The requests that ended (finished, failed, aborted) since the last call, for the
        engine to free what they held."""
        out, self._released = self._released, []
        return out

    @staticmethod
    def output(group: Group) -> RequestOutput:
        outs = []
        for i, s in enumerate(group.samples):
            done = s.req.finished
            outs.append(
                CompletionOutput(
                    i,
                    s.detok.visible_text(done),
                    list(s.req.output_token_ids),
                    s.cumulative_logprob if s.logprobs is not None else None,
                    [dict(d) for d in s.logprobs] if s.logprobs is not None else None,
                    s.req.finish_reason if done else None,
                    s.req.stop_reason if done else None,
                )
            )
        plp = None
        if group.prompt_logprobs is not None:
            plp = [None] + [group.prompt_logprobs.get(i) for i in range(1, len(group.prompt_token_ids))]
        metrics = dict(group.metrics)
        drafted = sum(s.req.spec_draft_tokens for s in group.samples)
        if drafted:  # speculation: drafts verified for this request and accepted (every sample)
            metrics["spec_draft_tokens"] = drafted
            metrics["spec_accepted_tokens"] = sum(s.req.spec_accepted_tokens for s in group.samples)
        return RequestOutput(
            group.request_id,
            group.prompt,
            list(group.prompt_token_ids),
            outs,
            group.finished,
            metrics,
            group.samples[0].req.num_cached_tokens,
            group.error,
            plp,
        )
