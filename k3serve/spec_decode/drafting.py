"""Turning draft logits into draft tokens and the q they were drawn from, with the request's own
sampling parameters (so top-k / top-p / temperature act on q exactly as on p)."""

from __future__ import annotations

import torch

from k3serve.sampling.seeds import request_seed
from k3serve.scheduler.request import Request
from k3serve.spec_decode.verifier import distribution, processed_row


def draft_token(
    logits: torch.Tensor, req: Request, prev_drafts: list[int], method: str, gen: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """logits [V] for the next draft position -> (token, q row or None for one-hot)."""
    proc = processed_row(logits, req, prev_drafts)[0]
    if method == "greedy" or req.params.greedy:
        return int(proc.argmax()), None
    q = distribution(proc[None], req)[0]
    return int(torch.multinomial(q, 1, generator=gen)[0]), q


def stack_q(rows: list[torch.Tensor | None], tokens: list[int], vocab: int) -> torch.Tensor | None:
    """[k, V] q for verification; one-hot rows where drafting was greedy. None if all greedy."""
    if all(r is None for r in rows):
        return None
    out = torch.zeros(len(rows), vocab, dtype=torch.float64)
    for i, (r, t) in enumerate(zip(rows, tokens)):
        if r is None:
            out[i, t] = 1.0
        else:
            out[i] = r
    return out


def request_generator(store: dict, req: Request, salt: int) -> torch.Generator:
    gen = store.get(req.request_id)
    if gen is None:
        gen = store[req.request_id] = torch.Generator().manual_seed(
            request_seed(req.params.seed, req.arrival, salt=salt)
        )
    return gen
