"""SpecDecoder: the runner's speculative side — ask the drafter for tokens before a step,
verify them after the target's forward, roll KDA state back, keep acceptance statistics."""

from __future__ import annotations

import torch

from k3serve.sampling.sampler import sampled_token
from k3serve.scheduler.batch import SampledToken
from k3serve.scheduler.request import Request
from k3serve.config.speculative import SpeculativeConfig
from k3serve.spec_decode.proposer import Draft, NgramProposer
from k3serve.spec_decode.verifier import SpecStats, verify


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

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return getattr(self.proposer, "tap_layers", ())

    def propose(self, reqs: list[Request]) -> None:
        """Set `spec_token_ids` on decoding requests (at most num_speculative_tokens each)."""
        reqs = [r for r in reqs if r.max_drafts > 0]
        if not reqs:
            return
        ks = [min(self.cfg.num_speculative_tokens, r.max_drafts) for r in reqs]
        for r, d in zip(reqs, self.proposer.propose(reqs, ks)):
            r.spec_token_ids = list(d.token_ids)
            self._drafts[r.request_id] = d

    def verify(
        self, req: Request, logits: torch.Tensor, drafts: list[int], gen: torch.Generator
    ) -> tuple[list[SampledToken], int]:
        """logits [1 + len(drafts), V] -> emitted tokens (with raw logprobs when asked), tau."""
        d = self._drafts.pop(req.request_id, None)
        q = d.probs[: len(drafts)] if d is not None and d.probs is not None else None
        emitted, tau = verify(req, logits, drafts, q, self.cfg.rejection_sample_method, gen)
        self.stats.record(len(drafts), tau)
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
