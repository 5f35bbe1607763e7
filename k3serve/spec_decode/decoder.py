"""SpecDecoder: the runner's speculative side — ask the drafter for tokens before a step, choose
how many of them each request verifies (spec_decode/adaptive.py, unless the config pins K),
verify them after the target's forward, keep acceptance statistics and step timings."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from k3serve.sampling.sampler import sampled_token
from k3serve.scheduler.batch import ScheduledBatch
from k3serve.outputs import SampledToken
from k3serve.scheduler.request import Request
from k3serve.config.speculative import SpeculativeConfig
from k3serve.spec_decode.adaptive import DraftPolicy
from k3serve.spec_decode.proposer import Draft, NgramProposer
from k3serve.spec_decode.verifier import SpecStats, verify

SAMPLE_EVERY = 4  # steps one cost sample is taken from


def make_proposer(
    cfg: SpeculativeConfig, target, max_model_len: int, max_num_seqs: int, device: torch.device = torch.device("cpu")
):
    """The drafter, its model (if any) on `device`, the target's."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "dspark":
        from k3serve.spec_decode.dspark import DSparkProposer

        proposer = DSparkProposer.load(cfg.model, target, cfg.draft_sample_method, device)
        block = proposer.model.cfg.block_size
        if cfg.num_speculative_tokens > block:  # a block draft proposes at most its block: more was silently fewer
            raise ValueError(
                f"speculative_config: num_speculative_tokens {cfg.num_speculative_tokens} exceeds the "
                f"dspark draft's block_size {block} ({cfg.model})"
            )
        return proposer
    from k3serve.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer.load(cfg.model, target, cfg.draft_sample_method, max_model_len, max_num_seqs, device)


class SpecDecoder:
    def __init__(
        self,
        cfg: SpeculativeConfig,
        target,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device = torch.device("cpu"),
    ):
        self.cfg = cfg
        self.proposer = make_proposer(cfg, target, max_model_len, max_num_seqs, device)
        self.stats = SpecStats()
        self._drafts: dict[str, Draft] = {}
        self._steps = 0
        # None: every request verifies all it was proposed (`"adaptive": false`, an exact A/B)
        free = getattr(self.proposer, "free", False)  # a host lookup (ngram): no forward to weigh
        self.policy = DraftPolicy(cfg.num_speculative_tokens, probe_every=16 if free else 32) if cfg.adaptive else None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return getattr(self.proposer, "tap_layers", ())

    def wants_taps(self, reqs: Iterable[Request]) -> bool:
        """Whether a step of these requests returns the tap layers' states: the next step may
        draft (the policy is not resting it), or one of them is a seeded sampled request, which
        is proposed every draft whatever the policy says (see `propose`)."""
        return self.policy is None or self.policy.resting_next() == 0 or any(_seeded(r) for r in reqs)

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` on the running requests that decode this step (at most
        num_speculative_tokens each; with the policy, the lengths it chooses, none at all when
        drafting cannot pay this step). A seeded sampled request verifies every draft proposed
        to it, whatever the policy says: its verification draws depend on its draft lengths, so
        the lengths must not depend on timings or on other requests for its seed to give the
        same text each time. The drafter runs under inference mode."""
        policy = self.policy
        if policy is not None and policy.resting():  # a resting step costs a counter (and a scan)
            fixed = [r for r in running if r.num_uncomputed == 1 and r.max_drafts > 0 and _seeded(r)]
            if fixed:
                with torch.inference_mode():
                    self._propose(fixed, None)
            return
        reqs = [r for r in running if r.num_uncomputed == 1 and r.max_drafts > 0]
        if not reqs:
            return
        with torch.inference_mode():
            self._propose(reqs, policy)

    def _propose(self, reqs: list[Request], policy) -> None:
        context, t = 0.0, time.perf_counter()
        if policy is not None:
            policy.score_shadows(reqs)
            context = sum(r.num_computed_tokens for r in reqs) / len(reqs)
            if not policy.should_draft([r.request_id for r in reqs], getattr(self.proposer, "free", False), context):
                fixed = [r for r in reqs if _seeded(r)]
                if fixed:
                    self._propose(fixed, None)
                return
        ks = [min(self.cfg.num_speculative_tokens, r.max_drafts) for r in reqs]
        drafts = self.proposer.propose(reqs, ks)
        if policy is None:
            lengths = [len(d.token_ids) for d in drafts]
        else:
            lengths = policy.choose(
                [r.request_id for r in reqs],
                [len(d.token_ids) for d in drafts],
                [r.num_tokens for r in reqs],
                [d.token_ids for d in drafts],
                context,
            )
            # the whole phase, policy included: what drafting costs a step beyond its verify rows
            policy.record_draft_time(len(reqs), time.perf_counter() - t)
        for r, d, k in zip(reqs, drafts, lengths):
            k = len(d.token_ids) if _seeded(r) else k
            r.spec_token_ids = list(d.token_ids[:k])
            if k:
                self._drafts[r.request_id] = d
            else:
                self._drafts.pop(r.request_id, None)

    def step_done(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's wall time refreshes the cost table when it was a pure decode / verify step
        (every sequence one newest token plus its drafts)."""
        if self.policy is None:
            return
        self._steps += 1
        seqs = batch.seqs
        context = seqs[0].start  # the first sequence's stands in for the sampling decision
        # one step in SAMPLE_EVERY (a decode step's bookkeeping stays a counter), every step
        # while its bucket has few points (a new context length, a new batch size)
        if self._steps % SAMPLE_EVERY and not self.policy.sparse(len(seqs), context):
            return
        if all(s.sample and s.start and s.num_tokens == 1 + len(s.drafts) for s in seqs):
            verifying = sum(1 for s in seqs if s.drafts)
            context = sum(s.start for s in seqs) / len(seqs)
            self.policy.record_step(len(seqs), batch.num_tokens, seconds, context, verifying)

    def verify(
        self, req: Request, logits: torch.Tensor, drafts: list[int], gen: torch.Generator
    ) -> tuple[list[SampledToken], int]:
        """logits [1 + len(drafts), V] -> emitted tokens (with raw logprobs when asked), tau."""
        d = self._drafts.pop(req.request_id, None)
        q = d.probs[: len(drafts)] if d is not None and d.probs is not None else None
        emitted, tau = verify(req, logits, drafts, q, self.cfg.rejection_sample_method, gen)
        self.stats.record(len(drafts), tau)
        if self.policy is not None:
            self.policy.record_verify(req.request_id, len(drafts), tau)
        req.spec_draft_tokens += len(drafts)
        req.spec_accepted_tokens += tau
        n = req.params.logprobs
        raw = torch.log_softmax(logits.float(), -1) if n is not None else None
        return [sampled_token(t, raw, j, n) for j, t in enumerate(emitted)], tau

    def observe(self, request_id: str, taps: torch.Tensor | None) -> None:
        self.proposer.observe(request_id, taps)

    def release(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
        self.proposer.release(request_id)
        if self.policy is not None:
            self.policy.release(request_id)


def _seeded(req: Request) -> bool:
    """A sampled request with a seed: its drafts are verified as proposed (see propose)."""
    return req.params.seed is not None and not req.params.greedy
