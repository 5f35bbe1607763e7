"""Sampler: processed logits [B, V] -> one token per row, plus logprobs when asked.

Every request owns a torch.Generator (seeded from its `seed`, else from the engine seed and its
arrival number) and draws from it only when it samples a token, so a seeded request gives the
same tokens whatever else is in the batch. Logprobs are those of the raw model distribution
(vLLM v1's default `raw_logprobs`), before penalties and temperature.
"""

from __future__ import annotations

import torch

from k3serve.sampling.logits_process import apply_bias_and_penalties, row_params, truncate
from k3serve.scheduler.batch import SampledToken
from k3serve.scheduler.request import Request


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 generators: list[torch.Generator]) -> list[SampledToken]:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, -1) if any(r.params.logprobs is not None for r in reqs) else None
        processed = apply_bias_and_penalties(logits, reqs)
        tokens = processed.argmax(-1)
        sampled_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            probs = torch.softmax(truncate(processed[rows], *row_params([reqs[i] for i in sampled_rows])), -1)
            for j, i in enumerate(sampled_rows):
                tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
        return [sampled_token(int(tokens[i]), raw_logprobs, i, r.params.logprobs) for i, r in enumerate(reqs)]


def sampled_token(token: int, raw: torch.Tensor | None, row: int, n: int | None) -> SampledToken:
    """The token with its raw logprob and top-n (`raw` [B, V] log-softmax of the model logits)."""
    if raw is None or n is None:
        return SampledToken(token)
    top = ()
    if n > 0:
        vals, ids = raw[row].topk(n)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return SampledToken(token, float(raw[row, token]), top)
