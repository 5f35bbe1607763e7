"""Turn a request's target logits at its 1 + k verify positions into emitted tokens.

p_i is the target distribution after exactly the same processing as ordinary sampling (logit
bias, min_tokens, penalties over the output *including the drafts before i*, temperature,
min-p, top-k, top-p); q is the drafter's processed distribution (one-hot for greedy drafting).
Greedy requests use the argmax rule, so spec and non-spec greedy outputs coincide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3serve.sampling.logits_process import apply_bias_and_penalties, needs_processing, row_params, truncate
from k3serve.scheduler.request import Request
from k3serve.spec_decode.rejection import verify_block, verify_greedy, verify_standard


@dataclass
class _View:
    """The request as it looks at verify position i (outputs extended by the drafts before i)."""

    params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None


@dataclass
class SpecStats:
    drafts: int = 0  # verify passes with at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per verify pass (vLLM's definition)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def record(self, k: int, tau: int) -> None:
        if k == 0:
            return
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += tau
        while len(self.accepted_per_position) < k:
            self.accepted_per_position.append(0)
        for i in range(tau):
            self.accepted_per_position[i] += 1


def processed_logits(logits: torch.Tensor, req: Request, drafts: list[int]) -> torch.Tensor:
    """[T, V] logits after bias / min_tokens / penalties, position by position."""
    if not needs_processing(req):
        return logits.float()  # no position changes (min_tokens met before the first draft)
    return torch.cat([processed_row(logits[i], req, drafts[:i]) for i in range(logits.shape[0])], 0)


def processed_row(logits: torch.Tensor, req: Request, drafts_before: list[int]) -> torch.Tensor:
    """[V] logits of the position after `drafts_before` -> [1, V] processed."""
    view = _View(req.params, req.prompt_token_ids, req.output_token_ids + drafts_before, req.eos_token_id)
    return apply_bias_and_penalties(logits[None].float(), [view])


def distribution(processed: torch.Tensor, req) -> torch.Tensor:
    """Probabilities after temperature / min-p / top-k / top-p, one row per position."""
    n = processed.shape[0]
    params = [t.repeat(n) if t.dim() else t for t in row_params([req])]
    return torch.softmax(truncate(processed, *params), -1).double()


def verify(
    req: Request, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, method: str, gen: torch.Generator
) -> tuple[list[int], int]:
    proc = processed_logits(logits, req, drafts)
    if req.params.greedy:
        return verify_greedy(proc.argmax(-1).tolist(), drafts)
    p = distribution(proc, req)
    if q is None:  # greedy / ngram drafting: q is one-hot at the drafted token
        q = torch.zeros(len(drafts), p.shape[1], dtype=torch.float64)
        q[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)] = 1.0
    fn = verify_block if method == "block" else verify_standard
    return fn(p, q.double(), drafts, gen)
