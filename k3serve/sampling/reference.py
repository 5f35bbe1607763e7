"""Plain, one-row, loop-based version of `logits_process` used to test the batched code.

Deliberately written from the definitions (vLLM/HF/OpenAI docs) with Python lists, not
tensors: repetition penalty divides positive and multiplies negative logits of every token
seen in prompt or output; presence/frequency subtract per the OpenAI formula; min-p keeps
p >= min_p * p_max; top-k keeps the k largest; top-p keeps the shortest head of the sorted
distribution whose mass reaches p.
"""

from __future__ import annotations

import math

from k3serve.scheduler.request import Request


def process_row(logits: list[float], req: Request) -> list[float]:
    p = req.params
    x = list(logits)
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(req.output_token_ids) < p.min_tokens:
        ends = list(p.stop_token_ids) + ([] if p.ignore_eos or req.eos_token_id is None else [req.eos_token_id])
        for t in ends:
            x[t] = -math.inf
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    for t in range(len(x)):
        if p.repetition_penalty != 1 and t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = req.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (1 if c else 0)
    if p.temperature == 0:
        return x
    x = [v / p.temperature for v in x]
    probs = _softmax(x)
    pmax = max(probs)
    x = [v if probs[i] >= p.min_p * pmax else -math.inf for i, v in enumerate(x)]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if p.top_k > 0:
        for i in order[p.top_k :]:
            x[i] = -math.inf
    probs = _softmax(x)
    mass = 0.0
    for rank, i in enumerate(order):
        if rank > 0 and mass >= p.top_p:
            x[i] = -math.inf
        mass += probs[i]
    return x


def _softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]
