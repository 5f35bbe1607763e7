"""LLMEngine's side of prefill/decode disaggregation (issue 17): what a prefill engine keeps
and hands over, and how a decode engine takes a request another engine prefilled.

The hand-off itself (rows, state, wire format, TP head merging) is engine/handoff.py; this is
the part that reads and writes the engine's scheduler, cache manager and runner. A mixin of
LLMEngine: `self` is the engine.
"""

from __future__ import annotations

import time

from k3serve.engine.groups import Group, PromptInput, Sample
from k3serve.engine.handoff import KVHandoff, capture, install
from k3serve.outputs import RequestOutput
from k3serve.sampling_params import ParamError, SamplingParams
from k3serve.outputs import SampledToken
from k3serve.scheduler.request import Request
from k3serve.tokenizer.detokenizer import IncrementalDetokenizer


class HandoffMixin:
    def held_tokens(self, prompt_token_ids: list[int]) -> int:
        """Prompt tokens whose latent rows this engine already caches (whole blocks); give a media
        prompt's `cache_ids`."""
        return len(self.cache.held_prefix(prompt_token_ids)) * self.cache.block_size

    def reusable_tokens(self, prompt_token_ids: list[int]) -> int:
        """Prompt tokens this engine could reuse, its prefix-cache tiers included (routing)."""
        return self.cache.reusable_tokens(prompt_token_ids)

    def cache_ids(self, prompt: PromptInput) -> list[int]:
        """The prefix-cache keys of a prompt: its ids, with media pads replaced by the items'
        content keys (multimodal/prompt_media.py); nothing is encoded."""
        mm = (prompt.get("multi_modal_data") or {}) if isinstance(prompt, dict) else {}
        _, ids = self._tokenize(prompt)
        if not (mm.get("image") or mm.get("video")):
            return ids
        return self.media.cache_ids(ids, list(mm.get("image", [])), list(mm.get("video", [])), self.tokenizer)

    def _check_handoff(self) -> None:
        if not self.executor.transfers:
            raise ValueError(
                "prefill/decode hand-offs under tensor parallelism need every rank on this node "
                "(their KDA heads are read and written over the workers' pipes): not with torchrun, "
                "Ray or --nnodes"
            )
        if self.executor.lockstep:
            raise ValueError("prefill/decode hand-offs with DP-attention replicas are not built")

    def pull_handoff(self, request_id: str, held_tokens: int = 0) -> KVHandoff:
        return self.handoffs.pull(request_id, held_tokens)

    def release_handoff(self, request_id: str) -> bool:
        """Drop a kept prefill nobody will pull; whether there was one."""
        return self.handoffs.held.pop(request_id, None) is not None

    def add_prefilled(self, h: KVHandoff, params: SamplingParams | None = None) -> RequestOutput | None:
        """Decode a request another engine prefilled, from its first token on, as if prefilled
        here; its final output when the first token already ends it (no step will report it)."""
        params = params or SamplingParams()
        self._check_handoff()
        if h.request_id in self.outputs.groups:
            raise ValueError(f"request id {h.request_id!r} is already in use")
        held = self.cache.held_prefix(h.cache_ids or h.prompt_token_ids)[: h.start // h.block_size]
        if len(held) * h.block_size != h.start:
            raise ValueError(
                f"this engine no longer holds the {h.start} prompt tokens the hand-off left out; "
                f"pull it again with held_tokens={len(held) * h.block_size}"
            )
        first = self._first_token(h, params)
        constraint = self.runner.constraint(params.structured, self.tokenizer) if params.structured else None
        if constraint is not None and not constraint.accept(h.first_token):
            raise ParamError(
                "kv_transfer_params",
                "the prefilled first token breaks this request's output grammar: "
                "send the prefill server the same structured-output request",
            )
        req = Request(
            h.request_id,
            list(h.prompt_token_ids),
            params,
            self.model_info.cfg.eos_token_id,
            self.max_model_len,
            arrival=next(self._arrivals),
        )
        req.prompt_cache_ids = h.cache_ids
        ended = req.append_token(h.first_token)  # as if sampled here (its rows come with the next step)
        group = Group(
            h.request_id,
            None,
            list(h.prompt_token_ids),
            [Sample(req, IncrementalDetokenizer(self.tokenizer, params), [] if params.logprobs is not None else None)],
            {"arrival_time": time.monotonic()},
            prompt_logprobs=h.prompt_logprobs,
        )
        alloc = self.scheduler.adopt(req, held)
        self.write_back()  # blocks the adoption evicted, before the hand-off's rows land on them
        install(self.executor, h, self.plan.block_size, alloc.blocks, alloc.state_slot)
        if h.rng_state is not None:  # the prefill's random stream goes on where its first draw left it
            self.runner.restore_rng(req, h.rng_state)
        if constraint is not None:
            self.runner.constraints[h.request_id] = constraint
        self.outputs.add(group)
        if ended:
            self.scheduler.finish(req, req.finish_reason)
        self.outputs.on_token(group, req, first)
        self._free()
        return self.outputs.output(group) if req.finished else None

    @staticmethod
    def _first_token(h: KVHandoff, params: SamplingParams) -> SampledToken:
        """The prefill's first token, with the logprobs it was sampled with when they are asked."""
        if params.prompt_logprobs is not None and h.prompt_logprobs is None:
            raise ParamError(
                "prompt_logprobs",
                "the prefill carried no prompt logprobs: send prompt_logprobs to the prefill server too",
            )
        if params.logprobs is None:
            return SampledToken(h.first_token)
        if h.first_logprobs is None or h.first_token not in h.first_logprobs:
            raise ParamError(
                "logprobs",
                "the prefill carried no logprobs for the first token: send logprobs to the prefill server too",
            )
        top = tuple((t, lp) for t, lp in h.first_logprobs.items() if t != h.first_token)
        return SampledToken(h.first_token, h.first_logprobs[h.first_token], top)

    def _capture(self, req: Request, group: Group) -> KVHandoff:
        """A finished prefill's cache rows and state, and what continues it exactly elsewhere:
        its sampler's random stream, the first token's logprobs, prompt logprobs, media keys."""
        rid = req.request_id
        sample, slot = group.samples[0], self.cache.state_slot(rid)
        return capture(
            self.executor,
            self.plan.block_size,
            rid,
            req.prompt_token_ids,
            req.output_token_ids[0],
            self.cache.block_table(rid),
            slot,
            cache_ids=req.prompt_cache_ids,
            rng_state=self.runner.rng_state(rid),
            first_logprobs=dict(sample.logprobs[0]) if sample.logprobs else None,
            prompt_logprobs=dict(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
        )
