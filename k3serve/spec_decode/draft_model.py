"""`draft_model` drafter: any small checkpoint this engine loads, run autoregressively for k
tokens with its own hybrid cache (latent blocks + a KDA state slot per request).

Per step and request: catch up on the committed tokens the draft has not seen (one batched
prefill), draft token 1 from the last logits, snapshot the draft's KDA states, run k - 1
batched decode steps, then restore the snapshot so the draft's cache again ends exactly at the
committed prefix (its own rollback; latent rows past it are rewritten before being read).
"""

from __future__ import annotations

import torch

from k3serve.cache.manager import HybridCacheManager
from k3serve.cache.sizing import DRAFT_BLOCK as BLOCK, draft_cache_shape
from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.scheduler.request import Request
from k3serve.spec_decode.drafting import draft_token, request_generator, stack_q
from k3serve.spec_decode.proposer import Draft


class DraftModelProposer:
    def __init__(
        self,
        model,
        target_cfg,
        draft_sample_method: str,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device | None = None,
    ):
        """`device`: the target's; the draft model and its cache live there."""
        if model.cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"draft vocab {model.cfg.vocab_size} != target vocab {target_cfg.vocab_size}")
        self.device = torch.device(device or "cpu")
        self.model, self.method = model.to(self.device), draft_sample_method
        slots, blocks = draft_cache_shape(max_num_seqs, max_model_len)  # what the engine reserved for it
        self.manager = HybridCacheManager(blocks, slots, BLOCK)
        self.cache = CacheTensors.allocate(model.cfg, slots, blocks, BLOCK, kv_dtype=model.dtype, device=self.device)
        self._done: dict[str, int] = {}  # tokens the draft has computed, per request
        self._last: dict[str, torch.Tensor] = {}  # draft logits after the newest computed token
        self._gens: dict[str, torch.Generator] = {}

    @classmethod
    def load(
        cls,
        path: str,
        target,
        draft_sample_method: str,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device | None = None,
    ):
        from k3serve.models.registry import load_model

        return cls(
            load_model(path, progress=False), target.cfg, draft_sample_method, max_model_len, max_num_seqs, device
        )

    def observe(self, request_id: str, taps) -> None:
        pass

    def release(self, request_id: str) -> None:
        self._done.pop(request_id, None)
        self._last.pop(request_id, None)
        self._gens.pop(request_id, None)
        if self.manager.holds(request_id):
            self.manager.free(request_id)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        for r, k in zip(reqs, ks):
            rid, need = r.request_id, r.num_tokens + k
            if not self.manager.holds(rid):
                self.manager.allocate(rid, need)
                self._done[rid] = 0
            elif self.manager.append(rid, need) is None:
                raise RuntimeError("draft cache exhausted")  # sized for max_num_seqs x max_model_len
        # 1) catch up on committed tokens; logits of the newest one give draft token 1
        behind = [r for r in reqs if self._done[r.request_id] < r.num_tokens]
        if behind:  # (a request drafted for but not scheduled last step has nothing new)
            starts = [self._done[r.request_id] for r in behind]
            rows = self._forward(behind, [r.all_token_ids[s:] for r, s in zip(behind, starts)], starts)
            for r, row in zip(behind, rows):
                self._done[r.request_id], self._last[r.request_id] = r.num_tokens, row
        logits = torch.stack([self._last[r.request_id] for r in reqs])
        toks, qs = [[] for _ in reqs], [[] for _ in reqs]
        self._pick(reqs, ks, logits, toks, qs)
        # 2) k - 1 decode steps from a snapshot, then roll the draft's state back to it
        slots = torch.tensor([self.manager.state_slot(r.request_id) for r in reqs], device=self.device)
        snap = [(t[slots].clone() if t is not None else None) for t in self.cache.recurrent + self.cache.conv]
        for j in range(1, max(ks)):
            live = [i for i, k in enumerate(ks) if k > j and len(toks[i]) == j]
            if not live:
                break
            sub = [reqs[i] for i in live]
            logits = self._forward(sub, [[toks[i][-1]] for i in live], [r.num_tokens + j - 1 for r in sub])
            self._pick(sub, [ks[i] for i in live], logits, [toks[i] for i in live], [qs[i] for i in live])
        for t, s in zip(self.cache.recurrent + self.cache.conv, snap):
            if t is not None:
                t[slots] = s
        V = self.model.cfg.vocab_size
        return [Draft(t, stack_q(q, t, V)) for t, q in zip(toks, qs)]

    def _forward(self, reqs: list[Request], pieces: list[list[int]], starts: list[int]) -> torch.Tensor:
        ids = torch.tensor([t for p in pieces for t in p], device=self.device)
        fb = ForwardBatch(
            ids,
            [len(p) for p in pieces],
            starts,
            [self.manager.state_slot(r.request_id) for r in reqs],
            [self.manager.block_table(r.request_id) for r in reqs],
            BLOCK,
        )
        hidden = self.model(fb, self.cache).hidden
        last = fb.last_token_indices().to(self.device)
        return self.model.compute_logits(hidden[last]).float().cpu()  # drafts are picked on the CPU

    def _pick(self, reqs, ks, logits, toks, qs) -> None:
        for i, r in enumerate(reqs):
            if len(toks[i]) < ks[i]:
                t, q = draft_token(logits[i], r, toks[i], self.method, request_generator(self._gens, r, salt=29))
                toks[i].append(t)
                qs[i].append(q)
