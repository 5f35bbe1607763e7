"""LLMEngine: add_request / step / abort over one replica's engine core (vLLM `LLMEngine` shape).

One step = the core's schedule (pure Python) -> execute on every rank (executor/base.py) ->
finish (sampling, verification) -> scheduler update (engine/core.py), then the output
processor's detokenizing and stop strings -> RequestOutputs for requests that produced tokens
or finished (engine/output_processor.py). An n > 1 request fans out into n scheduler requests with seeds
offset by sample index (vLLM v1 does the same); prefix caching lets them share the prompt's
cache. This class checks and tokenizes what callers add; taking and handing over prefilled
requests (prefill/decode disaggregation) is engine/disagg.py, a mixin of it.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from k3serve.cache.sizing import parse_bytes
from k3serve.config.engine_config import EngineConfig
from k3serve.engine.build import build_core
from k3serve.engine.core import Executed
from k3serve.engine.disagg import HandoffMixin
from k3serve.engine.groups import Group, PromptInput, Sample  # noqa: F401 - PromptInput is re-exported
from k3serve.engine.handoff import HandoffStore
from k3serve.engine.info import EngineInfo
from k3serve.multimodal.prompt_media import MediaEncoder
from k3serve.engine.output_processor import OutputProcessor
from k3serve.outputs import RequestOutput
from k3serve.executor import Executor
from k3serve.tokenizer.detokenizer import IncrementalDetokenizer
from k3serve.sampling_params import ParamError, SamplingParams
from k3serve.scheduler.request import Request

log = logging.getLogger("k3serve.engine")


class LLMEngine(HandoffMixin):
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        """`executor`: the replica's ranks when the caller built them (a DP-attention replica's,
        distributed/dp_replicas.py); None: the engine starts its own for `config`."""
        self.config = config
        core = self.core = build_core(config, executor)
        # the core's parts, as callers (server, stats, tests) read them
        self.executor, self.model_info, self.model_path = core.executor, core.model_info, core.model_path
        self.scheduler, self.cache, self.runner, self.plan = core.scheduler, core.cache, core.runner, core.plan
        self.spec, self.tiers, self.tokenizer, self.kernels = core.spec, core.tiers, core.tokenizer, core.kernels
        self.max_model_len, self.startup_log, self.seq_limit_note = (
            core.max_model_len,
            core.startup_log,
            core.seq_limit_note,
        )
        self.unmapped_ids, self.unmapped = core.unmapped_ids, frozenset(core.unmapped_ids)
        self.kv_dtype_name, self.iteration_tokens = core.kv_dtype_name, core.iteration_tokens
        try:
            self.media = MediaEncoder(
                self.model_path,
                self.model_info.cfg,
                self.model_info.dtype,
                core.runner.device,
                parse_bytes(config.mm_encoder_cache),
            )
        except BaseException:
            core.shutdown()
            raise
        if self.model_info.cfg.vision is not None:
            line = (
                f"vision encoder cache: {self.media.cache_bytes:,} B beside the cache budget "
                f"(tower rows by image / video-chunk digest)"
            )
            self.startup_log.append(line)
            log.info(line)
        self.outputs = OutputProcessor(self.scheduler)
        self._arrivals = itertools.count()
        self.handoffs = HandoffStore()  # prefilled requests kept for a decode engine (engine/handoff.py)
        self._in_flight = None  # pipeline stages: the launched step whose result is owed (core.Pending)

    @property
    def ep(self):
        """A DP-attention replica's rank in the expert group (executor/base.py), else None."""
        return self.executor.ep

    @property
    def model(self):
        """The model object when it lives in this process (rank 0's share under TP), else None."""
        return self.executor.model

    @property
    def counters(self) -> dict[str, int]:
        return self.outputs.counters

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        priority: int = 0,
        keep_cache: bool = False,
    ) -> None:
        """`keep_cache`: a prefill for another engine to decode (engine/handoff.py): when it
        finishes, its latent rows and KDA state wait in `handoffs` for `pull_handoff`."""
        params = params or SamplingParams()
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if keep_cache and params.n != 1:
            raise ParamError("n", "a prefill handed to a decode engine is one sequence (n = 1)")
        if keep_cache:
            self._check_handoff()
        params.check_vocab(self.model_info.cfg.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.config.max_logprobs:
                raise ParamError(name, f"{name} must be in [0, {self.config.max_logprobs}] (max_logprobs), got {n}")
        mm = (prompt.get("multi_modal_data") or {}) if isinstance(prompt, dict) else {}
        images, videos = list(mm.get("image", [])), list(mm.get("video", []))
        text, ids = self._tokenize(prompt)
        media = (
            self.media.prepare(ids, images, videos, self.tokenizer)
            if images or videos or self.media.needs_images(ids)
            else None
        )
        constraints = (
            [self.runner.constraint(params.structured, self.tokenizer) for _ in range(params.n)]
            if params.structured
            else None
        )
        group = Group(
            request_id,
            text,
            ids,
            [],
            {"arrival_time": time.monotonic()},
            prompt_logprobs={} if params.prompt_logprobs is not None else None,
        )
        for i in range(params.n):
            p = params.for_sample(i) if params.n > 1 else params
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(
                rid,
                list(ids),
                p,
                self.model_info.cfg.eos_token_id,
                self.max_model_len,
                arrival=next(self._arrivals),
                priority=priority,
                keep_cache=keep_cache,
            )
            group.samples.append(
                Sample(req, IncrementalDetokenizer(self.tokenizer, p), [] if p.logprobs is not None else None)
            )
            if constraints:
                self.runner.constraints[rid] = constraints[i]
            if media is not None:
                req.prompt_cache_ids = media.hash_ids
                self.runner.media[rid] = media
            self.scheduler.add(req)
        self.outputs.add(group)

    def shutdown(self) -> None:
        """Stop the ranks (nothing to stop for one process); the engine cannot step after. A step
        still in flight is received first: its last stage is sending the driver its logits."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None and self.executor.alive:
            try:
                self.core.complete(pending)
            except Exception as e:  # noqa: BLE001 - shutting down: the ranks stop either way
                log.warning("the step in flight at shutdown raised %s: %s", type(e).__name__, e)
        self.core.shutdown()

    def abort(self, request_id: str) -> bool:
        found = self.outputs.abort(request_id)
        self._free()
        return found

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Drop cached-free latent blocks and unpinned KDA checkpoints: (blocks, checkpoints); the
        host-memory tier empties too (the directory tier persists: delete it to clear it)."""
        if self.tiers is not None:
            self.tiers.clear_host()
        return self.cache.flush()

    def info(self) -> EngineInfo:
        """What a server reads of this engine (engine/info.py)."""
        cfg = self.model_info.cfg
        return EngineInfo(
            self.model_path,
            cfg.model_type,
            self.tokenizer,
            self.max_model_len,
            cfg.vocab_size,
            cfg.eos_token_id,
            self.unmapped,
            self.plan.num_slots,
            self.seq_limit_note,
            self.cache.block_size,
            self.plan.slot_bytes,
            cfg.vision,
            self.spec is not None,
            self.handoffs,
            hub_source(self.config.model),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups) or self._in_flight is not None

    def write_back(self) -> None:
        self.core.write_back()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A request whose sampling, detokenizing or model step fails ends alone
        with `error` set; the other requests of the step go on with unchanged outputs."""
        overlapped = self.core.pipelined
        self.scheduler.split = 2 if overlapped else 1
        if overlapped:
            return self._overlapped_step()
        batch = self.core.schedule()
        if batch is None:
            return []
        self.outputs.scheduled(batch)
        outs = self._outputs(batch, self.core.execute(batch))
        self._free()
        return outs

    def _overlapped_step(self) -> list[RequestOutput]:
        """Pipeline stages: launch the next batch (the requests not in flight) before completing
        the one in flight, so the first stage works on it while the later stages finish the
        other (vLLM's pipeline parallelism with two batches in flight). Each stage runs its
        steps in the order launched, so a cache row or state slot freed by one step and given to
        the next is written in that order on every stage. A quarantined request (a failed step's,
        run alone) waits for the pipeline to drain first."""
        outs: list[RequestOutput] = []
        pending, self._in_flight = self._in_flight, None
        batch = None if pending is not None and self.core.scheduler.quarantine else self.core.schedule()
        if batch is not None:
            self.outputs.scheduled(batch)
            started = self.core.launch(batch)
            if isinstance(started, Executed):  # it failed to start
                outs += self._outputs(batch, started)
            else:
                self._in_flight = started
        if pending is not None:
            outs += self._outputs(pending.batch, self.core.complete(pending))
        self._free()
        return outs

    def _outputs(self, batch, done: Executed) -> list[RequestOutput]:
        if done.out is None:
            return self.outputs.failed_requests(done.culprits, done.why)
        return self.outputs.process(batch, done.out)

    def _free(self) -> None:
        """What the requests that just ended held: a prefill kept for a decode engine is copied
        out of the cache first (engine/handoff.py), then the cache and the runner let it go."""
        for req, group in self.outputs.drain():
            if req.keep_cache and self.cache.holds(req.request_id):
                if req.finish_reason in ("stop", "length") and req.output_token_ids:
                    self.handoffs.put(self._capture(req, group))
                self.cache.free(req.request_id)
            self.core.release(req)

    # ---- input checks ----------------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt, allow_special=True) if text is not None else list(prompt)
        V = self.model_info.cfg.vocab_size
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary (0..{V - 1})")
        if self.unmapped:
            bad = next((t for t in ids if t in self.unmapped), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} has no text in this model's tokenizer")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                f"at least one position must be left to generate"
            )
        return text, ids


def hub_source(model) -> str:
    """The model argument when it is a hub repo id (no local folder of that name), else "": a
    repo id is what a client loads a tokenizer from; a local path stays private (the server shows
    no file paths)."""
    if not model or Path(str(model)).exists():
        return ""
    return str(model)
