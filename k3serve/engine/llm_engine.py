"""LLMEngine: add_request / step / abort over scheduler + runner (vLLM `LLMEngine` shape).

One step = schedule (pure Python) -> execute (model + sampler) -> update progress -> detokenize,
check stop strings -> RequestOutputs for requests that produced tokens or finished. An n > 1
request fans out into n scheduler requests with seeds offset by sample index (vLLM v1 does
the same); prefix caching lets them share the prompt's cache. Taking and handing over
prefilled requests (prefill/decode disaggregation) is engine/disagg.py, a mixin of this class;
the per-request bookkeeping (samples, detokenizers, logprobs) is engine/groups.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

from k3serve.backends import STATIC
from k3serve.cache.draft_slots import DraftSlots, first_spare
from k3serve.cache.manager import HybridCacheManager
from k3serve.config.engine_config import EngineConfig
from k3serve.cache.sizing import parse_bytes
from k3serve.engine.disagg import HandoffMixin
from k3serve.engine.groups import Group, PromptInput, Sample  # noqa: F401 - PromptInput is re-exported
from k3serve.engine.handoff import HandoffStore
from k3serve.engine.info import EngineInfo
from k3serve.engine.media import MediaEncoder
from k3serve.engine.outputs import CompletionOutput, RequestOutput
from k3serve.engine.stats import IterationTokens
from k3serve.offload.setup import make_tiers
from k3serve.weights.hub import resolve_model
from k3serve.distributed.executor import WorkerDied
from k3serve.distributed.start import start_executor
from k3serve.parallel.group import NO_TP, CollectiveError
from k3serve.engine.setup import (
    check_quantization,
    kernel_mode,
    make_plan,
    placement,
    resolve_max_model_len,
    seq_limit_note,
    startup_lines,
)
from k3serve.sampling.detokenizer import IncrementalDetokenizer
from k3serve.sampling.params import ParamError, SamplingParams
from k3serve.scheduler.batch import SampledToken
from k3serve.scheduler.request import Request
from k3serve.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("k3serve.engine")


def _default_model():
    from k3serve.demo import default_model

    return default_model()


class LLMEngine(HandoffMixin):
    def __init__(self, config: EngineConfig, ep=None, remote=None):
        """`ep`: this replica's expert group under DP-attention + EP (engine/lockstep.py): its
        model holds 1/M of the routed experts and meets the other replicas in every MoE layer,
        so every step runs a forward, an idle one when nothing is scheduled. `remote`: instead,
        the replica's model lives in a worker process (distributed/dp_replicas.py RemoteRank)."""
        self.remote = remote
        self.config, self.ep = config, (remote.model.ep if remote is not None else ep)
        spec_model = (config.speculative_config or {}).get("model")
        self.model_path = resolve_model(
            str(config.model or _default_model()),
            config.revision,
            config.download_dir,
            config.hf_token,
            draft=bool(spec_model) and not Path(spec_model).exists(),  # a draft folder inside the repo
        )
        where = placement(config)
        # TP ranks 1..N-1, or the replica's worker (its liveness and faults), or None
        self.executor = remote if remote is not None else start_executor(config, self.model_path, where)
        try:
            self._start(config, where)
        except BaseException:  # no worker outlives an engine that failed to start
            if self.executor is not None:
                self.executor.shutdown()
            raise

    def _start(self, config: EngineConfig, where) -> None:
        from k3serve.models.registry import load_model
        from k3serve.runner.model_runner import ModelRunner
        from k3serve.tokenizer import Tokenizer

        if self.remote is not None:
            self.model = self.remote.model  # its config and weight bytes; the weights are in the worker
        else:
            tp = self.executor.join_group() if self.executor is not None else NO_TP
            self.model = load_model(
                self.model_path,
                dtype=where.dtype,
                load_format=config.load_format,
                progress=config.load_progress,
                tp=tp,
                ep=self.ep,
            ).to(where.device)
            if self.executor is not None:
                self.executor.wait_ready()
        check_quantization(config, self.model)
        mode = kernel_mode(config.kernels, where.device, config.enforce_eager)
        if mode in STATIC and (self.ep is not None or self.remote is not None) and where.device.type != "cpu":
            if config.kernels in STATIC:
                raise ValueError(
                    f"kernels={config.kernels!r} with DP-attention replicas on {where.device}: their "
                    "expert group is gloo (CPU) here; the NCCL one is not built"
                )
            mode = "torch"  # auto on a GPU with DP-attention replicas: their dispatch is eager
        if config.ssm_dtype != "float32" and mode in ("auto", "cpp"):
            if config.kernels == "cpp":  # its C++ kernels read and write the KDA state as float32
                raise ValueError(
                    "kernels='cpp' keeps the KDA state in float32: with --mamba-ssm-cache-dtype "
                    f"{config.ssm_dtype} use 'torch', 'graph' or 'triton'"
                )
            mode = "torch"
            log.info("KDA state in %s: the CPU kernels (float32 state) stand aside; layers run torch", config.ssm_dtype)
        self.kernels = self.model.use_kernels(mode)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or self.model_path)
        self.max_model_len = resolve_max_model_len(config, self.model)
        self.plan = make_plan(config, self.model, where, self.max_model_len)
        self.startup_log = startup_lines(self.model_path, self.model, where, self.plan, config.max_num_seqs)
        self.seq_limit_note = seq_limit_note(self.plan, config.max_num_seqs)
        # ids the model can emit but the tokenizer cannot decode: masked out of sampling, stated once
        self.unmapped_ids = self.tokenizer.unmapped_ids(self.model.cfg.vocab_size)
        self.unmapped = frozenset(self.unmapped_ids)
        if self.unmapped_ids:
            self.startup_log.append(
                f"tokenizer decodes {self.model.cfg.vocab_size - len(self.unmapped_ids):,} of the model's "
                f"{self.model.cfg.vocab_size:,} vocabulary ids; the other {len(self.unmapped_ids):,} (first "
                f"{self.unmapped_ids[0]}) are masked out of sampling and refused in prompts"
            )
        for line in self.startup_log:
            log.info(line)
        self.cache = HybridCacheManager(
            self.plan.num_blocks,
            self.plan.num_slots,
            self.plan.block_size,
            self.plan.slot_bytes,
            self.plan.token_bytes,
            config.enable_prefix_caching,
            self.plan.num_checkpoints,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                config.scheduling_policy,
                checkpoint_interval=config.prefix_cache_state_interval,
            ),
            self.cache,
        )
        self.spec = None
        if config.speculative_config:
            from k3serve.spec_decode.config import SpeculativeConfig
            from k3serve.spec_decode.decoder import SpecDecoder

            spec_cfg = SpeculativeConfig.from_dict(config.speculative_config).resolve_model(self.model_path)
            self.spec = SpecDecoder(spec_cfg, self.model, self.max_model_len, config.max_num_seqs, where.device)
            log.info(
                "speculative decoding: %s, %d tokens, %s drafting, %s verification",
                self.spec.cfg.method,
                self.spec.cfg.num_speculative_tokens,
                self.spec.cfg.draft_sample_method,
                self.spec.cfg.rejection_sample_method,
            )
        graph = self._graph_settings(config, mode, self.spec)
        if graph is not None and graph.num_speculative_tokens:  # verify steps write each position's own slot
            k = graph.num_speculative_tokens
            self.cache.use_draft_slots(
                DraftSlots(self.plan.num_slots, k, first_spare(self.plan.num_slots, self.plan.num_checkpoints))
            )
        kv_name = self.kv_dtype_name = str(where.kv_dtype).removeprefix("torch.")
        if self.remote is not None:  # the worker allocates the cache tensors of the same plan
            self.remote.allocate(self.plan, kv_name, config.calculate_kv_scales, mode, graph, self.unmapped_ids)
        elif self.executor is not None:  # every rank allocates its share of the same plan, runs the same backend
            self.executor.send("allocate", self.plan, kv_name, mode, graph, config.calculate_kv_scales)
        self.runner = ModelRunner(
            self.model,
            self.plan,
            where.kv_dtype,
            config.seed,
            where.device,
            self.spec,
            masked_ids=self.unmapped_ids,
            workers=None if self.remote else self.executor,
            rank=self.remote,
            graph=graph,
            calculate_kv_scales=config.calculate_kv_scales,
        )
        self.tiers = make_tiers(config, self)  # prefix-cache tiers in host memory and on disk, or None
        if graph is not None:
            cc, eager = config.compilation_config, graph.eager
            sizes = cc.capture_sizes(graph.max_num_seqs)
            line = (
                f"graph backend: decode steps of {sizes[0]}..{sizes[-1]} rows run compiled "
                f"({'eager, --enforce-eager' if eager else cc.backend}"
                f"{', captured as CUDA graphs' if where.device.type == 'cuda' and not eager else ''}); "
                f"each new batch bucket compiles on its first step"
                + ("; DP-attention ranks agree on each step's bucket" if self.ep is not None else "")
            )
            if cc.extra:
                line += f"; compilation-config keys without effect here: {', '.join(sorted(cc.extra))}"
            self.startup_log.append(line)
            log.info(line)
        if self.ep is not None and self.remote is None:  # the replicas step at once: each takes its share of the cores
            self.runner.threads = max(1, (os.cpu_count() or 1) // self.ep.size)
        self.media = MediaEncoder(
            self.model_path, self.model.cfg, where.dtype, where.device, parse_bytes(config.mm_encoder_cache)
        )
        if self.model.cfg.vision is not None:
            line = (
                f"vision encoder cache: {self.media.cache_bytes:,} B beside the cache budget "
                f"(tower rows by image / video-chunk digest)"
            )
            self.startup_log.append(line)
            log.info(line)
        self._groups: dict[str, Group] = {}
        self._owner: dict[str, Group] = {}  # scheduler request id -> its group
        self._arrivals = itertools.count()
        self._seen: dict[str, int] = {}  # output tokens already detokenized, per scheduler request
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}
        self.iteration_tokens = IterationTokens()  # vllm:iteration_tokens_total
        self.handoffs = HandoffStore()  # prefilled requests kept for a decode engine (engine/handoff.py)

    @staticmethod
    def _graph_settings(config: EngineConfig, mode: str, spec):
        """The runner's static decode step when the graph backend was chosen, else None."""
        if mode not in STATIC:
            return None
        from k3serve.runner.graph_step import GraphSettings

        return GraphSettings(
            config.compilation_config,
            config.max_num_seqs,
            config.enforce_eager,
            spec.cfg.num_speculative_tokens if spec is not None else 0,
        )

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
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if keep_cache and params.n != 1:
            raise ParamError("n", "a prefill handed to a decode engine is one sequence (n = 1)")
        if keep_cache:
            self._check_handoff()
        params.check_vocab(self.model.cfg.vocab_size)
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
        constraints = [self._constraint(params.structured) for _ in range(params.n)] if params.structured else None
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
                self.model.cfg.eos_token_id,
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
            self._owner[rid] = group
        self._groups[request_id] = group
        self.counters["prompt_tokens"] += len(ids)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op for one process); the engine cannot step after.
        Write-back tiers first take what the pools still hold, so a restart finds it."""
        tiers = getattr(self, "tiers", None)
        if tiers is not None and self.cache.write_back:
            tiers.store(self.runner.cache, *self.cache.resident())
        if self.executor is not None:
            self.executor.shutdown()
        if tiers is not None:
            tiers.close()  # queued writes reach the directory: a restart finds them

    def _constraint(self, so):
        """A fresh grammar state for one sequence; a spec that does not compile is the request's
        fault (ParamError -> 400), found before anything is queued."""
        from k3serve.sampling.grammar import GrammarBackend, GrammarError

        if self.runner.grammar is None:
            self.runner.grammar = GrammarBackend(self.tokenizer, self.model.cfg.vocab_size)
        try:
            return self.runner.grammar.constraint(so)
        except GrammarError as e:
            raise ParamError("structured_outputs", str(e)) from None

    def abort(self, request_id: str) -> bool:
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.samples:
            if not s.req.finished:
                self.scheduler.abort(s.req.request_id)
            self._release(s.req)
        return True

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Drop cached-free latent blocks and unpinned KDA checkpoints: (blocks, checkpoints); the
        host-memory tier empties too (the directory tier persists: delete it to clear it)."""
        if self.tiers is not None:
            self.tiers.clear_host()
        return self.cache.flush()

    def info(self) -> EngineInfo:
        """What a server reads of this engine (engine/info.py)."""
        cfg = self.model.cfg
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
        return bool(self._groups)

    def write_back(self) -> None:
        """Write-back tiers: copy the blocks and checkpoints the pools just evicted down to host
        memory while their rows still hold them (stream order on a GPU: before the step that
        reuses them; the host never waits)."""
        if self.tiers is not None and self.cache.write_back:
            self.tiers.store(self.runner.cache, *self.cache.drain_evicted())

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A request whose sampling, detokenizing or model step fails ends alone
        with `error` set; the other requests of the step go on with unchanged outputs."""
        self._propose()
        if self.tiers is not None:
            self.tiers.poll()  # disk reads done, files written: before the schedule looks them up
        batch = self.scheduler.schedule()
        self.write_back()  # what scheduling evicted, before any step reuses its rows
        if batch.is_empty:
            if self.ep is not None:  # the other replicas' MoE layers wait for this one's
                self.runner.idle_step()
            if self.tiers is not None and self.tiers.busy:  # a request waits on its prefix's disk read
                self.tiers.wait(0.01)
            return []
        if self.tiers is not None:
            self.tiers.load(self.runner.cache, batch.load_blocks, batch.load_states)
        now = time.monotonic()
        self.iteration_tokens.add(sum(s.num_tokens for s in batch.seqs))
        for seq in batch.seqs:  # queue time ends when a request is first scheduled
            group = self._owner.get(seq.request_id)
            if group is not None:
                group.metrics.setdefault("scheduled_time", now)
        try:
            out = self.runner.execute(batch)
        except (WorkerDied, CollectiveError) as e:  # the TP group is broken: no request can run again
            if self.executor is not None:
                self.executor.fail(str(e))
            raise
        except Exception as e:  # noqa: BLE001 - the step is retried apart; see Scheduler.retry_apart
            log.warning(
                "model step over %d requests raised %s: %s; retrying them apart",
                len(batch.seqs),
                type(e).__name__,
                e,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            culprits = self.scheduler.retry_apart(batch)
            why = f"the model step failed for this request ({type(e).__name__})"
            return [self._fail(self._owner[r.request_id], why) for r in culprits if r.request_id in self._owner]
        self.scheduler.update(batch, out)
        if self.tiers is not None:  # before the next step may reuse the rows just published
            self.tiers.store(self.runner.cache, *self.cache.drain_fresh())
        failed: dict[str, RequestOutput] = {}
        touched: dict[str, Group] = {}
        for seq in batch.seqs:
            group = self._owner.get(seq.request_id)
            if group is None:
                continue
            if seq.request_id in out.prompt_logprobs and group.prompt_logprobs is not None:
                group.prompt_logprobs.update(out.prompt_logprobs[seq.request_id])  # recompute overwrites
            toks = out.sampled.get(seq.request_id, [])
            why = out.failed.get(seq.request_id) or self._emit(group, seq.request, toks)
            if why:
                failed[group.request_id] = self._fail(group, why)
                touched.pop(group.request_id, None)
            elif toks:
                touched[group.request_id] = group
        return list(failed.values()) + [self._output(g) for g in touched.values()]

    def _emit(self, group: Group, req: Request, toks: list[SampledToken]) -> str | None:
        """Hand one sequence's tokens of this step to its group; why that failed, or None."""
        try:
            for tok in toks:  # stop after the tokens the scheduler appended (a stop cuts the rest)
                if self._seen.get(req.request_id, 0) >= len(req.output_token_ids):
                    break
                self._on_token(group, req, tok)
        except Exception as e:  # noqa: BLE001 - e.g. a token the tokenizer cannot decode
            log.warning("output processing failed for request %s: %s", group.request_id, e)
            return f"output processing failed for this request ({type(e).__name__})"
        return None

    def _propose(self) -> None:
        """Drafts first: the scheduler budgets 1 + k tokens for them. Drafting is an optimisation:
        if it raises, this step runs without drafts."""
        if self.spec is None:
            return
        reqs = [r for r in self.scheduler.running if r.num_uncomputed == 1]
        try:
            self.runner.propose(reqs)
        except Exception as e:  # noqa: BLE001
            log.warning("drafting raised %s: %s; this step runs without drafts", type(e).__name__, e)
            for r in reqs:
                r.spec_token_ids = []

    def _fail(self, group: Group, why: str) -> RequestOutput:
        """End every sample of `group` with finish reason "error"; its final output."""
        group.error = why
        for s in group.samples:
            if not s.req.finished:
                self.scheduler.finish(s.req, "error")
            self._release(s.req)
        self._groups.pop(group.request_id, None)
        group.metrics["finish_time"] = time.monotonic()
        return self._output(group)

    def _on_token(self, group: Group, req: Request, tok: SampledToken) -> None:
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
            self._release(req)
            if group.finished:
                group.metrics["finish_time"] = time.monotonic()
                self.counters["requests_finished"] += 1
                self._groups.pop(group.request_id, None)

    def _release(self, req: Request) -> None:
        rid = req.request_id
        if req.keep_cache and self.cache.holds(rid):  # a prefill for a decode engine: copy it out, free
            if req.finish_reason in ("stop", "length") and req.output_token_ids:
                self.handoffs.put(self._capture(req))
            self.cache.free(rid)
        self.runner.release(req.request_id)
        self._owner.pop(req.request_id, None)
        self._seen.pop(req.request_id, None)

    def _output(self, group: Group) -> RequestOutput:
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
        V = self.model.cfg.vocab_size
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
