"""EngineCore: one replica's step, schedule -> execute -> finish -> update (vLLM v1 `EngineCore`).

`schedule` asks the drafter for tokens, lets the prefix tiers land what they read, and picks
the step's work; `execute` hands the prepared step to the executor (every rank runs it), has
the runner sample and verify, rolls an eager verify pass back, and brings the scheduler up to
date. The core knows nothing of requests as callers see them (engine/output_processor.py) nor of how
many processes run the model (executor/base.py). Built by engine/build.py `build_core`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from k3serve.cache.manager import HybridCacheManager
from k3serve.config.engine_config import EngineConfig
from k3serve.engine.stats import IterationTokens
from k3serve.executor import RANK_FAULTS, Executor, ModelInfo
from k3serve.runner.model_runner import ModelRunner
from k3serve.scheduler.batch import ScheduledBatch
from k3serve.outputs import StepOutput
from k3serve.scheduler.request import Request
from k3serve.scheduler.scheduler import Scheduler

log = logging.getLogger("k3serve.engine")


@dataclass
class Executed:
    """A step's result: its output, or the requests a failed step blames and why."""

    out: StepOutput | None
    culprits: list[Request] = field(default_factory=list)
    why: str = ""


@dataclass
class Pending:
    """A launched step whose result the later pipeline stages still owe (EngineCore.launch)."""

    batch: ScheduledBatch
    step: object  # runner/model_runner.py PreparedStep
    handle: object  # the executor's (Executor.collect)
    started: float


@dataclass
class EngineCore:
    config: EngineConfig
    model_path: str
    executor: Executor
    model_info: ModelInfo
    plan: object  # cache/sizing.py CachePlan
    max_model_len: int
    cache: HybridCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: object  # tokenizer/tokenizer.py Tokenizer
    unmapped_ids: list[int]  # vocabulary ids the tokenizer cannot decode: never sampled
    kv_dtype_name: str  # the latent cache's dtype, e.g. "bfloat16"
    startup_log: list[str]
    seq_limit_note: str | None  # why fewer requests than --max-num-seqs can run at once
    kernels: object = None  # the compiled CPU kernels module rank 0 runs, or None
    spec: object = None  # spec_decode SpecDecoder, or None
    tiers: object = None  # offload/store.py PrefixTiers, or None
    iteration_tokens: IterationTokens = field(default_factory=IterationTokens)  # vllm:iteration_tokens_total
    overlap: bool = True  # two steps in flight where the executor is pipelined (see `pipelined`)

    def schedule(self) -> ScheduledBatch | None:
        """The step's work, its prefix-tier loads issued; None when there is none (a
        DP-attention replica still runs its idle forward: the others' MoE layers wait for it)."""
        self._propose()
        if self.tiers is not None:
            self.tiers.poll()  # disk reads done, files written: before the schedule looks them up
        batch = self.scheduler.schedule()
        if self.tiers is not None:  # what the step loads outlives the write-back just below
            self.tiers.hold(batch.load_blocks, batch.load_states)
        self.write_back()  # what scheduling evicted, before any step reuses its rows
        if batch.is_empty:
            if self.executor.lockstep:
                self.executor.idle()
            if self.tiers is not None and self.tiers.busy:  # a request waits on its prefix's disk read
                self.tiers.wait(0.01)
            return None
        self.iteration_tokens.add(sum(s.num_tokens for s in batch.seqs))
        return batch

    @property
    def pipelined(self) -> bool:
        """Whether a second step starts while one is in flight: pipeline stages (the first stage
        on the next batch while the later ones finish this one), without DP-attention lockstep;
        `overlap` False turns it off (bench/pp_overlap.py's A/B). Speculation too: a verify
        pass's rollback may then follow the next step's forward (ranks keep each pass's records
        by its slots, runner/rank_step.py), and the requests in flight draft nothing."""
        return self.overlap and self.executor.pipelined and not self.executor.lockstep

    def execute(self, batch: ScheduledBatch) -> Executed:
        """Run the step on every rank and finish it. A step that raises is retried apart (the
        scheduler requeues its requests to run alone, Scheduler.retry_apart); a broken rank group
        raises: no request can run again."""
        started = self.launch(batch, in_flight=False)
        return started if isinstance(started, Executed) else self.complete(started)

    def launch(self, batch: ScheduledBatch, in_flight: bool = True) -> "Pending | Executed":
        """Start the step on every rank (EngineCore.execute's first half): its Pending, or the
        Executed of a step that failed to start. Its requests are in flight until `complete`."""
        try:
            t = time.perf_counter()
            if self.tiers is not None:  # part of the step: if it fails, no loaded block is published
                self.tiers.load(self.executor.cache, batch.load_blocks, batch.load_states)
            step = self.runner.prepare(batch)
            handle = self.executor.launch(step.inputs, step.taps)
        except RANK_FAULTS as e:
            self.executor.fail(str(e))
            raise
        except Exception as e:  # noqa: BLE001 - the step is retried apart; see Scheduler.retry_apart
            return self._failed(batch, e)
        if in_flight:  # another step may be scheduled before this one completes
            self.scheduler.in_flight.update(s.request_id for s in batch.seqs)
        return Pending(batch, step, handle, t)

    def complete(self, pending: Pending) -> Executed:
        """Finish a launched step: sample, verify and roll back, then bring the scheduler up to date."""
        batch = pending.batch
        if self.scheduler.in_flight:
            self.scheduler.in_flight.difference_update(s.request_id for s in batch.seqs)
        try:
            out, rollback = self.runner.finish(pending.step, self.executor.collect(pending.handle))
            if rollback is not None:
                self.executor.rollback(*rollback)
            # the draft-length policy's cost table, refreshed online; two steps in flight share
            # the time between launch and completion, which is then no step's own cost
            if self.spec is not None and not self.pipelined:
                self.spec.step_done(batch, time.perf_counter() - pending.started)
        except RANK_FAULTS as e:
            self.executor.fail(str(e))
            raise
        except Exception as e:  # noqa: BLE001 - the step is retried apart; see Scheduler.retry_apart
            return self._failed(batch, e)
        self.scheduler.update(batch, out)
        if self.tiers is not None:  # before the next step may reuse the rows just published
            self.tiers.store(self.executor.cache, *self.cache.drain_fresh())
        return Executed(out)

    def _failed(self, batch: ScheduledBatch, e: Exception) -> Executed:
        log.warning(
            "model step over %d requests raised %s: %s; retrying them apart",
            len(batch.seqs),
            type(e).__name__,
            e,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        why = f"the model step failed for this request ({type(e).__name__})"
        return Executed(None, self.scheduler.retry_apart(batch), why)

    def _propose(self) -> None:
        """Drafts first: the scheduler budgets 1 + k tokens for them. Drafting is an optimisation:
        if it raises, this step runs without drafts."""
        if self.spec is None:
            return
        running = self.scheduler.ready()  # those in flight have no sampled token yet: the next step
        try:
            self.runner.propose(running)
        except Exception as e:  # noqa: BLE001
            log.warning("drafting raised %s: %s; this step runs without drafts", type(e).__name__, e)
            for r in running:
                r.spec_token_ids = []

    def write_back(self) -> None:
        """Write-back tiers: copy the blocks and checkpoints the pools just evicted down to host
        memory while their rows still hold them (stream order on a GPU: before the step that
        reuses them; the host never waits)."""
        if self.tiers is not None and self.cache.write_back:
            self.tiers.store(self.executor.cache, *self.cache.drain_evicted())

    def release(self, req: Request) -> None:
        """What a finished or aborted request held in the runner (generator, grammar, media,
        drafts); the scheduler freed its cache."""
        self.runner.release(req.request_id)

    def shutdown(self) -> None:
        """Stop the ranks; the core cannot step after. Write-back tiers first take what the
        pools still hold, so a restart finds it."""
        if self.tiers is not None and self.cache.write_back:
            self.tiers.store(self.executor.cache, *self.cache.resident())
        self.executor.shutdown()
        if self.tiers is not None:
            self.tiers.close()  # queued writes reach the directory: a restart finds them
