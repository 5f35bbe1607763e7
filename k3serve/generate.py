"""Offline generation without a scheduler: prefill all prompts in one ForwardBatch, then
decode token by token with every sequence batched (used by `k3serve generate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3serve.models.kimi import KimiForCausalLM
from k3serve.runner.forward_batch import CacheTensors, ForwardBatch


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


class SimpleGenerator:
    """One KDA slot and a contiguous run of latent blocks per sequence."""

    def __init__(self, model: KimiForCausalLM, block_size: int = 16):
        self.model, self.block_size = model, block_size

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int = 16, temperature: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False,
                 chunk_size: int | None = None) -> list[GenerationResult]:
        cfg, bs = self.model.cfg, self.block_size
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        per_seq = math.ceil((max(map(len, prompts)) + max_tokens) / bs)
        cache = CacheTensors.allocate(cfg, len(prompts), per_seq * len(prompts), bs,
                                      kv_dtype=self.model.dtype_)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        logits = self._prefill(prompts, tables, cache, chunk_size)
        outs = [[] for _ in prompts]
        done = [False] * len(prompts)
        lens = [len(p) for p in prompts]
        for _ in range(max_tokens):
            tokens = self._sample(logits, temperature, gen)
            live = [i for i in range(len(prompts)) if not done[i]]
            for i, t in zip(live, tokens):
                outs[i].append(t)
                if (t == cfg.eos_token_id and not ignore_eos) or len(outs[i]) >= max_tokens:
                    done[i] = True
            live = [i for i in range(len(prompts)) if not done[i]]
            if not live:
                break
            batch = ForwardBatch(torch.tensor([outs[i][-1] for i in live]), [1] * len(live),
                                 [lens[i] + len(outs[i]) - 1 for i in live], live,
                                 [tables[i] for i in live], bs)
            logits = self.model.compute_logits(self.model(batch, cache))
        return [GenerationResult(o, "stop" if o and o[-1] == cfg.eos_token_id and not ignore_eos else "length")
                for o in outs]

    def _prefill(self, prompts, tables, cache, chunk_size) -> torch.Tensor:
        step = chunk_size or max(map(len, prompts))
        last = torch.zeros(len(prompts), self.model.cfg.vocab_size)
        for start in range(0, max(map(len, prompts)), step):
            seqs = [i for i, p in enumerate(prompts) if start < len(p)]
            pieces = [prompts[i][start:start + step] for i in seqs]
            batch = ForwardBatch(torch.tensor(sum(pieces, [])), [len(p) for p in pieces], [start] * len(seqs),
                                 seqs, [tables[i] for i in seqs], self.block_size)
            hidden = self.model(batch, cache)
            logits = self.model.compute_logits(hidden[batch.last_token_indices()])
            for j, i in enumerate(seqs):
                if start + step >= len(prompts[i]):
                    last[i] = logits[j]
        return last

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> list[int]:
        if temperature <= 0:
            return logits.argmax(-1).tolist()
        probs = torch.softmax(logits / temperature, -1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()
