"""What every drafter returns, and the prompt-lookup (ngram) drafter.

ngram (vLLM `prompt_lookup`): find the most recent earlier occurrence of the longest suffix
n-gram (prompt_lookup_max down to prompt_lookup_min) in the request's tokens and propose the
tokens that followed it. No weights, no probabilities: q is one-hot (greedy drafting).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from k3serve.scheduler.request import Request


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [k, V] the q each token was drawn from; None = one-hot


assert array("I").itemsize == 4  # the packed ids' width (every platform torch runs on)


@dataclass
class _Tokens:
    """One request's tokens as packed 32-bit ids, grown as tokens come: a suffix is looked for
    with bytes.rfind (C's backward search) instead of a Python scan."""

    buf: bytearray = field(default_factory=bytearray)
    upto: int = 0  # tokens packed


class NgramProposer:
    free = True  # a host lookup: proposing every step costs nothing worth weighing (spec_decode/adaptive.py)

    def __init__(self, k: int, n_min: int = 1, n_max: int = 4):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        return [Draft(self.indexed_lookup(r.request_id, r.token_slice, r.num_tokens, k)) for r, k in zip(reqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The reference: scan back for the suffix, longest n first (O(L n) a call)."""
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = tokens[L - n :]
            for j in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
                if tokens[j : j + n] == suffix:
                    return tokens[j + n : j + n + k]
        return []

    def indexed_lookup(self, request_id: str, read, L: int, k: int) -> list[int]:
        """`lookup`'s answer for a request of L tokens, `read(a, b)` giving tokens[a:b]
        (Request.token_slice: no copy of the whole sequence): the tokens added since the last
        call are packed onto the request's buffer, each suffix found by rfind (~1 us for 2,000
        tokens; the Python scan took ~1 ms a request there, every step)."""
        t = self._tokens.get(request_id)
        if t is None or t.upto > L:  # new, or its tokens were cut (a stop string): repack
            t = self._tokens[request_id] = _Tokens()
        if t.upto < L:
            t.buf += array("I", read(t.upto, L)).tobytes()
            t.upto = L
        buf = t.buf
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            sub = bytes(buf[4 * (L - n) :])
            end = 4 * (L - 1)  # an occurrence starting at j <= L - n - 1: it ends by token L - 1
            while (at := buf.rfind(sub, 0, end)) >= 0 and at % 4:  # straddles ids: look further back
                end = at + len(sub) - 1
            if at >= 0:
                j = at // 4
                return read(j + n, min(j + n + k, L))
        return []

    def observe(self, request_id: str, hidden: torch.Tensor | None) -> None:
        pass

    def release(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
