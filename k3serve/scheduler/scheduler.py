"""Continuous-batching scheduler over the hybrid cache (pure Python).

Each step gets a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):
  1. running decodes first (one token each), then running prefills continue their chunks,
  2. waiting requests are admitted in policy order while both pools can serve their first chunk,
  3. when latent blocks run out, the lowest-ranked running request is preempted by recompute
     (blocks and slot freed, progress reset, sent to the front of the queue).
Prefill chunks end on multiples of the KDA chunk size (64) unless the chunk is the last one:
the chunked gated-delta kernel then sees the same chunk grid as a one-shot prefill, so chunked
and unchunked prefill take the same arithmetic path (serving-notes.md §9 item 3).
References: vLLM v1 `core/sched/scheduler.py`, nano-vllm `engine/scheduler.py`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from k3serve.cache.manager import CacheAllocation, HybridCacheManager, PrefixHit
from k3serve.scheduler.batch import ScheduledBatch, ScheduledSeq
from k3serve.outputs import StepOutput
from k3serve.scheduler.request import Request, RequestStatus

KDA_CHUNK = 64  # k3serve.layers.kda_ops.CHUNK (kept here so this module stays torch-free)
QUARANTINE_STEPS = 2  # sampling steps alone (recompute prefill + one decode) before rejoining


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: str = "fcfs"  # "fcfs" | "priority"
    chunk_align: int = KDA_CHUNK
    checkpoint_interval: int = 0  # prefix caching: also save KDA state every N prompt tokens

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "chunk_align"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0, got {self.checkpoint_interval}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: HybridCacheManager):
        self.config, self.cache = config, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the tail is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # requests of a batch whose model step raised: each must run alone for QUARANTINE_STEPS
        # sampling steps before it batches again; one that fails alone is the culprit
        self.quarantine: dict[str, int] = {}
        # requests of a step still in flight (pipeline stages keep two): not scheduled again,
        # nor preempted, until that step's update
        self.in_flight: set[str] = set()
        self.split = 1  # steps in flight at once: each takes at most 1/split of the running requests

    # ---- requests in and out ---------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        need, have = self.cache.blocks_for(req.max_total_tokens), self.cache.num_blocks
        if need > have:  # could never run: it would preempt itself forever
            raise ValueError(
                f"request {req.request_id!r} may reach {req.max_total_tokens} tokens = {need} "
                f"latent blocks, but the whole cache has {have}"
            )
        self.requests[req.request_id] = req
        self._enqueue(req, front=False)

    def adopt(self, req: Request, held: tuple[int, ...] = ()) -> CacheAllocation:
        """A request prefilled by another engine (a prefill/decode hand-off): admitted running
        with its prompt computed and its first token sampled, `held` cached blocks of its prefix
        shared; the caller writes the other rows and the KDA state into the allocation."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if len(self.running) >= self.config.max_num_seqs:
            raise ValueError(f"the decode engine runs max_num_seqs = {self.config.max_num_seqs} requests already")
        n = len(req.prompt_token_ids)
        hit = PrefixHit(len(held) * self.cache.block_size, tuple(held))
        if not self.cache.can_admit(req.num_tokens, hit):
            raise ValueError(f"the decode engine has no room for request {req.request_id!r} ({req.num_tokens} tokens)")
        alloc = self.cache.allocate(req.request_id, req.num_tokens, hit)
        req.num_computed_tokens, req.num_cached_tokens, req.status = n, hit.num_tokens, RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self.running.append(req)
        self.cache.register_computed(req.request_id, req.cache_token_ids, n)
        return alloc

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request now (stop string, abort, stop token) and free its cache."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            if not req.keep_cache:  # else the engine frees it once the hand-off rows are copied
                self.cache.free(req.request_id)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.quarantine.pop(req.request_id, None)
        req.finish_reason = req.finish_reason or reason
        req.stop_reason = req.stop_reason if stop_reason is None else stop_reason
        self.requests.pop(req.request_id, None)

    def stop_at(self, req: Request, keep: int, stop_reason: str) -> None:
        """The output processor found a stop string ending at output token `keep`: the output
        keeps those tokens (later ones, drafts accepted past it, are dropped) and the request
        ends with finish reason "stop", also when it had just ended otherwise (length)."""
        del req.output_token_ids[keep:]
        if req.finished:
            req.finish_reason, req.stop_reason = "stop", stop_reason
        else:
            self.finish(req, "stop", stop_reason)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------
    def ready(self) -> list[Request]:
        """The running requests not in a step in flight (pipeline stages' second step)."""
        return [r for r in self.running if r.request_id not in self.in_flight] if self.in_flight else self.running

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.quarantine and self._schedule_alone(batch):
            return batch
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        ready = self.ready()
        decodes = [r for r in ready if r.num_uncomputed == 1]
        prefills = [r for r in ready if r.num_uncomputed > 1]
        # with steps in flight, a share of the running requests each, so the next step has some
        cap = -(-len(self.running) // self.split) if self.split > 1 else len(self.running)
        for req in decodes + prefills:
            if budget == 0 or len(batch.seqs) >= cap:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in self.quarantine:
                continue  # preempted earlier in this step, or must run alone
            n = self._chunk(req, budget)
            if n and self._reserve(req, n, scheduled, batch):
                batch.seqs.append(self._seq(req, n, batch))
                scheduled.add(req.request_id)
                budget -= n
        if not batch.preempted:  # no admissions in a step that had to preempt
            budget = self._admit(batch, budget)
        # verifying sequences first (stable): the one-position-at-a-time rows (forward/batch.py
        # StepRows) are then the batch's own order, so a verify step where some requests have no
        # draft still runs as one decode-stack call instead of layer by layer
        batch.seqs.sort(key=lambda s: not s.drafts)
        return batch

    def update(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        """Advance progress by what ran and append sampled tokens; the requests that finished."""
        finished = []
        for seq in batch.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if req.request_id in out.failed:  # its sampling failed: it ends alone, the batch goes on
                self.finish(req, "error")
                finished.append(req)
                continue
            if req.request_id in out.accepted:  # its accepted position's slot is its state now
                self.cache.accept_draft(req.request_id, out.accepted[req.request_id])
            toks = out.sampled.get(req.request_id, []) if seq.sample else []
            # with drafts only the committed inputs count: the newest token + accepted drafts
            req.num_computed_tokens = seq.start + (len(toks) if seq.drafts else seq.num_tokens)
            req.spec_token_ids = []
            done = any(req.append_token(t.token_id) for t in toks)  # stops at the first ending token
            # accepted drafts are inputs now in the cache: publish blocks once their ids are known
            computed = min(req.num_computed_tokens, req.num_tokens)
            if self.cache.completes_block(req.request_id, computed):  # cache_token_ids copies the request
                self.cache.register_computed(req.request_id, req.cache_token_ids, computed)
            if done:
                self.finish(req, req.finish_reason)
                finished.append(req)
        self.cache.end_step(batch.pinned)
        for seq in batch.seqs:  # a quarantined request that sampled alone is one step closer to release
            rid = seq.request_id
            if seq.sample and rid in self.quarantine:
                self.quarantine[rid] -= 1
                if self.quarantine[rid] <= 0:
                    del self.quarantine[rid]
        return finished

    def retry_apart(self, batch: ScheduledBatch) -> list[Request]:
        """The model step over `batch` raised: undo it and quarantine its requests.

        Preemption by recompute rebuilds every request's cache from its tokens, so whatever the
        failed step half-wrote is never read, and greedy outputs stay those of an undisturbed
        run (the invariance the preemption tests pin). Each request then runs alone until it has
        sampled QUARANTINE_STEPS times; a step that fails with one request in it names the culprit.
        """
        self.cache.abandon_step(batch.pinned)
        if len(batch.seqs) == 1:  # alone in the step: it is the cause
            req = batch.seqs[0].request
            if not req.finished:
                self.finish(req, "error")
            return [req]
        for seq in batch.seqs:
            req = seq.request
            req.spec_token_ids = []
            if req.status is RequestStatus.RUNNING:
                self._preempt(req, batch)
            self.quarantine[req.request_id] = QUARANTINE_STEPS
        return []

    def _schedule_alone(self, batch: ScheduledBatch) -> bool:
        """One quarantined request as the whole batch; False if it cannot start this step."""
        budget = self.config.max_num_batched_tokens
        running = [r for r in self.running if r.request_id in self.quarantine]
        if running:
            req = running[0]
            n = self._chunk(req, budget)
            if n and self._reserve(req, n, set(), batch):  # it may preempt others, even itself
                batch.seqs.append(self._seq(req, n, batch))
            return True
        req = next((r for r in self.waiting if r.request_id in self.quarantine), None)
        return req is not None and self._admit_one(req, batch, budget) is not None

    # ---- helpers ---------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        remaining = req.num_uncomputed
        if remaining == 1 and req.spec_token_ids:  # decode with drafts: newest token + drafts
            return 1 + min(len(req.spec_token_ids), req.max_drafts, budget - 1)
        n = min(remaining, budget)
        if n < remaining:  # not the last chunk: end on the KDA chunk grid when possible
            start, align = req.num_computed_tokens, self.config.chunk_align
            aligned = (start + n) // align * align - start
            n = aligned if aligned > 0 else n
        ahead = [p for p in req.checkpoint_at if p > req.num_computed_tokens]
        if ahead:  # a prefix-cache save point must be a chunk end
            n = min(n, min(ahead) - req.num_computed_tokens)
        return n

    def _seq(self, req: Request, n: int, batch: ScheduledBatch) -> ScheduledSeq:
        rid, end = req.request_id, req.num_computed_tokens + n
        slot = self.cache.state_slot(rid)
        if end in req.checkpoint_at:  # the state after this chunk is a prefix checkpoint
            req.checkpoint_at.remove(end)
            ckpt = self.cache.begin_checkpoint(self.cache.checkpoint_key(rid, req.cache_token_ids, end))
            if ckpt is not None:
                batch.save_states.append((slot, ckpt))
        drafts = req.spec_token_ids[: n - 1] if req.num_uncomputed == 1 else []
        row = self.cache.draft_row(rid) if drafts else None
        return ScheduledSeq(
            req, req.num_computed_tokens, n, slot, self.cache.block_table(rid), end >= req.num_tokens, drafts, row
        )

    def _reserve(self, req: Request, n: int, scheduled: set[str], batch: ScheduledBatch) -> bool:
        """Blocks for `n` more tokens of a running request, preempting others if needed."""
        need = req.num_computed_tokens + n
        while self.cache.append(req.request_id, need) is None:
            victim = self._victim(exclude=scheduled)
            self._preempt(victim, batch)
            if victim is req:
                return False
        return True

    def _victim(self, exclude: set[str]) -> Request:
        candidates = [r for r in self.running if r.request_id not in exclude and r.request_id not in self.in_flight]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival))
        return candidates[-1]

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.cache.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(req.request_id)
        self._enqueue(req, front=True)

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.waiting[0].request_id in self.quarantine:
                break  # it starts alone (see _schedule_alone)
            left = self._admit_one(self.waiting[0], batch, budget)
            if left is None:
                break  # head-of-line waits: keeps FCFS order and avoids starving long prompts
            budget = left
        return budget

    def _admit_one(self, req: Request, batch: ScheduledBatch, budget: int) -> int | None:
        """Start a waiting request with its first chunk; the budget left, or None if it does not fit."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        # prompt logprobs need every prompt position computed: no prefix-cache hit for them (vLLM too)
        hit = self.cache.lookup(req.cache_token_ids) if req.params.prompt_logprobs is None else PrefixHit()
        if hit.pending:  # its longer prefix is being read from disk (k3serve/offload): next step
            return None
        req.num_computed_tokens = hit.num_tokens
        req.checkpoint_at = self.cache.save_points(len(req.prompt_token_ids), hit, self.config.checkpoint_interval)
        n = self._chunk(req, budget)
        if not self.cache.can_admit(hit.num_tokens + n, hit):
            req.num_computed_tokens, req.checkpoint_at = 0, []
            return None
        self.waiting.remove(req)
        alloc = self.cache.allocate(req.request_id, hit.num_tokens + n, hit)
        if alloc.restore_from is not None:
            batch.restore_states.append((alloc.restore_from, alloc.state_slot))
            batch.pinned.append(hit.checkpoint)
        batch.load_blocks.extend(alloc.loads)
        if alloc.load_state is not None:
            batch.load_states.append((alloc.load_state, alloc.state_slot))
        self.cache.record_query(len(req.prompt_token_ids), min(hit.num_tokens, len(req.prompt_token_ids)))
        req.num_cached_tokens = hit.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        batch.seqs.append(self._seq(req, n, batch))
        return budget - n

    def _enqueue(self, req: Request, front: bool) -> None:
        req.status = RequestStatus.WAITING
        if self.config.policy == "priority":
            self.waiting.append(req)
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival)))
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
