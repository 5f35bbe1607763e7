"""ModelRunner: ScheduledBatch -> ForwardBatch -> model -> sampler -> StepOutput.

Owns the device side of the cache (`CacheTensors`: latent rows for MLA, state slots for KDA),
whose sizes come from the pure-Python `CachePlan`, and one torch.Generator per request.
References: nano-vllm `engine/model_runner.py`, vLLM v1 `worker/gpu_model_runner.py`.
"""

from __future__ import annotations

import torch

from k3serve.cache.sizing import CachePlan
from k3serve.models.kimi import KimiForCausalLM
from k3serve.runner.forward_batch import CacheTensors, ForwardBatch
from k3serve.sampling.sampler import Sampler
from k3serve.scheduler.batch import ScheduledBatch, StepOutput
from k3serve.scheduler.request import Request


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, plan: CachePlan, kv_dtype: torch.dtype, seed: int = 0,
                 device: str | torch.device = "cpu"):
        self.model, self.plan, self.seed, self.device = model, plan, seed, torch.device(device)
        # checkpoint slots (prefix caching) follow the live slots in the same state tensors
        self.cache = CacheTensors.allocate(model.cfg, plan.num_slots + plan.num_checkpoints, plan.num_blocks,
                                           plan.block_size, kv_dtype=kv_dtype, device=self.device)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        seqs = batch.seqs
        ids = [t for s in seqs for t in s.token_ids]
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            seq_lens=[s.num_tokens for s in seqs], context_lens=[s.start for s in seqs],
            state_slots=[s.state_slot for s in seqs], block_tables=[s.block_table for s in seqs],
            block_size=self.plan.block_size)
        self._copy_states(batch.restore_states)  # a prefix hit resumes from its checkpoint
        hidden = self.model(fb, self.cache)  # [N, d]
        self._copy_states(batch.save_states)  # states exactly at chunk ends become checkpoints
        rows = [e - 1 for s, (_, e) in zip(seqs, fb.seq_bounds()) if s.sample]
        if not rows:
            return StepOutput()
        reqs = [s.request for s in seqs if s.sample]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float().cpu()
        sampled = self.sampler(logits, reqs, [self._generator(r) for r in reqs])
        return StepOutput({r.request_id: t for r, t in zip(reqs, sampled)})

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for t in self.cache.recurrent + self.cache.conv:
            if t is not None:
                t[dst] = t[src]

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            seed = req.params.seed
            if seed is None:  # unseeded: still deterministic for a given engine seed and arrival order
                seed = self.seed * 1_000_003 + req.arrival
            gen = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
        return gen


def weight_bytes(model: KimiForCausalLM) -> int:
    """Bytes of every parameter plus stacked/packed expert weights (MXFP4 counted packed)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for moe in model.moe_layers():
        for w in (moe.w1, moe.w2, moe.w3):
            total += w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
    return total
