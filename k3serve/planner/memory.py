"""Per-rank memory model: weights + activation reserve + runtime overhead -> cache budget, split
into KDA state slots and MLA latent tokens by the engine's own `cache.sizing.plan_cache`.

Activation reserve for one prefill chunk of C tokens (formula, calibrate against a profile run):
  C x hidden x 2 B x (12 live [C, hidden] buffers + AttnRes bank snapshots, layers/block + 1)
  + C x top_k x expert_intermediate x 2 x 2 B / EP   (routed-expert intermediates)
  + max_num_seqs x vocab x 4 B                        (fp32 logits of the sampled rows)
A model with a vision tower also keeps `--mm-encoder-cache` (256 MiB by default) per rank for
tower rows, as the engine does beside its cache plan.
Memory fraction semantics (planner-data.md §3.2): k3serve and vLLM take `fraction x HBM` as the
whole budget (weights, activations and overhead come out of it); SGLang's static fraction
covers weights + cache only, activations live in the remainder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3serve.cache import sizing
from k3serve.cache.sizing import (
    CachePlan,
    kda_state_bytes_per_request,
    mla_cache_bytes_per_token,
    plan_cache,
    spec_records_bytes,
)
from k3serve.config.model_config import ModelConfig
from k3serve.planner.hardware import GPU
from k3serve.config.stages import stage_shares
from k3serve.planner.layout import Layout
from k3serve.planner.weights import WeightSplit

GiB = 2**30


@dataclass(frozen=True)
class Workload:
    context: int = 32768  # max_model_len: tokens per request (prompt + output)
    concurrency: int = 1  # requests at once the deployment must hold
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # prefill chunk
    kv_dtype: str = "bfloat16"
    block_size: int = 16
    memory_fraction: float = 0.92
    overhead_bytes: int = 3 * GiB  # CUDA context, NCCL buffers, GEMM workspaces (non-torch)
    prefix_cache_fraction: float = 0.1  # of the cache budget for KDA checkpoints (0 = caching off)
    spec_tokens: int = 0  # speculative tokens k: per-position KDA states k per request
    draft_bytes: int = 0  # speculative draft weights (replicated per rank)
    draft_cache_bytes: int = 0  # a draft_model drafter's own cache (cache/sizing.py draft_cache_bytes)
    encoder_cache_bytes: int = 256 * 2**20  # vision-tower rows by image digest (models with a tower)
    state_dtype: str = "float32"  # the KDA recurrent state's (--mamba-ssm-cache-dtype)
    # EPLB (--enable-eplb): extra physical expert slots over an expert-parallel layout's ranks
    redundant_experts: int = 0


@dataclass(frozen=True)
class RankMemory:
    hbm: int
    usable: int  # fraction x HBM
    weights: int
    draft_weights: int
    activations: int
    overhead: int
    encoder_cache: int
    cache_budget: int  # what is left for the two cache pools (<= 0: does not fit)
    plan: CachePlan | None  # None when not even one request of `context` fits
    why_not: str | None = None
    draft_cache: int = 0  # a draft_model drafter's own cache

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def headroom(self) -> int:
        return self.cache_budget


def activation_bytes(cfg: ModelConfig, w: Workload, layout: Layout) -> int:
    """The engine's reserve (cache/sizing.py activation_bytes) for bf16 serving."""
    return sizing.activation_bytes(cfg, w.max_num_batched_tokens, w.max_num_seqs, layout.ep)


def rank_memory(
    cfg: ModelConfig, gpu: GPU, layout: Layout, weights: WeightSplit, w: Workload, cache_bytes: int | None = None
) -> RankMemory:
    """One rank's budget; `cache_bytes` skips the GPU arithmetic (what `--cache-memory` does)."""
    tp = layout.tp
    share = stage_shares(cfg, layout.pp)
    redundant = w.redundant_experts if layout.ep > 1 else 0
    wbytes = weights.per_rank(tp, layout.ep, share.moe, share.layers, redundant)
    act = activation_bytes(cfg, w, layout)
    usable = int(gpu.hbm_bytes * w.memory_fraction)
    encoder = w.encoder_cache_bytes if cfg.vision is not None else 0
    # speculative verify records beside the cache, as the engine reserves them (cache/sizing.py)
    records = spec_records_bytes(cfg, w.spec_tokens, w.max_num_seqs, w.state_dtype, tp, share.kda)
    budget = (
        cache_bytes
        if cache_bytes is not None
        else usable - wbytes - w.draft_bytes - w.draft_cache_bytes - act - w.overhead_bytes - encoder - records
    )
    plan, why = None, None
    try:
        if budget <= 0:
            raise ValueError(f"weights and reserves exceed {w.memory_fraction:.2f} x HBM by {-budget / 1e9:.1f} GB")
        plan = plan_cache(
            cfg,
            budget,
            max_model_len=w.context,
            max_num_seqs=w.max_num_seqs,
            block_size=w.block_size,
            kv_dtype=w.kv_dtype,
            checkpoint_fraction=w.prefix_cache_fraction,
            state_shards=tp,
            kda_share=share.kda,
            mla_share=share.mla,
            latent_shards=layout.dcp,
            state_dtype=w.state_dtype,
        )
    except ValueError as e:
        why = str(e)
    return RankMemory(
        gpu.hbm_bytes,
        usable,
        wbytes,
        w.draft_bytes,
        act,
        w.overhead_bytes,
        encoder,
        budget,
        plan,
        why,
        w.draft_cache_bytes,
    )


def max_context_one_request(
    cfg: ModelConfig, rank: RankMemory, layout: Layout, kv_dtype: str, state_dtype: str = "float32"
) -> int:
    """Longest single request the cache budget holds (one state slot + its latent rows)."""
    if rank.cache_budget <= 0:
        return 0
    share = stage_shares(cfg, layout.pp)
    state = -(-int(kda_state_bytes_per_request(cfg, state_dtype) * share.kda) // layout.tp)
    per_token = math.ceil(mla_cache_bytes_per_token(cfg, kv_dtype) * share.mla / layout.dcp)
    if not per_token:
        return cfg.max_position_embeddings
    return max(0, min(cfg.max_position_embeddings, (rank.cache_budget - state) // per_token))
