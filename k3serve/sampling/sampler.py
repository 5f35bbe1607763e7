"""Sampler: processed logits [B, V] -> one token per row, plus logprobs when asked.

Every request owns a torch.Generator (seeded from its `seed`, else from the engine seed and its
arrival number) and draws from it only when it samples a token, so a seeded request gives the
same tokens whatever else is in the batch. Logprobs are those of the raw model distribution
(vLLM v1's default `raw_logprobs`), before penalties and temperature.

Fault isolation (issue 18): a row whose processed logits hold no finite value, or whose
distribution is not a distribution, fails alone (`SampleResult.failed`). If the batched pass
raises anyway, it is redone row by row from the same generator states, so the rows that did
not raise get exactly the tokens they would have got, and only the raising rows fail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from k3serve.sampling.logits_process import apply_bias_and_penalties, row_params, truncate
from k3serve.outputs import ModelFault, SampledToken
from k3serve.scheduler.request import Request

log = logging.getLogger("k3serve.sampling")
NO_FINITE = (
    "sampling failed for this request: its processed logits have no finite value "
    "(check temperature, penalties, logit_bias and min_tokens)"
)
BAD_PROBS = "sampling failed for this request: its sampling distribution is not finite"
MODEL_FAULT = ModelFault(
    "the model's logits for this request have no finite value (NaN, +inf or all -inf): a "
    "fault of the model or its weights (an overflow), not of the request's sampling settings"
)
_fault_logged = False


def model_fault_rows(logits: torch.Tensor) -> list[bool]:
    """Rows [B, V] of the model's logits (undecodable ids and grammar masks applied, nothing
    of the request's sampling settings yet) that hold a NaN or +inf, or no finite value at
    all: masks only add -inf and always leave a token, so these are the model's fault (an
    overflow of its weights), not the client's. Logged once a process."""
    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1) | ~torch.isfinite(logits).any(-1)
    bad = bad.tolist()
    global _fault_logged
    if any(bad) and not _fault_logged:
        _fault_logged = True
        log.error(
            "the model produced non-finite logits (NaN or +inf) for %d of %d rows: check the checkpoint's "
            "weights and scales for overflow (logged once)",
            sum(bad),
            len(bad),
        )
    return bad


@dataclass
class SampleResult:
    tokens: dict[int, SampledToken] = field(default_factory=dict)  # row -> token
    failed: dict[int, str] = field(default_factory=dict)  # row -> why (the request fails alone)

    def __getitem__(self, row: int) -> SampledToken:
        if row in self.failed:
            raise ValueError(self.failed[row])
        return self.tokens[row]


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: list[Request], generators: list[torch.Generator]) -> SampleResult:
        rows = list(range(len(reqs)))
        states = {i: generators[i].get_state() for i in rows if not reqs[i].params.greedy}
        try:
            return self._sample(logits, reqs, generators, rows)
        except Exception:  # one row broke the batch: find it, keep the others' draws exact
            log.warning("batched sampling raised; retrying %d rows one by one", len(rows), exc_info=True)
        for i, state in states.items():
            generators[i].set_state(state)
        result = SampleResult()
        for i in rows:
            try:
                one = self._sample(logits, reqs, generators, [i])
            except Exception as e:
                log.warning("sampling failed for request %s: %s", reqs[i].request_id, e)
                result.failed[i] = f"sampling failed for this request ({type(e).__name__})"
                continue
            result.tokens.update(one.tokens)
            result.failed.update(one.failed)
        return result

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], generators: list[torch.Generator], rows: list[int]
    ) -> SampleResult:
        """Sample `rows` of the batch; logits [B, V]."""
        sub = [reqs[i] for i in rows]
        x = (logits if len(rows) == len(reqs) else logits[torch.tensor(rows)]).float()
        raw_logprobs = torch.log_softmax(x, -1) if any(r.params.logprobs is not None for r in sub) else None
        faulty = model_fault_rows(x)
        processed = apply_bias_and_penalties(x, sub)
        top, tokens = processed.max(-1)  # the greedy tokens (first maximum) and whether a row has a finite value
        has_finite = torch.isfinite(top).tolist()
        ok = [f and not m for f, m in zip(has_finite, faulty)]
        sampled = [j for j, r in enumerate(sub) if not r.params.greedy and ok[j]]
        if sampled:
            probs = torch.softmax(
                truncate(processed[torch.tensor(sampled)], *row_params([sub[j] for j in sampled])), -1
            )
            finite = torch.isfinite(probs).all(-1).tolist()
            for k, j in enumerate(sampled):
                if not finite[k]:
                    ok[j] = False
                    continue
                tokens[j] = torch.multinomial(probs[k], 1, generator=generators[rows[j]])[0]
        result = SampleResult()
        ids = tokens.tolist()
        for j, (i, r) in enumerate(zip(rows, sub)):
            if not ok[j]:
                result.failed[i] = MODEL_FAULT if faulty[j] else BAD_PROBS if has_finite[j] else NO_FINITE
            else:
                result.tokens[i] = sampled_token(ids[j], raw_logprobs, j, r.params.logprobs)
        return result


def sampled_token(token: int, raw: torch.Tensor | None, row: int, n: int | None) -> SampledToken:
    """The token with its raw logprob and top-n (`raw` [B, V] log-softmax of the model logits)."""
    if raw is None or n is None:
        return SampledToken(token)
    top = ()
    if n > 0:
        vals, ids = raw[row].topk(n)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return SampledToken(token, float(raw[row, token]), top)
