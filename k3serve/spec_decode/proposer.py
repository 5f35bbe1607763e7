"""What every drafter returns, and the prompt-lookup (ngram) drafter.

ngram (vLLM `prompt_lookup`): find the most recent earlier occurrence of the longest suffix
n-gram (prompt_lookup_max down to prompt_lookup_min) in the request's tokens and propose the
tokens that followed it. No weights, no probabilities: q is one-hot (greedy drafting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.scheduler.request import Request


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [k, V] the q each token was drawn from; None = one-hot


class NgramProposer:
    def __init__(self, k: int, n_min: int = 1, n_max: int = 4):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        return [Draft(self.lookup(r.all_token_ids, k)) for r, k in zip(reqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = tokens[L - n :]
            for j in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
                if tokens[j : j + n] == suffix:
                    return tokens[j + n : j + n + k]
        return []

    def observe(self, request_id: str, hidden: torch.Tensor | None) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass
