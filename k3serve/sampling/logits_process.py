"""Batched logits processing: logit_bias, min_tokens, penalties, temperature, min-p, top-k, top-p.

Order follows vLLM v1 (`v1/sample/sampler.py`): bias and penalties on raw logits, then
temperature, then min-p, then top-k, then top-p on what top-k kept. Each row has its own
parameters; `reference.py` applies the same steps one row at a time with plain Python.
Shapes: logits [B, V] fp32; per-row parameter tensors [B].
"""

from __future__ import annotations

import torch

from k3serve.scheduler.request import Request

NEG_INF = float("-inf")
TOP_K_CAP = 2**31  # above every vocabulary


def needs_processing(req: Request) -> bool:
    """Whether logit_bias, min_tokens (ends suppressed until it is reached) or penalties change
    this request's next row; once False it stays so for the rows after it (drafts included)."""
    p = req.params
    return bool(p.logit_bias) or len(req.output_token_ids) < p.min_tokens or p.uses_penalties


def apply_bias_and_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The rows with bias / min_tokens / penalties applied; `logits` itself (no copy) when no
    row asks for any (a copy of [B, V] is ~10 MB a step at a 160k vocabulary and 16 rows)."""
    out = logits
    for i, req in enumerate(reqs):
        if not needs_processing(req):
            continue
        if out is logits:
            out = logits.clone()
        _process_row(out, i, req)
    return out


def _process_row(logits: torch.Tensor, i: int, req: Request) -> None:
    """Row i of `logits` in place: logit_bias, min_tokens' suppressed ends, penalties."""
    p = req.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    ends = suppressed_ends(req)  # until min_tokens
    if ends:
        logits[i, torch.tensor(ends, dtype=torch.long)] = NEG_INF
    if p.uses_penalties:
        _penalize_row(logits[i], req)


def suppressed_ends(req: Request) -> list[int]:
    """The ids that end the request (its stop ids, EOS unless ignore_eos), which min_tokens
    suppresses until that many tokens are out; [] once they are."""
    p = req.params
    if len(req.output_token_ids) >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos or req.eos_token_id is None else [req.eos_token_id])


def _penalize_row(row: torch.Tensor, req: Request) -> None:
    """In place on one row [V]: repetition (prompt + output), presence and frequency (output)."""
    p, V = req.params, row.shape[0]
    out = torch.tensor(req.output_token_ids, dtype=torch.long)
    counts = torch.zeros(V, dtype=row.dtype).index_add_(0, out, torch.ones(len(out), dtype=row.dtype))
    if p.repetition_penalty != 1:
        seen = counts > 0
        seen[torch.tensor(req.prompt_token_ids, dtype=torch.long)] = True
        row[:] = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def row_params(
    reqs: list[Request], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    temp = torch.tensor([r.params.temperature or 1.0 for r in reqs], dtype=dtype)
    # any top_k >= V means "off"; capping keeps huge API values (2**63+) inside int64
    top_k = torch.tensor([min(max(r.params.top_k, 0), TOP_K_CAP) for r in reqs])
    top_p = torch.tensor([r.params.top_p for r in reqs], dtype=dtype)
    min_p = torch.tensor([r.params.min_p for r in reqs], dtype=dtype)
    return temp, top_k, top_p, min_p


def truncate(
    logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p; masked entries become -inf. logits [B, V]."""
    logits = logits / temp[:, None]
    probs = torch.softmax(logits, -1)
    logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), NEG_INF)
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = torch.arange(logits.shape[-1])[None, :]
    sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), NEG_INF)
    sorted_probs = torch.softmax(sorted_logits, -1)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly ahead of each token
    sorted_logits = sorted_logits.masked_fill((before >= top_p[:, None]) & (rank > 0), NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter(-1, order, sorted_logits)
